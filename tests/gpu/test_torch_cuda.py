"""torch/cuda on a GPU: the artifact moved to the device, one CUDA graph per decode bucket captured at
load and replayed, greedy tokens equal to transformers (float32) and to the eager path, with the
Triton paged-attention kernel and with the decomposed attention; the Triton kernels (paged attention,
INT4 matmul) compiled for the GPU against their PyTorch references; FP8 and INT4 programs against CPU; the
FlashInfer attention variant (where flashinfer is installed) against the reference and CPU. Skips with the
reason where this machine cannot run the target (runtime/gpu.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import make_random_checkpoint, write_recipe
from test_parity import hf_greedy, hf_model, prompts_of, staggered_greedy

from compiler.build import build
from runtime.engine import LLMEngine
from runtime.gpu import missing_for

MISSING = missing_for("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
PASSES = "  - name: capture\n  - name: plan_cuda_graphs\n  - name: package\n"


@pytest.fixture(scope="module", params=["triton", "decomposed"])
def artifact(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp(f"torch-cuda-gpu-{request.param}")
    ckpt = make_random_checkpoint(folder / "ckpt", "LlamaForCausalLM", seed=5)
    passes = f"  - name: select_attention\n    options:\n      kernel: {request.param}\n" + PASSES
    return build(write_recipe(folder, ckpt, passes=passes, backend="torch", device="cuda"), progress=False), ckpt


def test_triton_kernel_on_the_gpu_matches_the_reference() -> None:
    """The hypothesis cases of tests/triton_interpreted.py, the kernel compiled for this GPU, at the small
    head dims and at the models' (64, 128, 256), each of which must run."""
    from hypothesis import given, settings
    from triton_interpreted import REAL_DIMS, SMALL_DIMS, cases, run_case

    ran: set[int] = set()

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(cases(dims=SMALL_DIMS))
    def check(c: dict) -> None:
        err = run_case(c, device="cuda")
        assert err <= (1e-4 if c["dtype"] == "float32" else 4e-3), (err, c)
        ran.add(c["d"])

    check()
    for d in REAL_DIMS:
        settings(max_examples=15, deadline=None, derandomize=True)(given(cases(dims=(d,)))(check.hypothesis.inner_test))()
    assert ran == set(SMALL_DIMS) | set(REAL_DIMS), ran


def test_int4_kernel_on_the_gpu_matches_the_reference() -> None:
    """The INT4 hypothesis cases of tests/triton_interpreted.py through optimize::int4_linear on CUDA tensors
    (the kernel compiled for this GPU)."""
    from hypothesis import given, settings
    from triton_interpreted import int4_cases, run_int4_case

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(int4_cases(dtypes=("float32", "float16", "bfloat16")))
    def check(c: dict) -> None:
        err = run_int4_case(c, device="cuda")
        assert err <= {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[c["dtype"]], (err, c)

    check()


def test_cuda_graphs_replay_and_match_transformers(artifact: tuple[Path, Path]) -> None:
    path, ckpt = artifact
    prompts = prompts_of([5, 17, 33, 9, 12], seed=3)
    graphs = LLMEngine(path)
    assert graphs.backend.graph_mode == "cuda" and str(graphs.backend.device) == "cuda"
    got = staggered_greedy(graphs, prompts, [0, 0, 2, 5, 6], 16)
    assert graphs.backend.graph_replays > 10
    eager = LLMEngine(path, graphs="off")
    assert staggered_greedy(eager, prompts, [0, 0, 2, 5, 6], 16) == got
    model = hf_model(ckpt)
    assert got == [hf_greedy(model, p, 16) for p in prompts]


def test_fp8_linears_run_on_the_gpu_and_agree_with_cpu(tmp_path: Path) -> None:
    """FP8 weights + static activations: torch._scaled_mm on GPUs with FP8 tensor cores (else the
    dequantized product), against the same program on CPU."""
    import numpy as np
    import torch
    from conftest import DEMO_MODEL
    from test_torch_fp8 import _batch

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=6)
    extra = f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n  num_samples: 4\n  seq_len: 128\n"
    passes = ("  - name: capture\n  - name: quantize_fp8\n  - name: lower_quant_torch\n"
              "  - name: plan_cuda_graphs\n  - name: package\n")
    path = build(write_recipe(tmp_path, ckpt, passes=passes, backend="torch", device="cuda", extra=extra),
                 progress=False)
    fb = _batch()
    gpu = LLMEngine(path).backend.forward(fb)
    cpu = LLMEngine(path, device="cpu").backend.forward(fb)
    tol = 5e-2 if torch.cuda.get_device_capability() >= (8, 9) else 1e-3  # _scaled_mm returns bfloat16
    np.testing.assert_allclose(gpu, cpu, rtol=tol, atol=tol)
    assert (gpu.argmax(-1) == cpu.argmax(-1)).mean() > 0.9


def test_int4_linears_run_on_the_gpu_and_agree_with_cpu(tmp_path: Path) -> None:
    """INT4 (GPTQ, group 32) in a float16 program with CUDA graphs: the Triton kernel on the GPU against
    the same program on CPU (dequantized product), and greedy tokens with graphs equal to without."""
    import numpy as np
    from conftest import DEMO_MODEL
    from test_torch_fp8 import _batch

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=7)
    extra = f"calibration:\n  data: {DEMO_MODEL / 'calib.txt'}\n  num_samples: 4\n  seq_len: 128\n"
    passes = ("  - name: select_attention\n  - name: capture\n  - name: quantize_gptq\n    options:\n"
              "      group_size: 32\n      ignore: [lm_head]\n  - name: lower_quant_torch\n"
              "  - name: plan_cuda_graphs\n  - name: package\n")
    path = build(write_recipe(tmp_path, ckpt, passes=passes, backend="torch", device="cuda", dtype="float16",
                              extra=extra), progress=False)
    fb = _batch()
    gpu = LLMEngine(path).backend.forward(fb)
    cpu = LLMEngine(path, device="cpu").backend.forward(fb)
    np.testing.assert_allclose(gpu, cpu, rtol=2e-2, atol=2e-2)
    assert (gpu.argmax(-1) == cpu.argmax(-1)).mean() > 0.9
    prompts = prompts_of([5, 17, 33], seed=4)
    graphs = LLMEngine(path)
    got = staggered_greedy(graphs, prompts, [0, 1, 3], 12)
    assert graphs.backend.graph_replays > 5
    assert staggered_greedy(LLMEngine(path, graphs="off"), prompts, [0, 1, 3], 12) == got


_NO_FLASHINFER = "flashinfer is not installed (pip install '.[flashinfer]')"


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason=_NO_FLASHINFER)
def test_flashinfer_plans_equal_the_reference_on_the_gpu() -> None:
    """The hypothesis steps of tests/test_flashinfer_variant.py (mixed, prefill, decode, decode buckets with
    padding rows) through FlashInfer's kernels on this GPU, float16/bfloat16, against the reference."""
    import torch
    from hypothesis import given, settings
    from test_flashinfer_variant import TOL, run_step, steps

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(steps().filter(lambda c: c["dtype"] != torch.float32))
    def check(c: dict) -> None:
        err, _ = run_step(c, flashinfer=None, device="cuda")
        assert err <= TOL[c["dtype"]], (err, c)

    check()


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason=_NO_FLASHINFER)
def test_flashinfer_artifact_with_cuda_graphs_agrees_with_cpu(tmp_path: Path) -> None:
    """A float16 model with head_dim 64 built with the flashinfer variant: logits of a prefill step against the
    same program on CPU (the reference op), and greedy tokens with CUDA graphs equal to without."""
    import numpy as np
    from test_torch_fp8 import _batch

    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", seed=11, head_dim=64)
    passes = "  - name: select_attention\n    options:\n      kernel: flashinfer\n" + PASSES
    path = build(write_recipe(tmp_path, ckpt, passes=passes, backend="torch", device="cuda", dtype="float16"),
                 progress=False)
    fb = _batch()
    gpu = LLMEngine(path).backend.forward(fb)
    cpu = LLMEngine(path, device="cpu").backend.forward(fb)
    np.testing.assert_allclose(gpu, cpu, rtol=2e-2, atol=2e-2)
    prompts = prompts_of([5, 17, 33, 9], seed=4)
    graphs = LLMEngine(path)
    got = staggered_greedy(graphs, prompts, [0, 1, 3, 4], 16)
    assert graphs.backend.graph_replays > 10
    assert staggered_greedy(LLMEngine(path, graphs="off"), prompts, [0, 1, 3, 4], 16) == got
