"""Run in a process started with TRITON_INTERPRET=1 (tests/test_gpu_targets.py does): Triton builds
its kernels for the interpreter, which runs them on CPU tensors.

    python tests/triton_interpreted.py kernel            # hypothesis: the Triton kernel vs the reference
                                                         # (head dims 8/12/32, then 64/128/256)
    python tests/triton_interpreted.py int4              # hypothesis: the INT4 matmul kernel vs its reference
    python tests/triton_interpreted.py engine ARTIFACT   # greedy tokens of the artifact with the kernel

`kernel` exits non-zero with the falsifying example when the kernel and the reference differ, and
prints {"kernel": "ok", "real_dims": [...]};
`engine` prints {"tokens": [...], "kernel_calls": N, "bucket_steps": N} for the prompts of
test_gpu_targets.py. tests/gpu/test_torch_cuda.py runs the same cases on a GPU (compiled kernel).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from runtime.kernels import int4_matmul as i4  # noqa: E402
from runtime.kernels import paged_attention as pa  # noqa: E402

SMALL_DIMS = (8, 12, 32)  # cheap in the interpreter; 12 is not a power of two (masked lanes)
REAL_DIMS = (64, 128, 256)  # the models' head dims: larger BLOCK_D, smaller BLOCK_N


@st.composite
def cases(draw: st.DrawFn, dims: tuple[int, ...] = SMALL_DIMS) -> dict:
    kvh = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    d = draw(st.sampled_from(dims))
    bs = draw(st.sampled_from([1, 4, 16]))
    seqs = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=4))  # (past, new)
    if all(n == 0 for _, n in seqs):
        seqs[0] = (seqs[0][0], 1)
    window = draw(st.sampled_from([0, 1, 5, 17]))
    dtype = draw(st.sampled_from(["float32", "float16"]))
    return {"kvh": kvh, "group": group, "d": d, "bs": bs, "seqs": seqs, "window": window, "dtype": dtype,
            "seed": draw(st.integers(0, 2**31 - 1))}


def run_case(c: dict, device: str = "cpu") -> float:
    """Largest |kernel - reference| (float32 reference) on one random case (inputs made on CPU, the
    kernel run on `device`: cpu in the interpreter, cuda compiled; tests/gpu uses the latter)."""
    g = torch.Generator().manual_seed(c["seed"])
    kvh, h, d, bs = c["kvh"], c["kvh"] * c["group"], c["d"], c["bs"]
    dtype = getattr(torch, c["dtype"])
    need = [-(-p // bs) for p, _ in c["seqs"]]
    width = max(1, max(need) + 1)
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)  # blocks out of order
    table = torch.full((len(c["seqs"]), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    news = [n for _, n in c["seqs"]]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(news)]), dtype=torch.int32)
    past = torch.tensor([p for p, _ in c["seqs"]], dtype=torch.int32)
    t = int(cu[-1])
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    q, k, v = rand(t, h * d), rand(t, kvh * d), rand(t, kvh * d)
    kc, vc = rand(num_blocks, bs, kvh, d), rand(num_blocks, bs, kvh, d)
    args = (cu, past, table, h, kvh, c["window"], d ** -0.5)
    want = pa.paged_attention_reference(q.float(), k.float(), v.float(), kc.float(), vc.float(), *args)
    on = [x.to(device) for x in (q, k, v, kc, vc, cu, past, table)]
    got = pa.paged_attention_triton(*on[:5], *on[5:], *args[3:]).cpu()
    assert got.dtype == dtype and got.shape == (t, h * d)
    return float((got.float() - want).abs().max()) if t else 0.0


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases())
def check_kernel(c: dict) -> None:
    err = run_case(c)
    tol = 1e-5 if c["dtype"] == "float32" else 4e-3
    assert err <= tol, f"kernel differs from the reference by {err} on {c}"


def check_kernel_real_dims(examples: int = 3) -> list[int]:
    """`examples` cases at each of the real head dims; returns the dims that ran."""
    ran: list[int] = []
    for d in REAL_DIMS:
        @settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(cases(dims=(d,)))
        def check(c: dict) -> None:
            check_kernel.hypothesis.inner_test(c)
            ran.append(c["d"])

        check()
    return sorted(set(ran))


@st.composite
def int4_cases(draw: st.DrawFn, dtypes: tuple[str, ...] = ("float32", "float16")) -> dict:
    """Shapes and dtypes for the INT4 matmul. bfloat16 only on a GPU: Triton's interpreter computes
    tl.dot of bfloat16 operands wrongly (products off by ~1e10 on a plain 16 x 16 dot), which the
    paged-attention kernel, free of tl.dot, does not meet."""
    return {"m": draw(st.sampled_from([0, 1, 3, 16, 17, 70])), "n": draw(st.integers(1, 150)),
            "k": draw(st.integers(1, 200)), "group": draw(st.sampled_from([16, 32, 64, 128])),
            "bias": draw(st.booleans()), "dtype": draw(st.sampled_from(list(dtypes))),
            "seed": draw(st.integers(0, 2**31 - 1))}


def run_int4_case(c: dict, device: str = "cpu") -> float:
    """Largest |kernel - reference| / (1 + max |reference|) (float32 reference) on one random case, through
    the op the program calls (optimize::int4_linear: the kernel on CUDA, or under TRITON_INTERPRET=1)."""
    from compiler.quant.int4 import pack_nibbles
    from runtime.backends import torch_ops

    g = torch.Generator().manual_seed(c["seed"])
    m, n, k, gs = c["m"], c["n"], c["k"], c["group"]
    groups = -(-k // gs)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    packed = torch.from_numpy(pack_nibbles(codes.numpy()))
    scales = torch.rand(n, groups, generator=g) * 0.2 + 0.01
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    dtype = getattr(torch, c["dtype"])
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if c["bias"] else None
    want = i4.int4_matmul_reference(x.float(), packed, scales, zeros, gs) + (0 if bias is None else bias.float())
    on = [t.to(device) if t is not None else None for t in (x, packed, scales, zeros, bias)]
    got = torch_ops.int4_linear(on[0], on[1], on[2], on[3], gs, on[4]).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    return float((got.float() - want).abs().max() / (1 + want.abs().max())) if m else 0.0


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(int4_cases())
def check_int4(c: dict) -> None:
    err = run_int4_case(c)
    tol = 1e-6 if c["dtype"] == "float32" else 2e-3
    assert err <= tol, f"INT4 kernel differs from the reference by {err} (relative) on {c}"


def count_calls(name: str) -> dict[str, int]:
    """Wrap the Triton launcher `name` that runtime/backends/torch_ops.py calls (its CPU branch does under
    TRITON_INTERPRET=1) so that every launch is counted; returns the counter."""
    from runtime.backends import torch_ops

    calls = {"n": 0}
    kernel = getattr(torch_ops, name)

    def counted(*a: object) -> torch.Tensor:
        calls["n"] += 1
        return kernel(*a)

    setattr(torch_ops, name, counted)
    return calls


def run_engine(artifact: str) -> dict:
    from test_parity import prompts_of, staggered_greedy

    from runtime.engine import LLMEngine

    calls = count_calls("paged_attention_triton")
    engine = LLMEngine(artifact, device="cpu", graphs="padded")
    tokens = staggered_greedy(engine, prompts_of([5, 17, 33, 9, 12], seed=3), [0, 0, 2, 5, 6], 12)
    return {"tokens": tokens, "kernel_calls": calls["n"], "bucket_steps": engine.backend.bucket_steps}


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    if sys.argv[1] == "kernel":
        check_kernel()
        print(json.dumps({"kernel": "ok", "real_dims": check_kernel_real_dims()}))
    elif sys.argv[1] == "int4":
        calls = count_calls("int4_matmul_triton")
        check_int4()
        print(json.dumps({"int4": "ok", "kernel_calls": calls["n"]}))
    else:
        print(json.dumps(run_engine(sys.argv[2])))
