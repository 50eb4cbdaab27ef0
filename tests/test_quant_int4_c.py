"""The INT4 C loops (compiler/quant/_int4.c) against their twins, bit for bit: quantize_rtn against
int4.quantize_rtn_reference (torch), pack_matmulnbits against int4.pack_matmulnbits_reference (numpy).

Hypothesis draws weights of every float32 kind the loop may meet (wide and tiny magnitudes, subnormals, values
near the float32 limit, all-positive and all-negative groups, constant groups, signed zeros, exact ties of
x / scale at .5), shapes whose columns are or are not a multiple of the group size, and both the asymmetric
and the symmetric form; codes, scales and zero points must be identical. Packing: every code and zero point
value, columns that do or do not fill the last block, odd and even block counts. Non-finite weights make the
C loop decline (the reference computes them), and bad buffers raise errors that name the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from compiler.quant import _int4, int4
from compiler.quant.int4 import (
    Int4Weight,
    num_groups,
    pack_matmulnbits,
    pack_matmulnbits_reference,
    quantize_rtn,
    quantize_rtn_reference,
)

FIELDS = ("codes", "scales", "zeros")


def c_rtn(w: np.ndarray, group_size: int, symmetric: bool) -> tuple[bool, np.ndarray, np.ndarray, np.ndarray]:
    n, k = w.shape
    g = num_groups(k, group_size)
    codes, scales, zeros = np.empty((n, k), np.uint8), np.empty((n, g), np.float32), np.empty((n, g), np.uint8)
    ok = _int4.rtn_int4(w, group_size, symmetric, codes, scales, zeros)
    return ok, codes, scales, zeros


def assert_same(w: np.ndarray, group_size: int, symmetric: bool) -> None:
    ok, codes, scales, zeros = c_rtn(w, group_size, symmetric)
    assert ok
    ref = quantize_rtn_reference(torch.from_numpy(w), group_size, symmetric=symmetric)
    for name, got in zip(FIELDS, (codes, scales, zeros), strict=True):
        want = getattr(ref, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        # bit patterns: scales compared as integers, so -0.0 / 0.0 and every last ulp count
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (name, np.argwhere(got != want)[:5])


@st.composite
def weight_case(draw: st.DrawFn) -> tuple[np.ndarray, int, bool]:
    n = draw(st.integers(1, 6))
    group_size = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 64, 128]))
    k = draw(st.integers(1, 3 * group_size + 40))
    symmetric = draw(st.booleans())
    kind = draw(st.sampled_from(["normal", "positive", "negative", "tiny", "constant", "ties", "any"]))
    if kind == "any":  # every finite float32 hypothesis can think of: subnormals, +-0, near the limit
        w = draw(hnp.arrays(np.float32, (n, k), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
        return np.ascontiguousarray(w), group_size, symmetric
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-30, 1e-7, 3e-6, 1e-5, 1e-3, 0.02, 1.0, 1e4, 1e30]))
    w = rng.standard_normal((n, k)) * scale
    if kind == "positive":
        w = np.abs(w) + scale
    elif kind == "negative":
        w = -np.abs(w) - scale
    elif kind == "tiny":  # ranges around the 1e-5 floor of the scale
        w = rng.uniform(-1, 1, (n, k)) * draw(st.sampled_from([1e-6, 4.9e-6, 5e-6, 1e-5, 1.1e-5]))
    elif kind == "constant":
        w = np.full((n, k), draw(st.sampled_from([0.0, -0.0, 1.0, -3.5, 1e-6])))
    elif kind == "ties":  # integers and half-integers times one step: x / scale lands on .5 exactly
        w = rng.integers(-30, 31, (n, k)) * 0.5 * draw(st.sampled_from([1.0, 0.25, 2.0 / 15]))
    return np.ascontiguousarray(w.astype(np.float32)), group_size, symmetric


@settings(max_examples=400, deadline=None)
@given(weight_case())
def test_c_loop_equals_reference(case: tuple[np.ndarray, int, bool]) -> None:
    assert_same(*case)


@pytest.mark.parametrize("shape,group_size", [((64, 2048), 128), ((48, 704), 128), ((5, 4096), 32), ((3, 4096), 4096)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_c_loop_equals_reference_at_model_shapes(shape: tuple[int, int], group_size: int, symmetric: bool) -> None:
    w = (np.random.default_rng(0).standard_normal(shape) * 0.02).astype(np.float32)
    w[0, :7] = 0.0  # a group starting with zeros and one holding both signs of zero
    w[1, 3] = -0.0
    assert_same(w, group_size, symmetric)


def test_quantize_rtn_runs_the_c_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finite float32 weight never reaches the reference (the twin test above compares two implementations)."""
    w = torch.randn(16, 256) * 0.02
    want = quantize_rtn_reference(w, 64)

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("the reference ran")

    monkeypatch.setattr(int4, "quantize_rtn_reference", refuse)
    got = quantize_rtn(w, 64)
    for name in FIELDS:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_take_the_reference(bad: float) -> None:
    w = (np.random.default_rng(1).standard_normal((4, 256)) * 0.02).astype(np.float32)
    w[2, 130] = bad
    ok, *_ = c_rtn(w, 128, False)
    assert ok is False
    got = quantize_rtn(torch.from_numpy(w), 128)
    want = quantize_rtn_reference(torch.from_numpy(w), 128)
    assert not np.isfinite(want.scales[2, 1])  # the reference's semantics for the group, kept
    for name in FIELDS:  # bit patterns (NaN scales compare equal)
        assert np.array_equal(getattr(got, name).view(np.uint8), getattr(want, name).view(np.uint8)), name


def test_bad_buffers_name_the_argument() -> None:
    w = np.zeros((4, 8), np.float32)
    codes, scales, zeros = np.empty((4, 8), np.uint8), np.empty((4, 2), np.float32), np.empty((4, 2), np.uint8)
    with pytest.raises(TypeError, match="w: expected element type 'f'"):
        _int4.rtn_int4(w.astype(np.float64), 4, False, codes, scales, zeros)
    with pytest.raises(TypeError, match="codes: expected a buffer"):
        _int4.rtn_int4(w, 4, False, [0] * 32, scales, zeros)
    with pytest.raises(ValueError, match="scales: expected \\[4, 2\\], got \\[4, 3\\]"):
        _int4.rtn_int4(w, 4, False, codes, np.empty((4, 3), np.float32), zeros)
    with pytest.raises(ValueError, match="w: expected a C-contiguous"):
        _int4.rtn_int4(np.zeros((8, 4), np.float32).T, 4, False, codes, scales, zeros)
    ro = zeros.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="zeros: expected a C-contiguous, writable"):
        _int4.rtn_int4(w, 4, False, codes, scales, ro)
    with pytest.raises(ValueError, match="w: expected 2 dimensions, got 1"):
        _int4.rtn_int4(w.reshape(-1), 4, False, codes, scales, zeros)
    with pytest.raises(ValueError, match="group_size: expected >= 1, got 0"):
        _int4.rtn_int4(w, 0, False, codes, scales, zeros)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5), k=st.integers(1, 300), block_size=st.sampled_from([2, 4, 16, 32, 64, 128]),
       seed=st.integers(0, 2**32 - 1))
def test_pack_equals_reference(n: int, k: int, block_size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = num_groups(k, block_size)
    q = Int4Weight(codes=rng.integers(0, 16, (n, k), dtype=np.uint8), scales=rng.random((n, g), dtype=np.float32),
                   zeros=rng.integers(0, 16, (n, g), dtype=np.uint8), group_size=block_size)
    got, want = pack_matmulnbits(q), pack_matmulnbits_reference(q)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_pack_runs_the_c_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    q = quantize_rtn(torch.randn(8, 200), 64)
    want = pack_matmulnbits_reference(q)

    def refuse(*_a: object) -> None:
        raise AssertionError("the reference ran")

    monkeypatch.setattr(int4, "pack_matmulnbits_reference", refuse)
    for a, b in zip(pack_matmulnbits(q), want, strict=True):
        assert np.array_equal(a, b)


def test_pack_bad_buffers_name_the_argument() -> None:
    codes, zeros = np.zeros((2, 10), np.uint8), np.zeros((2, 3), np.uint8)
    b, zp = np.empty((2, 6), np.uint8), np.empty((2, 2), np.uint8)
    _int4.pack_nbits(codes, zeros, 4, b, zp)
    with pytest.raises(ValueError, match="block_size: expected an even number >= 2, got 3"):
        _int4.pack_nbits(codes, zeros, 3, b, zp)
    with pytest.raises(ValueError, match="b: expected \\[2, 6\\], got \\[2, 5\\]"):
        _int4.pack_nbits(codes, zeros, 4, np.empty((2, 5), np.uint8), zp)
    with pytest.raises(ValueError, match="zero_points: expected \\[2, 2\\], got \\[2, 1\\]"):
        _int4.pack_nbits(codes, zeros, 4, b, np.empty((2, 1), np.uint8))
    with pytest.raises(TypeError, match="codes: expected element type 'B'"):
        _int4.pack_nbits(codes.astype(np.int32), zeros, 4, b, zp)
