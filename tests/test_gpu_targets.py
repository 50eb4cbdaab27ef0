"""The GPU targets on a machine without a GPU: what builds here, what the artifacts hold, the padded
decode-bucket path the CUDA graphs replay (run here without capture, against transformers), and the
early messages when a GPU artifact is loaded where it cannot run. The GPU runs are in tests/gpu/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEMO_MODEL, make_random_checkpoint, needs_ort, write_recipe
from test_parity import hf_greedy, hf_model, prompts_of, staggered_greedy

from compiler.attention import KERNELS
from compiler.build import build, plan
from compiler.passes.plan_cuda_graphs import fx_host_sync_findings
from compiler.recipe import RecipeError
from runtime.engine import LLM, LLMEngine
from runtime.gpu import GpuEnvironment, missing_for, probe
from runtime.kernels.paged_attention import triton_available
from runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TORCH_CUDA_PASSES = "  - name: capture\n  - name: plan_cuda_graphs\n  - name: package\n"
NO_GPU = missing_for("torch") is not None
HAS_TRITON = triton_available()


@pytest.fixture(scope="module")
def torch_cuda_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random Llama built for torch/cuda float32 (on this CPU machine), with its checkpoint; its
    attention is the rule table's choice for torch/cuda, the Triton kernel (the reference on CPU)."""
    folder = tmp_path_factory.mktemp("torch-cuda")
    ckpt = make_random_checkpoint(folder / "ckpt", "LlamaForCausalLM", seed=5)
    quality = f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_eval_tokens: 512\n  max_kl_divergence: 1.0e-6\n"
    recipe = write_recipe(folder, ckpt, passes="  - name: select_attention\n" + TORCH_CUDA_PASSES, backend="torch",
                          device="cuda", extra=quality)
    return build(recipe, progress=False), ckpt


def test_torch_cuda_artifact_builds_on_cpu_with_a_capturable_plan(torch_cuda_artifact: tuple[Path, Path]) -> None:
    artifact, _ = torch_cuda_artifact
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"] == {"backend": "torch", "device": "cuda", "dtype": "float32", "matmul": "float32",
                                  "kv_cache_dtype": "float32"}
    plan_ = manifest["cuda_graphs"]
    assert plan_["applies"] and plan_["capturable"] and plan_["host_sync_findings"] == []
    assert plan_["decode_buckets"] == [1, 2, 4, 8] and plan_["block_table_width"] == 32
    stats = next(p["stats"] for p in manifest["passes"] if p["name"] == "plan_cuda_graphs")
    assert stats["verified_buckets"] == [1, 2, 4, 8]  # each bucket ran twice on CPU with fixed shapes
    assert json.loads((artifact / "runtime.json").read_text())["device"] == "cuda"
    assert manifest["kernels"]["attention"] == {**KERNELS["triton"], "variant": "triton", "selected_by": "rule"}
    select = next(p["stats"] for p in manifest["passes"] if p["name"] == "select_attention")
    assert select["autotune"] is False and select["rule"].startswith("torch/cuda: first valid of flashinfer, triton")
    program = torch.export.load(str(artifact / "model.pt2"))
    calls = [n for n in program.graph.nodes if "paged_attention_triton" in str(n.target)]
    assert len(calls) == 2  # one per layer
    # the quality gate ran the same program (on CPU when this machine has no GPU) against the reference
    quality = manifest["quality"]
    assert quality["evaluated"] and quality["passed"] and quality["device"] == ("cpu" if NO_GPU else "cuda")
    assert quality["metrics"]["token_agreement"] == 1.0 and quality["metrics"]["kl_divergence"] < 1e-6


@pytest.mark.skipif(not NO_GPU, reason="this machine can run torch on CUDA (tests/gpu covers it)")
def test_torch_cuda_artifact_refuses_to_load_without_a_gpu(torch_cuda_artifact: tuple[Path, Path]) -> None:
    artifact, _ = torch_cuda_artifact
    with pytest.raises(RuntimeError) as e:
        LLM(artifact)
    msg = str(e.value)
    assert msg.startswith("target torch/cuda cannot run on this machine; missing: ")
    assert "pip install '.[gpu]'" in msg and "device='cpu'" in msg


def test_padded_decode_buckets_match_transformers_and_the_eager_path(torch_cuda_artifact: tuple[Path, Path]) -> None:
    """The static-shape step CUDA graphs replay (batch padded to the bucket, block table to the plan's
    width, padding rows writing to the spare block), run on CPU: same greedy tokens as transformers."""
    artifact, ckpt = torch_cuda_artifact
    prompts = prompts_of([5, 17, 33, 9, 12], seed=3)
    padded = LLMEngine(artifact, device="cpu", graphs="padded")
    assert padded.backend.graph_mode == "padded" and padded.backend.buckets == [1, 2, 4, 8]
    got = staggered_greedy(padded, prompts, [0, 0, 2, 5, 6], 12)
    assert padded.backend.bucket_steps > 10  # decode steps of 1..5 sequences ran in buckets 1..8
    eager = LLMEngine(artifact, device="cpu", graphs="off")
    assert staggered_greedy(eager, prompts, [0, 0, 2, 5, 6], 12) == got
    assert eager.backend.bucket_steps == 0
    model = hf_model(ckpt)
    assert got == [hf_greedy(model, p, 12) for p in prompts]


def _interpreted(*args: str) -> str:
    """tests/triton_interpreted.py in a process where Triton runs its kernels in the interpreter (CPU)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_interpreted.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install '.[dev]' installs it)")
def test_triton_kernel_matches_the_reference_in_the_interpreter() -> None:
    """Hypothesis cases (MHA/GQA/MQA, non-power-of-two groups and head dims, block sizes 1/4/16, empty
    and decode-only sequences, prefill chunks with past, windows, float32/float16, blocks out of order):
    the Triton kernel in Triton's interpreter against runtime.kernels.paged_attention_reference; then
    three cases at each of the models' head dims 64, 128 and 256."""
    out = json.loads(_interpreted("kernel").strip().splitlines()[-1])
    assert out == {"kernel": "ok", "real_dims": [64, 128, 256]}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install '.[dev]' installs it)")
def test_int4_matmul_kernel_matches_the_reference_in_the_interpreter() -> None:
    """Hypothesis cases through optimize::int4_linear (0/1/3/16/17/70 rows, any N and K including odd K and a
    last group cut short, groups 16-128, bias or not, float32/float16): the Triton INT4 kernel in Triton's
    interpreter against runtime.kernels.int4_matmul_reference; every case went through the kernel."""
    out = json.loads(_interpreted("int4").strip().splitlines()[-1])
    assert out["int4"] == "ok" and out["kernel_calls"] >= 40


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install '.[dev]' installs it)")
def test_triton_variant_artifact_runs_the_kernel_and_matches_transformers(
        torch_cuda_artifact: tuple[Path, Path]) -> None:
    """The torch/cuda artifact's program on CPU with its attention op running the Triton kernel (in the
    interpreter), padded to the decode buckets as on the GPU: greedy tokens equal transformers'."""
    artifact, ckpt = torch_cuda_artifact
    out = json.loads(_interpreted("engine", str(artifact)).strip().splitlines()[-1])
    assert out["kernel_calls"] > 2 * 10 and out["bucket_steps"] > 10
    model = hf_model(ckpt)
    assert out["tokens"] == [hf_greedy(model, p, 12) for p in prompts_of([5, 17, 33, 9, 12], seed=3)]


def test_torch_cuda_float16_program_runs_padded_on_cpu(tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "Qwen2ForCausalLM", seed=8)
    recipe = write_recipe(tmp_path, ckpt, passes=TORCH_CUDA_PASSES, backend="torch", device="cuda", dtype="float16")
    artifact = build(recipe, progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {mode: [o.token_ids for o in LLM(artifact, device="cpu", graphs=mode).generate(
        ["def f(x):", "import os", "class A:"], params)] for mode in ("off", "padded")}
    assert outs["off"] == outs["padded"] and all(len(t) == 8 for t in outs["off"])
    llm = LLM(artifact, device="cpu")
    assert llm.engine.backend._k[0].dtype == torch.float16


def test_fx_host_sync_findings_flag_data_dependent_programs() -> None:
    class Sync(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0].sum() + torch.nonzero(x).shape[0]

    class Static(torch.nn.Module):
        def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x[i], -1)

    found = fx_host_sync_findings(torch.export.export(Sync(), (torch.randn(8),)))
    assert found and all(f["reason"] for f in found)
    assert any("nonzero" in f["op"] for f in found)
    assert fx_host_sync_findings(torch.export.export(Static(), (torch.randn(8, 4), torch.tensor([1, 3])))) == []


@needs_ort("paged_attention")
def test_onnxruntime_cuda_demo_builds_here_with_paged_attention(tmp_path: Path) -> None:
    artifact = build(ROOT / "recipes" / "demo-onnxruntime-cuda.yaml", progress=False, output=tmp_path)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["kernels"]["attention"]["variant"] == "paged_attention"
    select = next(p["stats"] for p in manifest["passes"] if p["name"] == "select_attention")
    reasons = {c["variant"]: c["reason"] for c in select["candidates"]}
    assert "in-place cache write" in reasons["decomposed"] and "in-place cache write" in reasons["gqa"]
    fuse = next(p["stats"] for p in manifest["passes"] if p["name"] == "fuse")
    assert fuse["checks"]["paged_attention_schema"] == "6 nodes valid"
    assert fuse["fusions"]["qkv"] == 6 and fuse["fusions"]["gate_up"] == 6
    assert fuse["fusions"]["rotary"] == 12 and fuse["nodes_after"] == 146  # float16 caches (tests/test_fusion.py)
    assert manifest["cuda_graphs"]["capturable"] and manifest["cuda_graphs"]["applies"]
    if missing_for("onnxruntime") is not None:
        # the recipe says quality.allow_unevaluated: the gate is recorded as not run, with what is missing
        quality = manifest["quality"]
        assert quality == {"evaluated": False, "eval_data": "../models/pycode-llama-6m/eval.txt",
                           "bounds": {"max_perplexity": 16.0, "max_perplexity_increase_pct": 0.5},
                           "reason": missing_for("onnxruntime"), "allowed_by": "quality.allow_unevaluated"}
        assert quality["reason"].startswith("target onnxruntime/cuda cannot run on this machine; missing: ")
        with pytest.raises(RuntimeError, match="onnxruntime-gpu"):
            LLM(artifact)
        # inspect, verify and serve say so in one line
        line = re.compile(r"quality: not evaluated \(target onnxruntime/cuda cannot run on this machine; "
                          r"missing: onnxruntime-gpu [^\n]*\); bounds not checked: max_perplexity=16, "
                          r"max_perplexity_increase_pct=0\.5, allowed by quality\.allow_unevaluated\n")
        cli = [sys.executable, "-m", "compiler.cli"]
        shown = subprocess.run([*cli, "inspect", str(artifact)], capture_output=True, text=True, check=True).stdout
        assert len(line.findall(shown)) == 1, shown
        verified = subprocess.run([*cli, "verify", str(artifact)], capture_output=True, text=True, check=True).stdout
        assert verified.splitlines()[0].startswith("ok: pycode-llama-6m-ort-cuda 1.0.0")
        assert len(line.findall(verified)) == 1 and verified.splitlines()[1].startswith("quality: not evaluated")
        served = subprocess.run([*cli, "serve", str(artifact), "--port", "0"], capture_output=True, text=True,
                                timeout=300)
        assert served.returncode == 1  # it cannot load here (no onnxruntime-gpu); the line comes at start
        assert re.search(r"^WARNING runtime\.server: quality: not evaluated \(", served.stderr, re.M), served.stderr
        assert len(line.findall(served.stderr)) == 1, served.stderr


@pytest.mark.skipif(missing_for("onnxruntime") is None, reason="this machine runs onnxruntime/cuda: the gate runs")
def test_a_bounded_gate_that_cannot_run_here_fails_the_build(tmp_path: Path) -> None:
    """An onnxruntime/cuda recipe with quality bounds on a machine without ONNX Runtime's CUDA provider:
    the build fails before any pass, naming the recipe's quality field and what is missing, and leaves
    nothing; with quality.allow_unevaluated: true the same recipe builds (above, on the demo recipe)."""
    from compiler.build import BuildError

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=9)
    passes = "  - name: select_attention\n  - name: capture\n  - name: lower_onnx\n  - name: package\n"
    quality = f"quality:\n  eval_data: {DEMO_MODEL / 'eval.txt'}\n  max_perplexity_increase_pct: 1.0\n"
    recipe = write_recipe(tmp_path, ckpt, passes=passes, device="cuda", dtype="float16", extra=quality)
    with pytest.raises(BuildError) as e:
        build(recipe, progress=False)
    text = str(e.value)
    assert text.startswith(f"{recipe}:") and ": quality: the quality gate cannot run on this machine, so its " \
        "bounds (max_perplexity_increase_pct 1) cannot be checked: target onnxruntime/cuda cannot run on this " \
        "machine; missing: onnxruntime-gpu" in text, text
    assert "set quality.allow_unevaluated: true" in text
    assert not (tmp_path / "artifacts").exists()  # nothing built, nothing left
    # the CLI: exit 1 and the same message
    proc = subprocess.run([sys.executable, "-m", "compiler.cli", "build", str(recipe), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "quality gate cannot run on this machine" in proc.stderr, proc.stderr
    assert "no artifact was written" in proc.stderr


@pytest.mark.parametrize("backend,device,dtype,words", [
    ("torch", "cpu", "bfloat16", "dtype bfloat16 is not supported for torch/cpu; use float32"),
    ("onnxruntime", "cuda", "float32", "dtype float32 is not supported for onnxruntime/cuda; use float16 or bfloat16"),
])
def test_target_dtypes_are_checked(tmp_path: Path, backend: str, device: str, dtype: str, words: str) -> None:
    passes = TORCH_CUDA_PASSES if backend == "torch" else None
    recipe = write_recipe(tmp_path, DEMO_MODEL, passes=passes, backend=backend, device=device, dtype=dtype)
    with pytest.raises(RecipeError, match=words) as e:
        plan(recipe)
    assert e.value.field == "target.dtype"


def test_missing_for_names_what_each_gpu_target_lacks() -> None:
    bare = GpuEnvironment("no NVIDIA driver (libcuda) on this machine", (), {
        "torch.cuda": None, "onnxruntime.cuda": None, "tensorrt": None, "pycuda": None})
    assert missing_for("torch", bare) == (
        "target torch/cuda cannot run on this machine; missing: a CUDA build of torch (this torch has no CUDA); "
        "an NVIDIA GPU: no NVIDIA driver (libcuda) on this machine. Install with pip install '.[gpu]' "
        "(CUDA builds of the GPU packages) on a machine with an NVIDIA GPU and driver")
    trt = missing_for("tensorrt", bare)
    assert trt is not None and "tensorrt (the TensorRT Python package)" in trt and "pycuda" in trt
    from runtime.gpu import Device

    ready = GpuEnvironment(None, (Device(0, "NVIDIA H200", "9.0", 1 << 37),), {
        "torch.cuda": "13.0", "onnxruntime.cuda": None, "tensorrt": None, "pycuda": None})
    assert missing_for("torch", ready) is None
    assert missing_for("onnxruntime", ready) == (
        "target onnxruntime/cuda cannot run on this machine; missing: onnxruntime-gpu (this onnxruntime has no "
        "CUDAExecutionProvider). Install with pip install '.[gpu]' (CUDA builds of the GPU packages) on a machine "
        "with an NVIDIA GPU and driver")
    here = probe()  # the real machine: consistent with what torch says
    assert here.has_gpu == (here.driver is None)


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def ort_cuda_int4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama for onnxruntime/cuda in float16 / bfloat16, INT4 (RTN, group 32), fused but for the
    rotary rule (the rotary test below applies it to this graph)."""
    tmp = tmp_path_factory.mktemp(f"ort-cuda-int4-{request.param}")
    ckpt = make_random_checkpoint(tmp / "ckpt", "LlamaForCausalLM", seed=9)
    passes = ("  - name: select_attention\n  - name: capture\n  - name: quantize_rtn\n    options:\n"
              "      group_size: 32\n      ignore: [lm_head]\n  - name: lower_onnx\n  - name: lower_quant\n"
              "  - name: fuse\n    options:\n      disable: [rotary]\n  - name: package\n")
    return build(write_recipe(tmp, ckpt, passes=passes, device="cuda", dtype=request.param), progress=False)


@needs_ort("paged_attention")
def test_onnxruntime_cuda_int4_lowers_to_half_precision_matmulnbits(ort_cuda_int4: Path) -> None:
    """float16 and bfloat16 graphs: MatMulNBits with scales of the graph's type, PagedAttention over pools of
    it, and every contrib node valid against ONNX Runtime's registered schema (inputs, attributes, types)."""
    import onnx

    from compiler.attention.schema import validate_node

    artifact = ort_cuda_int4
    manifest = json.loads((artifact / "manifest.json").read_text())
    dtype = manifest["target"]["dtype"]
    elem = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[dtype]
    assert json.loads((artifact / "runtime.json").read_text())["kv_cache"]["dtype"] == dtype
    model = onnx.shape_inference.infer_shapes(onnx.load(str(artifact / "model.onnx")))
    types = {t.name: t.data_type for t in model.graph.initializer}
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    # q/k/v and gate/up fused along N by the fuse pass: 4 per layer (qkv, o, gate_up, down)
    assert len(nbits) == 8 and all(types[n.input[2]] == elem for n in nbits)
    assert sum(n.op_type == "PagedAttention" for n in model.graph.node) == 2
    pools = [i for i in model.graph.input if i.name.endswith("_cache.0") or i.name.endswith("_cache.1")]
    assert len(pools) == 4 and all(i.type.tensor_type.elem_type == elem for i in pools)
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # logits
    known = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    contrib = [n for n in model.graph.node if n.domain == "com.microsoft"]
    assert {n.op_type for n in contrib} >= {"MatMulNBits", "PagedAttention", "SkipSimplifiedLayerNormalization"}
    assert [p for n in contrib for p in validate_node(n, {**known, **types})] == []


@needs_ort("paged_attention")
def test_half_precision_rotary_fuses_with_caches_of_its_type_and_rotates_as_the_unfused_nodes(
        ort_cuda_int4: Path) -> None:
    """A float16/bfloat16 graph (onnxruntime/cuda) casts cos/sin to its type before the product: the rule
    follows the Cast, and the caches hold the float32 values cast the same way (RotaryEmbedding takes
    caches of its input's type). On ONNX Runtime CPU the fused float16 rotation equals the unfused
    nodes' result, for q and k of every layer, at positions across the whole cache (ONNX Runtime CPU
    has no bfloat16 Mul for the unfused side: bfloat16 is checked up to the caches)."""
    import copy

    import ml_dtypes
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from onnx.utils import Extractor

    from compiler.fusion import fuse_model

    dtype = json.loads((ort_cuda_int4 / "manifest.json").read_text())["target"]["dtype"]
    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    unfused = onnx.shape_inference.infer_shapes(onnx.load(str(ort_cuda_int4 / "model.onnx")))
    fused, stats = fuse_model(copy.deepcopy(unfused), ["rotary"], rope_cache_rows=512)  # edits in place
    assert stats["fusions"]["rotary"] == 4 and "not_fused" not in stats, stats  # q, k x 2 layers
    inits = {t.name: t for t in fused.graph.initializer}
    rot = [n for n in fused.graph.node if n.op_type == "RotaryEmbedding"]
    # the unfused graph's own float32 cos/sin, evaluated by ONNX Runtime at every cache row, then cast as
    # the graph casts them (round to nearest even)
    trig = {n.op_type: n.output[0] for n in unfused.graph.node if n.op_type in ("Cos", "Sin")}
    sub = Extractor(unfused).extract_model(["positions"], [trig["Cos"], trig["Sin"]])
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    graph_cos, graph_sin = sess.run(None, {"positions": np.arange(512, dtype=np.int64)})
    step = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]
    for node in rot:
        for name, ref in ((node.input[2], graph_cos), (node.input[3], graph_sin)):
            cache = numpy_helper.to_array(inits[name])
            assert cache.dtype == np_dtype and cache.shape == (512, 8) == ref.shape[:1] + (ref.shape[-1] // 2,)
            want = ref[:, :8].astype(np_dtype).astype(np.float32)
            # equal up to one step of the type (ONNX Runtime's and torch's float32 cos may differ in the last bit)
            assert np.abs(cache.astype(np.float32) - want).max() <= step, name
    if dtype == "bfloat16":
        return
    producers = {o: n for n in fused.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in fused.graph.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    fused = onnx.shape_inference.infer_shapes(fused)
    rng = np.random.default_rng(0)
    positions = rng.permutation(512)[:61].astype(np.int64)
    for node in rot:
        x = producers[node.input[0]].input[0]
        out = consumers[node.output[0]][0].output[0]  # the Add the rule replaced keeps its name
        heads = next(a.i for a in node.attribute if a.name == "num_heads")
        xs = rng.standard_normal((len(positions), heads, 16)).astype(np.float16)
        results = []
        for model in (unfused, fused):
            sub = Extractor(model).extract_model([x, "positions"], [out])
            sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
            results.append(sess.run(None, {x: xs, "positions": positions})[0])
        assert results[1].dtype == np.float16
        np.testing.assert_allclose(results[1].astype(np.float32), results[0].astype(np.float32), rtol=0, atol=2e-3)
