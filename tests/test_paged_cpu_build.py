"""The paged_cpu attention variant in a build: what the rule table picks, what the artifact says, how the
backend runs it, and where the variant is refused.

The demo artifact shared by the suite is built with the rule table (--no-autotune), whose first choice on
ONNX Runtime CPU is paged_cpu, so the engine tests (prefix caching, copy-on-write, preemption) and the
server tests run through the C kernel; this file checks that this is so and what the artifact records.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import make_random_checkpoint, needs_ort, write_recipe

from compiler.build import build
from compiler.fusion.pipeline import nodes_per_layer
from runtime.artifact import pass_changes
from runtime.engine import LLMEngine
from runtime.sampling import SamplingParams


def test_the_demo_artifact_runs_the_kernel(demo_artifact: Path) -> None:
    manifest = json.loads((demo_artifact / "manifest.json").read_text())
    assert manifest["kernels"]["attention"]["variant"] == "paged_cpu"
    assert manifest["kernels"]["attention"]["implementation"] == "optimize.PagedAttention"
    runtime = json.loads((demo_artifact / "runtime.json").read_text())
    assert runtime["graph"]["kv_write"] == "graph"
    model = onnx.load(str(demo_artifact / "model.onnx"), load_external_data=False)
    # fused with the QKV split and both rotations (compiler/fusion/attention.py): one node per layer reads
    # the packed QKV projection
    attention = [n for n in model.graph.node if n.op_type == "RotaryPagedAttention"]
    assert len(attention) == 6 and all(n.domain == "optimize" for n in attention)
    assert {"key_cache.0", "value_cache.0", "positions"} <= set(attention[0].input)  # the pools, in place
    assert not any(n.op_type in ("RotaryEmbedding", "Reshape", "PagedAttention") for n in model.graph.node)
    # the kernel writes the step's K/V: the graph returns the logits only
    assert [o.name for o in model.graph.output] == ["logits"] == runtime["graph"]["outputs"]
    engine = LLMEngine(demo_artifact)
    assert engine.backend.kv_in_graph
    # the step's K/V go into the pools through the graph: a prefill fills exactly the slots it was given
    before = [p.copy() for p in engine.backend.k_pools]
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    changed = [int(np.any(p != b, axis=(1, 2, 3)).sum()) for p, b in zip(engine.backend.k_pools, before, strict=True)]
    assert changed == [3] * 6  # 37 prompt tokens -> 3 blocks of 16, in every layer


def test_fusion_reports_nodes_per_decoder_layer(demo_artifact: Path) -> None:
    manifest = json.loads((demo_artifact / "manifest.json").read_text())
    fuse = next(p for p in manifest["passes"] if p["name"] == "fuse")
    per_layer = fuse["stats"]["nodes_per_layer"]
    # a layer: QKV, attention (split and rotations inside), o_proj, skip-norm, gate/up, SiLU(gate) * up,
    # down, skip-norm (no gather of the past, no masks, no reshapes, no split of the MLP)
    assert per_layer["before"] > per_layer["after"] and per_layer["after"] == 8
    assert fuse["stats"]["fusions"]["swiglu"] == 6
    assert not {"Split", "QuickGelu", "com.microsoft.QuickGelu"} & set(fuse["stats"]["op_types"])
    assert f"(per decoder layer {per_layer['before']} -> {per_layer['after']})" in pass_changes(fuse)
    model = onnx.load(str(demo_artifact / "model.onnx"), load_external_data=False)
    assert nodes_per_layer(model) == per_layer["after"]
    assert len(model.graph.node) == fuse["stats"]["nodes_after"]


def _kv_build(tmp_path: Path, ckpt: Path, name: str, kernel: str, dtype: str = "int8") -> Path:
    passes = (f"  - name: select_attention\n    options: {{autotune: false, kernel: {kernel}}}\n  - name: capture\n"
              f"  - name: quantize_kv_cache\n    options: {{dtype: {dtype}}}\n  - name: lower_onnx\n"
              "  - name: lower_quant\n  - name: fuse\n  - name: package\n")
    calib = tmp_path / "calib.txt"
    calib.write_text("def f(x):\n    return x + 1\n" * 200, encoding="utf-8")
    extra = f"calibration:\n  data: {calib}\n  num_samples: 2\n  seq_len: 32\n"
    return build(write_recipe(tmp_path, ckpt, name=name, passes=passes, extra=extra), progress=False)


def test_an_int8_kv_cache_is_read_and_written_by_the_kernel(tmp_path: Path) -> None:
    """int8 pools with per-head scales: the rule table keeps paged_cpu, lower_quant hands the kernel the
    scales, the rotary fusion keeps them, and the runtime's pools are int8. The kernel attends to the past as
    stored (int8) and to the step's own K/V unquantized, as the decomposed path does, so the two give the
    same logits, chunked prefill (past read back from the int8 pool) included."""
    from test_parity import chunked_logits

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", num_hidden_layers=1)
    artifact = _kv_build(tmp_path, ckpt, "kvq", "auto")
    manifest = json.loads((artifact / "manifest.json").read_text())
    sel = next(p for p in manifest["passes"] if p["name"] == "select_attention")["stats"]
    reasons = {c["variant"]: c["reason"] for c in sel["candidates"]}
    assert sel["choice"] == "paged_cpu" and "int8 pools" in reasons["paged_cpu"]
    lq = next(p for p in manifest["passes"] if p["name"] == "lower_quant")["stats"]["kv_cache"]
    assert lq["layers_read_by_the_kernel"] == 1
    runtime = json.loads((artifact / "runtime.json").read_text())
    assert runtime["graph"]["kv_write"] == "graph" and runtime["kv_cache"]["dtype"] == "int8"
    model = onnx.load(str(artifact / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "RotaryPagedAttention")
    assert len(node.input) == 11 and {i.name: i.type.tensor_type.elem_type for i in model.graph.input}[
        "key_cache.0"] == onnx.TensorProto.INT8
    engine = LLMEngine(artifact, verify=False)
    assert engine.backend.k_pools[0].dtype == np.int8
    ids = list(range(5, 60))
    cuts = [7, 16, 17, 40, len(ids)]
    chunked = chunked_logits(engine, ids, cuts)
    whole = chunked_logits(LLMEngine(artifact, verify=False), ids, [len(ids)])
    decomposed = _kv_build(tmp_path, ckpt, "kvq-dec", "decomposed")
    ref_chunked = chunked_logits(LLMEngine(decomposed, verify=False), ids, cuts)
    ref_whole = chunked_logits(LLMEngine(decomposed, verify=False), ids, [len(ids)])
    assert np.abs(chunked - ref_chunked).max() < 1e-4 and np.abs(whole - ref_whole).max() < 1e-4
    assert np.abs(chunked - whole).max() > 1e-3  # a chunk reads the earlier ones back from the int8 pool
    engine.add_request("r", ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 16  # decoded through the int8 pools written by the kernel


@needs_ort("fp8_kv_cache")
def test_an_fp8_kv_cache_takes_another_variant(tmp_path: Path) -> None:
    """E4M3 pools: the kernel reads float32 or int8 pools, so the rule table falls through with the reason."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", num_hidden_layers=1)
    artifact = _kv_build(tmp_path, ckpt, "kvq8", "auto", dtype="fp8")
    manifest = json.loads((artifact / "manifest.json").read_text())
    sel = next(p for p in manifest["passes"] if p["name"] == "select_attention")["stats"]
    reasons = {c["variant"]: c["reason"] for c in sel["candidates"]}
    assert sel["choice"] == "decomposed" and "FP8 pools" in reasons["paged_cpu"]
    assert json.loads((artifact / "runtime.json").read_text())["graph"]["kv_write"] == "runtime"


def test_forcing_the_kernel_on_a_gpu_target_is_refused(tmp_path: Path) -> None:
    from compiler.passes.base import BuildError

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", num_hidden_layers=1)
    passes = "  - name: select_attention\n    options: {kernel: paged_cpu}\n  - name: capture\n  - name: package\n"
    recipe = write_recipe(tmp_path, ckpt, name="torchgpu", passes=passes, backend="torch", device="cuda",
                          dtype="float16")
    with pytest.raises(BuildError, match="paged_cpu.*CPU execution provider only"):
        build(recipe, progress=False)


def test_the_cpu_backend_runs_onnxruntime_s_arena_without_memory_patterns(demo_artifact: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU arena is on by default, with memory patterns off (bench/arena.py measures why);
    OPTIMIZE_ORT_ARENA=0 turns the arena off and leaves ONNX Runtime's memory patterns on. Both generate the
    same greedy tokens."""
    out = {}
    for env in ("", "0"):
        if env:
            monkeypatch.setenv("OPTIMIZE_ORT_ARENA", env)
        else:
            monkeypatch.delenv("OPTIMIZE_ORT_ARENA", raising=False)
        engine = LLMEngine(demo_artifact)
        options = engine.backend.session.get_session_options()
        assert options.enable_cpu_mem_arena is (env != "0")
        assert options.enable_mem_pattern is (env == "0")
        engine.add_request("a", list(range(3, 60)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out[env] = o.token_ids
    assert out[""] == out["0"] and len(out[""]) == 8


def test_the_cpu_backend_fixes_glibc_mmap_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large buffers stay mmapped (returned to the system when freed) instead of following glibc's
    dynamic threshold; 0 leaves glibc alone."""
    import platform

    from runtime.backends.onnxruntime import fix_mmap_threshold

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert fix_mmap_threshold() == ((1 << 20) if glibc else None)
    monkeypatch.setenv("OPTIMIZE_MMAP_THRESHOLD", str(4 << 20))
    assert fix_mmap_threshold() == ((4 << 20) if glibc else None)
    monkeypatch.setenv("OPTIMIZE_MMAP_THRESHOLD", "0")
    assert fix_mmap_threshold() is None
    monkeypatch.delenv("OPTIMIZE_MMAP_THRESHOLD")
    fix_mmap_threshold()  # back to the backend's default for the rest of the session
