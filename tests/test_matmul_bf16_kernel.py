"""optimize.MatMulBf16 (runtime/kernels/op_matmul_bf16.c) and its weight packing
(compiler/fusion/matmul_bf16.py) in a real ONNX Runtime session.

The op is checked against bf16(a) @ bf16(w) computed in float64, on hypothesis-drawn shapes (odd K and
N, N not a multiple of the 16-column panels, rank-3 inputs, empty inputs), inline and through the
thread pool, on each of its code paths this CPU runs: AVX-512 BF16's vdpbf16ps (avx512_bf16), and the
paths that widen the bf16 pairs to float32 in registers: avx512 (OPTIMIZE_BF16_DOT=0), avx2, baseline
(OPTIMIZE_CPU_ISA); a path the CPU lacks is skipped naming the missing features, and the report of the
library (`kernel_paths`) must name the path the session ran. scripts/memcheck.sh runs this file under
AddressSanitizer. The recipe option and the demo model built with it: tests/test_matmul_bf16.py.
"""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
import torch
from cpu_paths import PATHS, bf16_dot, host_flags, use_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx_model import make_model

from compiler.fusion.matmul_bf16 import bf16_bits, bf16_to_float32, pack_bf16, reference_matmul, unpack_bf16
from runtime.kernels import paged_attention_cpu as pk


def op_model(k: int, n: int, packed: np.ndarray, rank: int = 2) -> bytes:
    w = TensorProto(name="w", data_type=TensorProto.BFLOAT16, dims=list(packed.shape))
    w.raw_data = packed.tobytes()
    lead = ["B", "M"][:rank - 1]
    node = helper.make_node("MatMulBf16", ["a", "w"], ["y"], domain=pk.DOMAIN, n=n)
    f = helper.make_tensor_value_info
    graph = helper.make_graph([node], "bf16", [f("a", TensorProto.FLOAT, [*lead, k])],
                              [f("y", TensorProto.FLOAT, [*lead, n])], [w])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1)])
    return model.SerializeToString()


def run_op(a: np.ndarray, w: np.ndarray, threads: int = 1) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    pk.register(so)
    sess = ort.InferenceSession(op_model(w.shape[0], w.shape[1], pack_bf16(w), a.ndim), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {"a": a})[0]


def check(a: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:
    """Within float32 summation error of the exact product of the bf16-rounded operands."""
    ref = reference_matmul(a.reshape(-1, a.shape[-1]), w).reshape(*a.shape[:-1], w.shape[1])
    scale = (np.abs(bf16_to_float32(bf16_bits(a))).astype(np.float64).reshape(-1, a.shape[-1])
             @ np.abs(bf16_to_float32(bf16_bits(w))).astype(np.float64)).reshape(ref.shape)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= 2.0 ** -22 * (w.shape[0] + 4) * scale + 1e-30)


def test_rounding_to_bfloat16_is_torchs() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 10000),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.4e38, 1e-45],
                                 np.float32)]).astype(np.float32)  # ties round to even both ways
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16_bits(x), want)
    assert np.isnan(bf16_to_float32(bf16_bits(np.array([np.nan], np.float32))))[0]


def test_packing_round_trips_the_rounded_weights() -> None:
    w = np.random.default_rng(1).standard_normal((37, 50)).astype(np.float32)
    packed = pack_bf16(w)
    assert packed.shape == (4, 19, 16, 2) and packed.dtype == np.uint16
    np.testing.assert_array_equal(unpack_bf16(packed, 37, 50), bf16_to_float32(bf16_bits(w)))
    assert not packed[-1, :, 2:].any() and not packed[:, -1, :, 1].any()  # N and K padding is zero


BF16_PATHS = ("avx512_bf16", *PATHS)


@pytest.fixture(params=BF16_PATHS)
def bf16_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """MatMulBf16's code paths in turn (avx512_bf16: vdpbf16ps; avx512 without it: OPTIMIZE_BF16_DOT=0),
    skipped with the missing features where this CPU lacks one."""
    path = request.param
    if path == "avx512_bf16" and "avx512_bf16" not in host_flags():
        pytest.skip("the avx512_bf16 path: this CPU lacks avx512_bf16")
    use_path("avx512" if path == "avx512_bf16" else path, monkeypatch)
    monkeypatch.setenv("OPTIMIZE_BF16_DOT", "1" if path == "avx512_bf16" else "0")
    return path


@pytest.mark.usefixtures("bf16_path")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(0, 150), k=st.integers(1, 300), n=st.integers(1, 100), rank=st.sampled_from([2, 3]),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_the_bf16_product(m: int, k: int, n: int, rank: int, threads: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    if rank == 3:
        a = a.reshape(1, m, k)
    w = rng.standard_normal((k, n)).astype(np.float32)
    check(a, w, run_op(a, w, threads))


def test_model_sized_products_through_the_thread_pool(bf16_path: str) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((768, 2304)).astype(np.float32)
    for m in (1, 16, 203):
        a = rng.standard_normal((m, 768)).astype(np.float32)
        check(a, w, run_op(a, w, threads=2))
    assert pk.kernel_paths()["ops"]["MatMulBf16"] == bf16_path  # the path the sessions above ran


def test_the_default_path_uses_avx512_bf16_exactly_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPTIMIZE_CPU_ISA", raising=False)
    monkeypatch.delenv("OPTIMIZE_BF16_DOT", raising=False)
    rng = np.random.default_rng(3)
    a, w = rng.standard_normal((40, 515)).astype(np.float32), rng.standard_normal((515, 70)).astype(np.float32)
    check(a, w, run_op(a, w))
    want = "avx512_bf16" if bf16_dot() else pk.kernel_paths()["isa"]
    assert pk.kernel_paths()["ops"]["MatMulBf16"] == want


def test_a_weight_packed_for_another_shape_is_refused() -> None:
    so = ort.SessionOptions()
    pk.register(so)
    w = np.ones((10, 20), np.float32)
    sess = ort.InferenceSession(op_model(12, 20, pack_bf16(w)), so, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=re.escape("w must be packed as [ceil(N / 16) = 2, ceil(K / 2) = 6, 16, 2] "
                                                  "for K = 12, N = 20")):
        sess.run(None, {"a": np.ones((3, 12), np.float32)})
