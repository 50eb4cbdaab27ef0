"""The TensorRT target on a CPU machine: recipe checks, the engine compatibility refusal, the early
missing-package failure, the ONNX legalization and support check, the profiles, and the build pass and
backend driven end to end through a CPU stand-in for tensorrt/pycuda/cuda-python (tests/fake_gpu.py)
against the ONNX Runtime CPU artifact of the same checkpoint. Real engines: tests/gpu/test_tensorrt.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import DEMO_MODEL, ROOT, make_random_checkpoint, write_recipe

from compiler.build import build, plan
from compiler.passes.base import BuildError
from compiler.recipe import RecipeError
from runtime.artifact import Artifact, pass_changes, write_manifest
from runtime.backends import tensorrt as trt_backend
from runtime.backends.tensorrt import (
    StagingLayout,
    TensorRTBackend,
    engine_compatibility,
    engine_record,
)
from runtime.forward_batch import ForwardBatch
from runtime.gpu import Device, GpuEnvironment, missing_for, probe

H100 = {"tensorrt_version": "10.3.0", "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
BUILT = "engine built with TensorRT 10.3.0 for NVIDIA H100 80GB HBM3 (compute capability 9.0)"
REBUILD = "rebuild the artifact on this machine's GPU and TensorRT"

# ------------------------------------------------------------------------------------ compatibility


@pytest.mark.parametrize("present,have", [
    ({**H100, "tensorrt_version": "10.5.0"}, "TensorRT 10.5.0 and NVIDIA H100 80GB HBM3 (9.0)"),
    ({**H100, "gpu": "NVIDIA A10G", "compute_capability": "8.6"}, "TensorRT 10.3.0 and NVIDIA A10G (8.6)"),
    ({**H100, "compute_capability": "9.1"}, "TensorRT 10.3.0 and NVIDIA H100 80GB HBM3 (9.1)"),
    ({"tensorrt_version": "10.5.0", "gpu": "NVIDIA A10G", "compute_capability": "8.6"},
     "TensorRT 10.5.0 and NVIDIA A10G (8.6)"),
])
def test_an_engine_for_another_tensorrt_or_gpu_is_refused_naming_both_sides(present: dict, have: str) -> None:
    assert engine_compatibility(H100, present) == f"{BUILT}; this machine has {have}: {REBUILD}"


def test_a_machine_without_tensorrt_or_gpu_is_told_where_the_engine_runs() -> None:
    fix = ("serve it on a machine with TensorRT 10.3.0 and NVIDIA H100 80GB HBM3, or rebuild the artifact on the "
           "machine that serves it (pip install '.[gpu]')")
    none = {"tensorrt_version": None, "gpu": None, "compute_capability": None}
    assert engine_compatibility(H100, none) == f"{BUILT}; this machine has no TensorRT and no NVIDIA GPU: {fix}"
    no_trt = {**H100, "tensorrt_version": None}
    assert engine_compatibility(H100, no_trt) == \
        f"{BUILT}; this machine has no TensorRT and NVIDIA H100 80GB HBM3 (9.0): {fix}"
    no_gpu = {**none, "tensorrt_version": "10.3.0"}
    assert engine_compatibility(H100, no_gpu) == f"{BUILT}; this machine has TensorRT 10.3.0 and no NVIDIA GPU: {fix}"


def test_the_same_tensorrt_and_gpu_is_compatible() -> None:
    assert engine_compatibility(H100, dict(H100)) is None
    # an incomplete record is never taken for a match
    assert engine_compatibility({**H100, "gpu": None}, {**H100, "gpu": None}) is not None


def _artifact_folder(tmp_path: Path, manifest_extra: dict) -> Artifact:
    """A small real artifact folder holding a dummy engine: the refusal must come before deserialising it."""
    root = tmp_path / "artifact"
    root.mkdir()
    (root / "model.plan").write_bytes(b"not an engine")
    config = {"backend": "tensorrt", "device": "cuda", "model_file": "model.plan",
              "kv_cache": {"block_size": 16, "num_blocks": 64, "dtype": "float16"},
              "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "vocab_size": 4096},
              "graph": {"inputs": [], "outputs": []}}
    (root / "runtime.json").write_text(json.dumps(config), encoding="utf-8")
    write_manifest(root, {"name": "m", "version": "1.0.0", **manifest_extra})
    return Artifact.open(root)


def test_the_backend_refuses_an_engine_built_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    art = _artifact_folder(tmp_path, {"engine": H100})
    a10g = {"tensorrt_version": "10.5.0", "gpu": "NVIDIA A10G", "compute_capability": "8.6"}
    monkeypatch.setattr(trt_backend, "present_machine", lambda: a10g)
    with pytest.raises(RuntimeError) as e:
        TensorRTBackend(art.model_path, art.runtime_config, art.manifest)
    assert str(e.value) == f"{BUILT}; this machine has TensorRT 10.5.0 and NVIDIA A10G (8.6): {REBUILD}"


def test_the_record_is_also_read_from_the_build_engine_pass_stats(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    art = _artifact_folder(tmp_path, {"passes": [{"name": "build_engine", "status": "applied", "stats": H100}]})
    assert engine_record(art.manifest) == H100
    monkeypatch.setattr(trt_backend, "present_machine", lambda: {**H100, "tensorrt_version": "10.5.0"})
    with pytest.raises(RuntimeError, match="this machine has TensorRT 10.5.0 and NVIDIA H100"):
        TensorRTBackend(art.model_path, art.runtime_config, art.manifest)


def test_an_artifact_without_an_engine_record_is_refused(tmp_path: Path) -> None:
    art = _artifact_folder(tmp_path, {})
    with pytest.raises(RuntimeError, match="holds no TensorRT engine record"):
        TensorRTBackend(art.model_path, art.runtime_config, art.manifest)


@pytest.mark.skipif(missing_for("tensorrt") is None, reason="this machine has TensorRT and a GPU")
def test_on_this_machine_the_refusal_says_there_is_no_tensorrt(tmp_path: Path) -> None:
    art = _artifact_folder(tmp_path, {"engine": H100})
    with pytest.raises(RuntimeError, match=r"; this machine has no TensorRT and (no NVIDIA GPU|.*\(\d+\.\d+\)): "):
        TensorRTBackend(art.model_path, art.runtime_config, art.manifest)


def test_missing_for_tensorrt_names_each_package_and_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    env = GpuEnvironment("no NVIDIA driver (libcuda) on this machine", (),
                         {"tensorrt": None, "pycuda": None, "cuda-python": None})
    assert missing_for("tensorrt", env) == (
        "target tensorrt/cuda cannot run on this machine; missing: tensorrt (the TensorRT Python package); "
        "pycuda (device buffers and streams for the TensorRT runtime); cuda-python (NVRTC compiles the KV-cache "
        "scatter kernel at load; no nvcc needed); an NVIDIA GPU: no NVIDIA driver (libcuda) on this machine. "
        "Install with pip install '.[gpu]' (CUDA builds of the GPU packages) on a machine with an NVIDIA GPU and "
        "driver")
    gpu = GpuEnvironment(None, (Device(0, "NVIDIA A10G", "8.6", 24 << 30),),
                         {"tensorrt": "10.5.0", "pycuda": "2024.1", "cuda-python": None})
    assert missing_for("tensorrt", gpu) == (
        "target tensorrt/cuda cannot run on this machine; missing: cuda-python (NVRTC compiles the KV-cache scatter "
        "kernel at load; no nvcc needed). Install with pip install '.[gpu]' (CUDA builds of the GPU packages) on a "
        "machine with an NVIDIA GPU and driver")
    assert missing_for("tensorrt", GpuEnvironment(None, gpu.devices, {**gpu.packages, "cuda-python": "12.6.0"})) is None


# ------------------------------------------------------------------------------------ recipes

PASSES = ("  - name: select_attention\n  - name: capture\n  - name: lower_onnx\n  - name: plan_cuda_graphs\n"
          "  - name: build_engine\n  - name: package\n")


def _trt_recipe(tmp_path: Path, passes: str = PASSES, dtype: str = "float16", ckpt: Path = DEMO_MODEL,
                name: str = "trt-model", runtime: str | None = None) -> Path:
    path = write_recipe(tmp_path, ckpt, name=name, passes=passes, backend="tensorrt", runtime=runtime)
    text = path.read_text().replace("device: cpu", "device: cuda").replace("dtype: float32", f"dtype: {dtype}")
    path.write_text(text)
    return path


def _line_of(path: Path, text: str, occurrence: int = 0) -> int:
    lines = [i + 1 for i, ln in enumerate(path.read_text().splitlines()) if text in ln]
    return lines[occurrence]


def test_plan_accepts_the_demo_tensorrt_recipe() -> None:
    p = plan(ROOT / "recipes" / "demo-tensorrt.yaml")
    assert (p.recipe.target.backend, p.recipe.target.device, p.recipe.target.dtype) == ("tensorrt", "cuda", "float16")
    assert [ps.name for ps in p.passes] == ["select_attention", "capture", "lower_onnx", "plan_cuda_graphs",
                                            "build_engine", "package"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_plan_accepts_a_tensorrt_recipe(tmp_path: Path, dtype: str) -> None:
    assert plan(_trt_recipe(tmp_path, dtype=dtype)).recipe.target.dtype == dtype


@pytest.mark.parametrize("passes,words", [
    (PASSES.replace("  - name: plan_cuda_graphs\n", "  - name: fuse\n"),
     ["passes[3] 'fuse' rewrites the graph into ONNX Runtime contrib ops", "remove it for the tensorrt target"]),
    ("  - name: capture\n  - name: quantize_rtn\n    options:\n      symmetric: true\n  - name: lower_onnx\n"
     "  - name: lower_quant\n  - name: build_engine\n  - name: package\n",
     ["lower_quant's int4_format 'matmulnbits' emits com.microsoft.MatMulNBits", "int4_format: qdq"]),
    ("  - name: capture\n  - name: quantize_rtn\n  - name: lower_onnx\n  - name: lower_quant\n"
     "    options:\n      int4_format: qdq\n  - name: build_engine\n  - name: package\n",
     ["TensorRT dequantizes INT4 only symmetric (signed int4, zero point 0)",
      "passes[1] 'quantize_rtn' stores asymmetric uint4 with zero points", "set passes[1].options.symmetric: true"]),
    ("  - name: capture\n  - name: quantize_awq\n  - name: lower_onnx\n  - name: lower_quant\n"
     "    options:\n      int4_format: qdq\n  - name: build_engine\n  - name: package\n",
     ["AWQ has no symmetric mode here: use quantize_rtn or quantize_gptq with symmetric: true"]),
    ("  - name: capture\n  - name: quantize_kv_cache\n  - name: lower_onnx\n  - name: lower_quant\n"
     "  - name: build_engine\n  - name: package\n",
     ["passes[1] 'quantize_kv_cache' stores the KV pools as int8 / E4M3 bytes"]),
    ("  - name: select_attention\n    options:\n      kernel: gqa\n  - name: capture\n  - name: lower_onnx\n"
     "  - name: build_engine\n  - name: package\n", ["forces kernel 'gqa'"]),
    ("  - name: capture\n  - name: lower_onnx\n  - name: build_engine\n  - name: plan_cuda_graphs\n"
     "  - name: package\n", ["build_engine must come after passes[3] 'plan_cuda_graphs'"]),
])
def test_tensorrt_recipes_that_cannot_build_are_refused_at_the_build_engine_line(
        tmp_path: Path, passes: str, words: list[str]) -> None:
    recipe = _trt_recipe(tmp_path, passes=passes)
    if "quantize_" in passes:
        data = DEMO_MODEL / "calib.txt"
        recipe.write_text(recipe.read_text().replace("output:", f"calibration:\n  data: {data}\n  num_samples: 2\n"
                                                                "output:"))
    with pytest.raises(RecipeError) as e:
        plan(recipe)
    index = [ln.strip() for ln in passes.splitlines() if ln.strip().startswith("- name:")].index("- name: build_engine")
    assert e.value.field == f"passes[{index}].name", str(e.value)
    assert e.value.line == _line_of(recipe, "- name: build_engine")
    assert str(e.value).startswith(f"{recipe}:{e.value.line}: passes[{index}].name: ")
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("method", ["quantize_rtn", "quantize_gptq"])
def test_symmetric_int4_in_the_qdq_form_is_accepted(tmp_path: Path, method: str) -> None:
    passes = (f"  - name: capture\n  - name: {method}\n    options:\n      symmetric: true\n  - name: lower_onnx\n"
              "  - name: lower_quant\n    options:\n      int4_format: qdq\n  - name: build_engine\n"
              "  - name: package\n")
    recipe = _trt_recipe(tmp_path, passes=passes)
    recipe.write_text(recipe.read_text().replace("output:", f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n"
                                                            "output:"))
    assert [p.name for p in plan(recipe).passes][1] == method


def test_a_tensorrt_recipe_without_build_engine_is_refused_at_package(tmp_path: Path) -> None:
    recipe = _trt_recipe(tmp_path, passes="  - name: capture\n  - name: lower_onnx\n  - name: package\n")
    with pytest.raises(RecipeError, match="needs 'build_engine' before 'package'") as e:
        plan(recipe)
    assert e.value.field == "passes[2].name" and e.value.line == _line_of(recipe, "- name: package")


def test_build_engine_is_refused_for_other_targets(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, DEMO_MODEL, passes="  - name: capture\n  - name: lower_onnx\n"
                                                       "  - name: build_engine\n  - name: package\n")
    with pytest.raises(RecipeError, match="build_engine compiles TensorRT engines; the target is onnxruntime/cpu") as e:
        plan(recipe)
    assert e.value.field == "passes[2].name"


def test_a_missing_timing_cache_file_is_refused_at_its_line(tmp_path: Path) -> None:
    passes = PASSES.replace("  - name: build_engine\n", "  - name: build_engine\n    options:\n"
                                                         "      timing_cache: caches/none.cache\n")
    recipe = _trt_recipe(tmp_path, passes=passes)
    with pytest.raises(RecipeError, match="timing cache file not found: .*caches/none.cache") as e:
        plan(recipe)
    assert e.value.field == "passes[4].options.timing_cache"
    assert e.value.line == _line_of(recipe, "timing_cache:")
    (tmp_path / "caches").mkdir()
    (tmp_path / "caches" / "none.cache").write_bytes(b"cache")
    assert plan(recipe).passes[4].config.timing_cache == "caches/none.cache"


@pytest.mark.skipif(missing_for("tensorrt") is None, reason="this machine has TensorRT and a GPU")
def test_build_fails_before_any_work_naming_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from compiler.passes.capture import CapturePass

    def no_capture(self: object, ctx: object) -> None:
        raise AssertionError("capture ran")

    monkeypatch.setattr(CapturePass, "run", no_capture)
    recipe = _trt_recipe(tmp_path)
    with pytest.raises(BuildError) as e:
        build(recipe, progress=False)
    assert str(e.value) == f"pass 'build_engine': {missing_for('tensorrt')}"
    absent = [name for name in ("pycuda", "cuda-python") if probe((name,)).packages.get(name) is None]
    for words in ("tensorrt (the TensorRT Python package)", *absent, "pip install '.[gpu]'"):
        assert words in str(e.value)
    assert not (tmp_path / "artifacts").exists()


# ------------------------------------------------------------------------------------ graph checks


def _toy_graph() -> object:
    """int64 Clip + bool Equal (what our exporter emits), then float math: TensorRT-legal after legalize."""
    from onnx import TensorProto, helper
    from onnx_model import make_model

    nodes = [
        helper.make_node("Clip", ["idx", "zero"], ["clamped"], name="clamp"),
        helper.make_node("Less", ["idx", "zero"], ["neg"]),
        helper.make_node("Less", ["clamped", "one"], ["small"]),
        helper.make_node("Equal", ["neg", "small"], ["same"], name="eq"),
        helper.make_node("Gather", ["table", "clamped"], ["rows"]),
        helper.make_node("Cast", ["same"], ["same_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["rows", "same_f"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [5]),
         helper.make_tensor_value_info("table", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [5])],
        [helper.make_tensor("zero", TensorProto.INT64, [], [0]), helper.make_tensor("one", TensorProto.INT64, [], [1])])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_legalize_rewrites_what_tensorrt_cannot_read_exactly() -> None:
    import onnx
    import onnxruntime as ort

    from compiler.trt import legalize, unsupported_nodes

    model = _toy_graph()
    assert [(p["node"], p["op"]) for p in unsupported_nodes(model)] == [("clamp", "Clip"), ("eq", "Equal")]
    assert "Clip on int64" in unsupported_nodes(model)[0]["reason"]
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert legalize(model) == {"Clip(int) -> Max/Min": 1, "Equal(bool) -> Not(Xor)": 1}
    assert unsupported_nodes(model) == []
    onnx.checker.check_model(model, full_check=True)
    feeds = {"idx": np.array([-2, -1, 0, 1, 3], np.int64), "table": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}
    want = ort.InferenceSession(before.SerializeToString()).run(None, feeds)[0]
    got = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    assert np.array_equal(want, got)


def test_contrib_ops_and_asymmetric_int4_are_reported() -> None:
    from onnx import TensorProto, helper
    from onnx_model import make_model

    from compiler.trt import has_qdq, unsupported_nodes

    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["wf"], name="dq", axis=0, block_size=4),
             helper.make_node("MatMulNBits", ["x", "wf"], ["y"], name="mmnb", domain="com.microsoft")]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor("w", TensorProto.UINT4, [4, 4], [1] * 16),
                               helper.make_tensor("s", TensorProto.FLOAT, [1, 4], [1.0] * 4),
                               helper.make_tensor("zp", TensorProto.UINT4, [1, 4], [8] * 4)])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    found = {p["node"]: p["reason"] for p in unsupported_nodes(model)}
    assert found["dq"].startswith("DequantizeLinear on uint4 (TensorRT takes")
    assert found["mmnb"].startswith("com.microsoft.MatMulNBits is not a standard ONNX op")
    assert has_qdq(model)


def test_profiles_cover_the_serving_limits_and_one_per_bucket() -> None:
    from compiler.export import graph_io_names
    from compiler.trt import EngineLimits, engine_profiles

    inputs, _ = graph_io_names(2)
    limits = EngineLimits(max_num_tokens=512, max_num_seqs=16, max_blocks_per_seq=64, num_blocks=512,
                          block_size=16, kv_heads=2, head_dim=32)
    profiles = engine_profiles(inputs, limits, [1, 2, 4, 8, 16])
    assert [p.name for p in profiles] == ["mixed", "decode", "decode_b1", "decode_b2", "decode_b4", "decode_b8",
                                          "decode_b16"]
    mixed, decode, b4 = profiles[0].shapes, profiles[1].shapes, profiles[4].shapes
    assert mixed["input_ids"] == ([1], [512], [512]) and mixed["logits_index"] == ([1], [16], [512])
    assert mixed["block_table"] == ([1, 1], [16, 64], [16, 64]) and mixed["cu_seqlens"] == ([2], [17], [17])
    assert decode["input_ids"] == ([1], [16], [16]) and decode["logits_index"][2] == [16]
    assert b4["input_ids"] == ([4], [4], [4]) and b4["block_table"] == ([4, 64], [4, 64], [4, 64])
    assert all(p.shapes["value_cache.1"] == ([1, 16, 2, 32], [512, 16, 2, 32], [512, 16, 2, 32]) for p in profiles)
    assert profiles[4].record()["bucket"] == 4 and "bucket" not in profiles[0].record()
    with pytest.raises(ValueError, match="outside 1..max_num_seqs"):
        engine_profiles(inputs, limits, [32])


def test_attention_candidates_for_tensorrt() -> None:
    from compiler.attention import candidates
    from compiler.checkpoint import inspect_checkpoint

    cands = {c.variant: c for c in candidates(inspect_checkpoint(DEMO_MODEL).config, "tensorrt", "cuda", "float16")}
    assert cands["decomposed"].valid and "TensorRT's ONNX parser reads" in cands["decomposed"].reason
    for variant, op in (("gqa", "GroupQueryAttention"), ("paged_attention", "PagedAttention")):
        assert not cands[variant].valid
        assert cands[variant].reason.startswith(f"com.microsoft.{op} is an ONNX Runtime contrib op; TensorRT's")
    for variant in ("triton", "flashinfer"):
        assert not cands[variant].valid and "torch targets only" in cands[variant].reason


def test_staging_layout_aligns_every_array() -> None:
    lay = StagingLayout.of(7, 3, 5, 2)
    assert all(off % 256 == 0 for off in lay.offsets.values())
    host = np.zeros(lay.total, np.uint8)
    v = lay.views(host)
    assert v["block_table"].shape == (3, 5) and v["cu_seqlens"].dtype == np.int32 and v["slot_mapping"].shape == (7,)
    v["slot_mapping"][:] = -1
    v["input_ids"][:] = 5
    assert (v["slot_mapping"] == -1).all() and (v["input_ids"] == 5).all()


# ------------------------------------------------------------------------------------ end to end (fake GPU)

RUNTIME = ("  kv_block_size: 16\n  num_kv_blocks: 64\n  max_num_seqs: 8\n  max_num_batched_tokens: 128\n"
           "  max_model_len: 256\n")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(checkpoint, onnxruntime/cpu artifact, tensorrt artifact built through the fake GPU packages)."""
    root = tmp_path_factory.mktemp("trt")
    ckpt = make_random_checkpoint(root / "ckpt", "LlamaForCausalLM", seed=3)
    cpu = build(write_recipe(root, ckpt, name="cpu-model", runtime=RUNTIME), progress=False)
    mp = pytest.MonkeyPatch()
    try:
        import fake_gpu

        fake_gpu.install(mp)
        (root / "seed.cache").write_bytes(b"seed")
        passes = PASSES.replace("  - name: build_engine\n", "  - name: build_engine\n    options:\n"
                                                             "      timing_cache: seed.cache\n")
        recipe = _trt_recipe(root, passes=passes, dtype="float32", ckpt=ckpt, runtime=RUNTIME)
        trt_art = build(recipe, progress=True)
    finally:
        mp.undo()
    return ckpt, cpu, trt_art


def test_the_fake_gpu_build_writes_the_engine_and_its_record(pair: tuple[Path, Path, Path]) -> None:
    import fake_gpu

    _, _, art = pair
    files = {f["path"] for f in json.loads((art / "manifest.json").read_text())["files"]}
    assert {"model.plan", "timing.cache", "runtime.json"} <= files and "model.onnx" not in files
    assert json.loads((art / "runtime.json").read_text())["model_file"] == "model.plan"
    assert (art / "timing.cache").read_bytes() == b"seed+timings"  # seeded from the recipe's cache, then saved
    manifest = json.loads((art / "manifest.json").read_text())
    record = engine_record(manifest)
    assert record is not None
    assert (record["tensorrt_version"], record["gpu"], record["compute_capability"]) == \
        (fake_gpu.TRT_VERSION, fake_gpu.GPU_NAME, fake_gpu.COMPUTE_CAPABILITY)
    assert [p["name"] for p in record["profiles"]] == ["mixed", "decode", "decode_b1", "decode_b2", "decode_b4",
                                                       "decode_b8"]
    assert record["limits"] == {"max_num_tokens": 128, "max_num_seqs": 8, "max_blocks_per_seq": 16, "num_blocks": 64}
    assert record["legalized"] == {"Clip(int) -> Max/Min": 1, "Equal(bool) -> Not(Xor)": 1}
    assert record["strongly_typed"] and record["precision_flags"] == []
    built = fake_gpu.FakeEngineState.last_build
    assert built["strongly_typed"] and "TF32" not in built["flags"] and built["timing_cache_in"] == b"seed"
    assert built["pool_limits"] == {"WORKSPACE": 4 << 30} and built["optimization_level"] == 3
    assert manifest["cuda_graphs"]["applies"] is True
    entry = next(e for e in manifest["passes"] if e["name"] == "build_engine")
    assert pass_changes(entry).startswith(f"TensorRT {fake_gpu.TRT_VERSION} engine for {fake_gpu.GPU_NAME} (9.0): ")
    assert pass_changes(entry).endswith("profiles mixed, decode, decode_b1, decode_b2, decode_b4, decode_b8")


def _step(ids: list[list[int]], past: list[int], tables: np.ndarray, bs: int, logits: str = "last") -> ForwardBatch:
    lens = [len(x) for x in ids]
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(past, lens, strict=True)]).astype(np.int64)
    seq = np.repeat(np.arange(len(ids)), lens)
    slots = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
    cu = np.cumsum([0] + lens).astype(np.int32)
    index = np.arange(len(pos), dtype=np.int64) if logits == "all" else (cu[1:] - 1).astype(np.int64)
    return ForwardBatch(input_ids=np.array([t for x in ids for t in x], np.int64), positions=pos, cu_seqlens=cu,
                        past_lens=np.array(past, np.int32), block_table=tables, slot_mapping=slots,
                        logits_index=index)


def test_the_backend_matches_onnx_runtime_step_by_step(pair: tuple[Path, Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed prefill, decode through the CUDA graphs (padded to buckets), decode without a graph, copy-on-write:
    logits and every KV pool equal the ONNX Runtime backend's on the same steps."""
    import fake_gpu

    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    _, cpu, art = pair
    fake_gpu.install(monkeypatch)
    ref_art, trt_art = Artifact.open(cpu), Artifact.open(art)
    ref = OnnxRuntimeBackend(ref_art.model_path, ref_art.runtime_config)
    be = TensorRTBackend(trt_art.model_path, trt_art.runtime_config, trt_art.manifest)
    assert be.buckets == [1, 2, 4, 8] and be.graph_mode == "cuda" and be.kv_cache_bytes == ref.kv_cache_bytes
    bs = be.block_size
    rng = np.random.default_rng(0)
    tables = np.full((3, 16), -1, np.int32)
    tables[0, :3], tables[1, :2], tables[2, :4] = [0, 1, 2], [3, 4], [5, 6, 7, 8]
    prompts = [list(rng.integers(3, 4096, n)) for n in (20, 9, 33)]
    graph_runs = {b: be._buckets[b][0] for b in be.buckets}  # the fake CUDA graphs count their launches

    def same(fb: ForwardBatch) -> np.ndarray:
        want, got = ref.forward(fb), be.forward(fb)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        for layer in range(be.num_layers):  # padded rows and unused table columns wrote nothing
            np.testing.assert_allclose(be.pool_contents(layer, "key"), ref.k_pools[layer], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(be.pool_contents(layer, "value"), ref.v_pools[layer], rtol=1e-5, atol=1e-6)
        return want

    same(_step(prompts, [0, 0, 0], tables, bs, logits="all"))  # mixed profile, logits of every token
    past = [20, 9, 33]
    for _ in range(3):  # 3 sequences: the bucket-4 graph, one padded row
        logits = same(_step([[int(x)] for x in rng.integers(3, 4096, 3)], past, tables, bs))
        assert logits.shape == (3, be.vocab_size)
        past = [p + 1 for p in past]
    assert graph_runs[4].launches == 3 and graph_runs[1].launches == 0
    same(_step([[7]], [past[1]], tables[1:2], bs))  # one sequence: the bucket-1 graph
    assert graph_runs[1].launches == 1 and be.graph_replays == 4
    # a chunk continuing after a cached past (mixed profile with a block table of past blocks)
    same(_step([list(rng.integers(3, 4096, 5)), [11]], [past[0], past[2]], tables[[0, 2]], bs))
    # copy-on-write of a block, then decode reading it
    be.copy_blocks([(0, 9)])
    ref.copy_blocks([(0, 9)])
    np.testing.assert_array_equal(be.pool_contents(0, "key")[9], be.pool_contents(0, "key")[0])
    np.testing.assert_allclose(be.pool_contents(1, "value"), ref.v_pools[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="outside the pool"):
        be.copy_blocks([(0, 64)])
    with pytest.raises(ValueError, match="exceeds the engine's profiles"):
        be.forward(_step([list(range(3, 3 + 129))], [0], np.arange(16, dtype=np.int32)[None, :9], bs))


@pytest.mark.parametrize("mode", ["padded", "off"])
def test_decode_without_graphs_matches_too(pair: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
                                           mode: str) -> None:
    """graphs='padded': bucket contexts run eagerly; 'off' (or OPTIMIZE_CUDA_GRAPHS=0): the decode profile."""
    import fake_gpu

    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    _, cpu, art = pair
    fake_gpu.install(monkeypatch)
    if mode == "off":
        monkeypatch.setenv("OPTIMIZE_CUDA_GRAPHS", "0")
    ref_art, trt_art = Artifact.open(cpu), Artifact.open(art)
    ref = OnnxRuntimeBackend(ref_art.model_path, ref_art.runtime_config)
    be = TensorRTBackend(trt_art.model_path, trt_art.runtime_config, trt_art.manifest,
                         graphs=None if mode == "off" else mode)
    assert be.graph_mode == mode and be.graph_replays == 0
    tables = np.array([[0, 1, -1], [2, 3, 4]], np.int32)
    steps = [_step([[5, 6, 7], [8] * 20], [0, 0], tables, be.block_size),
             _step([[9], [10]], [3, 20], tables, be.block_size), _step([[11], [12]], [4, 21], tables, be.block_size)]
    for fb in steps:
        np.testing.assert_allclose(be.forward(fb), ref.forward(fb), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="graphs must be one of auto, padded, off"):
        TensorRTBackend(trt_art.model_path, trt_art.runtime_config, trt_art.manifest, graphs="on")


def test_generation_matches_the_cpu_artifact(pair: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens through the engine core (continuous batching, prefix cache with copy-on-write); the
    backend comes from the production dispatch (runtime.backends.load_backend reads the artifact's
    runtime.json), which also refuses to run the engine on the CPU."""
    import fake_gpu

    from runtime.engine import LLM
    from runtime.sampling import SamplingParams

    _, cpu, art = pair
    fake_gpu.install(monkeypatch)
    with pytest.raises(RuntimeError, match="runs on the GPU it was built for, not on 'cpu'"):
        LLM(art, device="cpu")
    copies: list[list[tuple[int, int]]] = []
    copy_blocks = TensorRTBackend.copy_blocks
    monkeypatch.setattr(TensorRTBackend, "copy_blocks", lambda self, pairs: (copies.append(list(pairs)),
                                                                           copy_blocks(self, pairs))[1])
    rng = np.random.default_rng(1)
    full = [int(x) for x in rng.integers(3, 4096, 32)]  # two full blocks: a repeat is wholly cached
    prompts = [full, [int(x) for x in rng.integers(3, 4096, 21)], [int(x) for x in rng.integers(3, 4096, 7)]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = []
    for path in (cpu, art):
        llm = LLM(path)
        first = [o.token_ids for o in llm.generate([full], params)]
        results.append((first, [o.token_ids for o in llm.generate(prompts, params)]))
    assert type(llm.engine.backend) is TensorRTBackend and llm.engine.backend.graph_mode == "cuda"
    assert results[1] == results[0]
    assert llm.engine.scheduler.prefix_cache_stats().hits >= 31 and copies, copies  # the repeat: cached + copied
    assert llm.engine.backend.graph_replays > 0
