"""FP8 weights in the torch targets' program (quantize_fp8 + lower_quant_torch): the artifact stores
float8_e4m3fn weights and computes what the ONNX FP8 artifact of the same recipe computes (CPU: the
dequantized product on the fake-quantized input; torch._scaled_mm on FP8 GPUs is in tests/gpu)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEMO_MODEL, make_random_checkpoint, needs_ort, write_recipe

from compiler.build import build, plan
from compiler.recipe import RecipeError
from runtime.engine import LLMEngine
from runtime.forward_batch import ForwardBatch

CALIBRATION = f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n  num_samples: 4\n  seq_len: 128\n"
QUALITY = f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_eval_tokens: 512\n  max_perplexity_increase_pct: 2.0\n"


def _fp8(activations: str) -> str:
    return (f"  - name: quantize_fp8\n    options:\n      activations: {activations}\n"
            "      ignore: [lm_head, embed_tokens]\n")


def _batch() -> ForwardBatch:
    rng = np.random.default_rng(0)
    lens = [7, 12, 3]
    ids = rng.integers(3, 4096, size=sum(lens)).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    cu = np.cumsum([0] + lens).astype(np.int32)
    table = np.array([[0], [1], [2]], np.int32)
    slots = np.concatenate([b * 16 + np.arange(n) for b, n in enumerate(lens)]).astype(np.int64)
    return ForwardBatch(input_ids=ids, positions=pos, cu_seqlens=cu, past_lens=np.zeros(3, np.int32),
                        block_table=table, slot_mapping=slots, logits_index=np.arange(len(ids), dtype=np.int64))


@needs_ort("fp8_activations")
@pytest.mark.parametrize("activations", ["static", "dynamic"])
def test_torch_fp8_program_matches_the_onnx_fp8_artifact(tmp_path: Path, activations: str) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "Qwen2ForCausalLM", seed=4)  # QKV bias: Fp8Linear bias
    extra = CALIBRATION + (QUALITY if activations == "static" else "")  # the gate once: it is the slow part
    onnx_art = build(write_recipe(tmp_path, ckpt, name="onnx-fp8", extra=extra, passes=(
        "  - name: capture\n" + _fp8(activations) + "  - name: lower_onnx\n  - name: lower_quant\n"
        "  - name: package\n")), progress=False)
    torch_art = build(write_recipe(tmp_path, ckpt, name="torch-fp8", backend="torch", extra=extra, passes=(
        "  - name: capture\n" + _fp8(activations) + "  - name: lower_quant_torch\n  - name: package\n")),
        progress=False)
    manifest = json.loads((torch_art / "manifest.json").read_text())
    stats = next(p["stats"] for p in manifest["passes"] if p["name"] == "lower_quant_torch")
    assert stats["fp8_linears"] == 14 and stats["fp8_linear_calls"] == 14  # 7 Linears x 2 layers, lm_head float
    assert stats["weight_bytes"] < 0.3 * stats["float_weight_bytes"]
    program = torch.export.load(str(torch_art / "model.pt2"))
    fp8 = [k for k, v in program.state_dict.items() if v.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 14 and all(k.endswith(".weight") for k in fp8)
    assert manifest["quality"]["evaluated"] == (activations == "static")
    from runtime.artifact import pass_changes

    line = pass_changes(next(p for p in manifest["passes"] if p["name"] == "lower_quant_torch"))
    assert line.startswith("nodes ") and "FP8 Linears x14 (" in line, line
    fb = _batch()
    ours = LLMEngine(torch_art).backend.forward(fb)
    theirs = LLMEngine(onnx_art).backend.forward(fb)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.97
    if activations == "static":
        assert manifest["quality"]["passed"]
        ref = json.loads((onnx_art / "manifest.json").read_text())["quality"]["metrics"]["perplexity"]
        assert abs(manifest["quality"]["metrics"]["perplexity"] / ref - 1) < 1e-3


def test_torch_quantization_needs_lower_quant_torch(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL, backend="torch", extra=CALIBRATION, passes=(
        "  - name: capture\n" + _fp8("static") + "  - name: package\n"))
    with pytest.raises(RecipeError, match="needs 'lower_quant_torch' later in the list") as e:
        plan(recipe)
    assert e.value.field == "passes[1].name"
    recipe = write_recipe(tmp_path, DEMO_MODEL, extra=CALIBRATION, passes=(
        "  - name: capture\n" + _fp8("static") + "  - name: lower_onnx\n  - name: lower_quant\n"
        "  - name: lower_quant_torch\n  - name: package\n"))
    with pytest.raises(RecipeError, match="the onnxruntime target uses lower_quant") as e:
        plan(recipe)
    assert e.value.field == "passes[4].name"


def test_float16_torch_cuda_fp8_calibrates_in_its_dtype(tmp_path: Path) -> None:
    """recipes/demo-torch-cuda-fp8.yaml's shape (float16 target, Triton attention, static FP8 activations)
    on a random model: calibration runs the float16 layers on float16 inputs, and the quality gate (the
    program on CPU against the float32 checkpoint) passes."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=9)
    passes = ("  - name: select_attention\n  - name: capture\n" + _fp8("static")
              + "  - name: lower_quant_torch\n  - name: plan_cuda_graphs\n  - name: package\n")
    art = build(write_recipe(tmp_path, ckpt, backend="torch", device="cuda", dtype="float16",
                             extra=CALIBRATION + QUALITY, passes=passes), progress=False)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["kernels"]["attention"]["variant"] == "triton" and manifest["target"]["dtype"] == "float16"
    stats = next(p["stats"] for p in manifest["passes"] if p["name"] == "lower_quant_torch")
    assert stats["fp8_linears"] == 14
    quality = manifest["quality"]
    assert quality["evaluated"] and quality["passed"]
    assert abs(quality["metrics"]["perplexity_increase_pct"]) < 2.0 and quality["metrics"]["token_agreement"] > 0.8
    assert LLMEngine(art, device="cpu").backend.forward(_batch()).shape == (22, 4096)
