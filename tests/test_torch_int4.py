"""INT4 weights in the torch targets' program (quantize_rtn / quantize_awq / quantize_gptq + lower_quant_torch):
the artifact stores the packed codes (half a byte per weight) with float32 scales and uint8 zero points
per group, and computes what the ONNX INT4 artifact (MatMulNBits) of the same recipe computes. On CPU
the op dequantizes; its Triton kernel is checked in the interpreter (tests/test_gpu_targets.py) and
compiled on a GPU (tests/gpu)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEMO_MODEL, make_random_checkpoint, write_recipe
from test_torch_fp8 import CALIBRATION, _batch

from compiler.build import build, plan
from compiler.recipe import RecipeError
from runtime.engine import LLMEngine

INT4 = {
    "rtn": "  - name: quantize_rtn\n    options:\n      group_size: 32\n      ignore: [lm_head]\n",
    "gptq": "  - name: quantize_gptq\n    options:\n      group_size: 32\n      ignore: [lm_head]\n",
}


@pytest.mark.parametrize("method", ["gptq"])  # rtn and awq share the stored form (compiler/quant/int4.py)
def test_torch_int4_program_matches_the_onnx_int4_artifact(tmp_path: Path, method: str) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "Qwen2ForCausalLM", seed=5)  # QKV bias: Int4Linear bias
    extra = CALIBRATION if method == "gptq" else ""
    onnx_art = build(write_recipe(tmp_path, ckpt, name="onnx-int4", extra=extra, passes=(
        "  - name: capture\n" + INT4[method] + "  - name: lower_onnx\n  - name: lower_quant\n"
        "    options: {accuracy_level: 0}\n  - name: package\n")),  # float compute, as the program's
        progress=False)
    torch_art = build(write_recipe(tmp_path, ckpt, name="torch-int4", backend="torch", extra=extra, passes=(
        "  - name: capture\n" + INT4[method] + "  - name: lower_quant_torch\n  - name: package\n")),
        progress=False)
    manifest = json.loads((torch_art / "manifest.json").read_text())
    stats = next(p["stats"] for p in manifest["passes"] if p["name"] == "lower_quant_torch")
    assert stats["int4_linears"] == 14 and stats["int4_linear_calls"] == 14  # 7 Linears x 2 layers, lm_head float
    assert "fp8_linears" not in stats
    # codes 0.5 B + scale 4 B / 32 + zero 1 B / 32 per weight: 0.656 of 4 B
    assert 0.16 < stats["weight_bytes"] / stats["float_weight_bytes"] < 0.17, stats
    program = torch.export.load(str(torch_art / "model.pt2"))
    packed = {k: v for k, v in program.state_dict.items() if k.endswith(".weight_packed")}
    assert len(packed) == 14 and all(v.dtype == torch.uint8 for v in packed.values())
    assert packed["layers.0.mlp.down_proj.weight_packed"].shape == (64, 64)  # [N, K/2]: K = 128
    assert not [k for k, v in program.state_dict.items() if v.dtype == torch.float32 and k.endswith("proj.weight")]
    from runtime.artifact import pass_changes

    line = pass_changes(next(p for p in manifest["passes"] if p["name"] == "lower_quant_torch"))
    assert "INT4 Linears x14 (" in line, line
    fb = _batch()
    ours = LLMEngine(torch_art).backend.forward(fb)
    theirs = LLMEngine(onnx_art).backend.forward(fb)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    # the same quantized weights: the ONNX artifact's MatMulNBits codes are the program's
    onnx_manifest = json.loads((onnx_art / "manifest.json").read_text())
    q_onnx = next(p["stats"] for p in onnx_manifest["passes"] if p["name"] == f"quantize_{method}")
    q_torch = next(p["stats"] for p in manifest["passes"] if p["name"] == f"quantize_{method}")
    assert q_onnx["quantized"] == q_torch["quantized"]


def test_torch_targets_refuse_kv_cache_quantization(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL, backend="torch", extra=CALIBRATION, passes=(
        "  - name: capture\n" + INT4["rtn"] + "  - name: quantize_kv_cache\n  - name: lower_quant_torch\n"
        "  - name: package\n"))
    with pytest.raises(RecipeError, match="'quantize_kv_cache' does not apply to the torch target") as e:
        plan(recipe)
    assert e.value.field == "passes[2].name"


def test_float16_torch_cuda_awq_searches_in_float32_and_passes_its_gate(tmp_path: Path) -> None:
    """recipes/demo-torch-cuda-int4-awq.yaml's shape on a random model: AWQ on a float16 target (its
    scale search runs in float32, compiler.quant.calibration.float32_search), the program keeps float16
    activations and INT4 weights, and its quality gate (the program on CPU against float32) passes."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=11)
    quality = (f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_eval_tokens: 512\n"
               "  max_perplexity_increase_pct: 5.0\n")
    passes = ("  - name: select_attention\n  - name: capture\n  - name: quantize_awq\n    options:\n"
              "      group_size: 32\n      n_grid: 4\n      ignore: [lm_head]\n  - name: lower_quant_torch\n"
              "  - name: plan_cuda_graphs\n  - name: package\n")
    art = build(write_recipe(tmp_path, ckpt, backend="torch", device="cuda", dtype="float16",
                             extra=CALIBRATION + quality, passes=passes), progress=False)
    manifest = json.loads((art / "manifest.json").read_text())
    stats = next(p["stats"] for p in manifest["passes"] if p["name"] == "lower_quant_torch")
    assert stats["int4_linears"] == 14
    # q, k, v, o, gate, up, down of 2 layers (hidden 64, kv 32, intermediate 128) at 2 bytes: float16 again
    assert stats["float_weight_bytes"] == 2 * 2 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64)
    program = torch.export.load(str(art / "model.pt2"))
    floats = {v.dtype for k, v in program.state_dict.items() if v.is_floating_point() and "weight_scale" not in k}
    assert floats == {torch.float16}, floats  # norms, embeddings, lm_head back in the target dtype
    assert manifest["cuda_graphs"]["capturable"]
    quality = manifest["quality"]
    assert quality["evaluated"] and quality["passed"], quality
    logits = LLMEngine(art, device="cpu").backend.forward(_batch())
    assert logits.shape == (22, 4096) and np.isfinite(logits).all()
