"""Streamed builds for every target: the torch target's model.pt2, the CUDA ONNX Runtime graph and TensorRT's
ONNX input are written weight by weight and come out byte for byte as a build that loads the whole model writes.

A random 2-layer Llama (tied head), once with `capture: {weights: stream}` and once with `weights: load`:
- torch/cpu and torch/cuda (float32, bfloat16, float16; INT4 RTN / GPTQ / AWQ, FP8 with static activations,
  through lower_quant_torch): the same model.pt2 (compiler/streamed_pt2.py writes torch.export.save's archive
  with each weight computed when its turn comes), and the streamed artifact serves.
- onnxruntime/cuda (float16 INT4) and onnxruntime/cpu (INT8, fused) with plan_cuda_graphs, whose decode buckets
  run on weights made as zeros during the run (plan_cuda_graphs.with_zero_weights): the same model.onnx and
  model.onnx.data.
- tensorrt/cuda (float16, symmetric INT4 as Q/DQ): the passes up to build_engine run here, then the graph TensorRT's
  parser would read is written by build_engine's own writer (`write_parser_input`); TensorRT itself needs a GPU
  (tests/gpu).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, make_random_checkpoint, needs_ort, write_recipe

from compiler import streamed
from compiler.build import build, plan
from compiler.passes.base import BuildContext
from compiler.passes.build_engine import write_parser_input

CALIBRATION = f"calibration:\n  data: {ROOT / 'models' / 'pycode-llama-6m' / 'calib.txt'}\n  num_samples: 4\n  seq_len: 128\n"
QUANTIZE = {
    "rtn": "  - name: quantize_rtn\n",
    "rtn-symmetric": "  - name: quantize_rtn\n    options: {symmetric: true}\n",
    "gptq": "  - name: quantize_gptq\n    options: {act_order: true}\n",
    "awq": "  - name: quantize_awq\n",
    "fp8-static": "  - name: quantize_fp8\n    options: {activations: static, ignore: [lm_head, embed_tokens]}\n",
    "int8": "  - name: quantize_int8\n",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("tied") / "ckpt", "LlamaForCausalLM", seed=3,
                                  hidden_size=256, head_dim=64, intermediate_size=704, tie_word_embeddings=True)


def both_ways(tmp_path: Path, ckpt: Path, passes: str, method: str, **target: str) -> dict[str, Path]:
    """The recipe's folder for `weights: stream` and `weights: load` ({mode: recipe path}); the plan streams only
    the first."""
    out = {}
    for mode in ("stream", "load"):
        text = passes.replace("  - name: capture\n", f"  - name: capture\n    options: {{weights: {mode}}}\n")
        (tmp_path / mode).mkdir()
        out[mode] = write_recipe(tmp_path / mode, ckpt, name=f"{method}-{mode}", passes=text,
                                 extra=CALIBRATION if method in ("gptq", "awq", "fp8-static") else "", **target)
        p = plan(out[mode])
        assert p.streamed == (mode == "stream"), p.loads_model_because
    return out


def stats_of(artifact: Path) -> dict[str, dict]:
    return {r["name"]: r.get("stats", {}) for r in json.loads((artifact / "manifest.json").read_text())["passes"]}


@pytest.mark.parametrize(("device", "dtype", "method"), [
    ("cpu", "float32", "rtn"),
    ("cpu", "float32", "fp8-static"),
    ("cuda", "bfloat16", "gptq"),
    ("cuda", "float16", "awq"),
])
def test_streamed_torch_target_writes_the_model_pt2_of_a_loaded_build(tmp_path: Path, ckpt: Path, device: str,
                                                                      dtype: str, method: str) -> None:
    """model.pt2 byte for byte: the program, the weights config and every weight record (INT4 packed codes,
    scales and zero points; FP8 codes and scales; the float embedding, head and norms); the streamed
    build wrote the deferred weights itself, and plan_cuda_graphs checked every bucket on fake tensors."""
    lowering = QUANTIZE[method] + "  - name: lower_quant_torch\n"
    passes = "  - name: capture\n" + lowering + "  - name: plan_cuda_graphs\n  - name: package\n"
    recipes = both_ways(tmp_path, ckpt, passes, method, backend="torch", device=device, dtype=dtype)
    built = {mode: build(r, progress=False, autotune=False) for mode, r in recipes.items()}
    assert (built["stream"] / "model.pt2").read_bytes() == (built["load"] / "model.pt2").read_bytes()
    stats = stats_of(built["stream"])
    assert stats["capture"]["streamed_parameters"] == 2 * 7 + 2  # and the embedding and the head (read from it)
    assert stats["lower_quant_torch"]["streamed"] == 2 * 7
    assert "streamed" not in stats_of(built["load"])["lower_quant_torch"]
    parts = 2 if method == "fp8-static" else 3  # FP8: codes and scales; INT4: packed codes, scales, zero points
    assert stats["package"]["streamed_tensors"] == 2 * 7 * parts + 2  # and the float embedding and head
    assert stats["plan_cuda_graphs"]["verified_buckets"] == stats_of(built["load"])["plan_cuda_graphs"][
        "verified_buckets"] == [1, 2, 4, 8]
    if device == "cpu" and method == "rtn":  # the streamed artifact serves (greedy, as the loaded one)
        from runtime import LLM, SamplingParams

        tokens = []
        for mode in ("stream", "load"):
            out = LLM(str(built[mode])).generate(["def f(x):\n    return"],
                                                 SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            tokens.append(list(out[0].token_ids))
        assert tokens[0] == tokens[1] and len(tokens[0]) == 8


@pytest.mark.parametrize(("device", "dtype", "method"), [
    pytest.param("cuda", "float16", "rtn", marks=needs_ort("paged_attention")), ("cpu", "float32", "int8")])
def test_streamed_onnx_runtime_targets_with_cuda_graph_plans(tmp_path: Path, ckpt: Path, device: str, dtype: str,
                                                             method: str) -> None:
    """onnxruntime/cuda in float16 (INT4 MatMulNBits) and onnxruntime/cpu (INT8, fused), each with
    plan_cuda_graphs: the same model.onnx and model.onnx.data; on CPU the bucket runs of the streamed graph
    (weights made as zeros during the run) verify the same buckets as the loaded graph's."""
    passes = ("  - name: select_attention\n  - name: capture\n" + QUANTIZE[method] + "  - name: lower_onnx\n"
              "  - name: lower_quant\n  - name: fuse\n  - name: plan_cuda_graphs\n  - name: package\n")
    recipes = both_ways(tmp_path, ckpt, passes, method, device=device, dtype=dtype)
    built = {mode: build(r, progress=False, autotune=False) for mode, r in recipes.items()}
    for f in ("model.onnx", "model.onnx.data"):
        assert (built["stream"] / f).read_bytes() == (built["load"] / f).read_bytes(), f
    stats, loaded = stats_of(built["stream"]), stats_of(built["load"])
    assert stats["package"]["streamed_tensors"] > 0
    assert stats["plan_cuda_graphs"]["verified_buckets"] == loaded["plan_cuda_graphs"]["verified_buckets"]
    if device == "cpu":
        assert stats["plan_cuda_graphs"]["verified_buckets"] == [1, 2, 4, 8]


@needs_ort("int4_cast")
def test_streamed_tensorrt_input_is_the_loaded_graph(tmp_path: Path, ckpt: Path) -> None:
    """tensorrt/cuda in float16 with symmetric INT4 (signed int4 Q/DQ) streams: the passes before build_engine
    run on either build, and build_engine's writer gives TensorRT's parser the same model.onnx and
    model.onnx.data, the streamed one computing each weight as it writes it. plan_cuda_graphs verified the
    buckets on zeros made during the run."""
    passes = ("  - name: select_attention\n  - name: capture\n" + QUANTIZE["rtn-symmetric"] + "  - name: lower_onnx\n"
              "  - name: lower_quant\n    options: {int4_format: qdq}\n  - name: plan_cuda_graphs\n"
              "  - name: build_engine\n  - name: package\n")
    recipes = both_ways(tmp_path, ckpt, passes, "rtn", backend="tensorrt", device="cuda", dtype="float16")
    written, verified = {}, {}
    for mode, recipe in recipes.items():
        p = plan(recipe)
        ctx = BuildContext(recipe=p.recipe, checkpoint=p.checkpoint, staging=tmp_path / mode / "staging")
        ctx.artifacts.update(no_autotune=True, streamed=p.streamed)
        try:
            for ps in p.passes[:[q.name for q in p.passes].index("build_engine")]:
                stats = ps.run(ctx)
                ctx.completed.append(ps.name)
            verified[mode] = stats["verified_buckets"]
            (tmp_path / mode / "parser").mkdir()
            _path, written[mode] = write_parser_input(ctx.artifacts["onnx"], tmp_path / mode / "parser")
        finally:
            streamed.reset()
    assert written["stream"] > 0 and written["load"] == 0
    assert verified["stream"] == verified["load"] == [1, 2, 4, 8]
    for f in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "stream" / "parser" / f).read_bytes() == (tmp_path / "load" / "parser" / f).read_bytes(), f


def test_a_bfloat16_tensorrt_graph_is_planned_without_running_its_buckets(tmp_path: Path, ckpt: Path) -> None:
    """ONNX Runtime's CPU provider has no bfloat16 arithmetic, so plan_cuda_graphs cannot run a tensorrt/bfloat16
    graph's buckets: the plan says why (naming the node) and rests on the taint analysis, instead of failing the
    build."""
    recipe = write_recipe(tmp_path, ckpt, name="trt-bf16", backend="tensorrt", device="cuda", dtype="bfloat16",
                          passes="  - name: select_attention\n  - name: capture\n  - name: lower_onnx\n"
                                 "  - name: plan_cuda_graphs\n  - name: build_engine\n  - name: package\n")
    p = plan(recipe)
    ctx = BuildContext(recipe=p.recipe, checkpoint=p.checkpoint, staging=tmp_path / "staging")
    ctx.artifacts.update(no_autotune=True, streamed=p.streamed)
    try:
        for ps in p.passes[:[q.name for q in p.passes].index("build_engine")]:
            stats = ps.run(ctx)
            ctx.completed.append(ps.name)
    finally:
        streamed.reset()
    assert stats["capturable"] and stats["verified_buckets"] == []
    assert "ONNX Runtime CPU cannot run the graph" in stats["buckets_not_run"] and "node" in stats["buckets_not_run"]
