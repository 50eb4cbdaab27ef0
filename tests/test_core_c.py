"""The C core (runtime.core._core) against its pure-Python twin (runtime.core.reference)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.core import _core, reference

IMPLS = [pytest.param(_core, id="c"), pytest.param(reference, id="python")]


@st.composite
def scatter_case(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dtype = draw(st.sampled_from([np.float32, np.float16, np.float64, np.int8, np.uint8]))
    nb, bs = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    h, d = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    slots = draw(st.lists(st.integers(0, nb * bs - 1), max_size=nb * bs, unique=True))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pool = (rng.normal(size=(nb, bs, h, d)) * 20).astype(dtype)
    new = (rng.normal(size=(len(slots), h, d)) * 20).astype(dtype)
    return pool, new, np.asarray(slots, dtype=np.int64).reshape(-1)


@settings(max_examples=150, deadline=None)
@given(scatter_case())
def test_scatter_matches_twin(case: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    pool, new, slots = case
    c_pool, py_pool = pool.copy(), pool.copy()
    _core.scatter_kv(c_pool, new, slots)
    reference.scatter_kv(py_pool, new, slots)
    assert c_pool.tobytes() == py_pool.tobytes()
    flat = c_pool.reshape(-1, *pool.shape[2:])
    assert flat[slots].tobytes() == new.tobytes()


@settings(max_examples=40, deadline=None)
@given(st.lists(scatter_case(), min_size=1, max_size=3), st.integers(0, 2**32 - 1))
def test_scatter_layers_matches_twin(cases: list, seed: int) -> None:
    # every layer shares the first case's geometry and slots; each has its own dtype
    pool0, new0, slots = cases[0]
    pools = [pool0.copy()] + [p.copy() for p, n, s in cases[1:] if p.shape == pool0.shape and len(s) == len(slots)]
    rng = np.random.default_rng(seed)
    news = [new0] + [rng.normal(size=new0.shape).astype(p.dtype) for p in pools[1:]]
    c_pools, py_pools = [p.copy() for p in pools], [p.copy() for p in pools]
    _core.scatter_kv_layers(c_pools, news, slots)
    reference.scatter_kv_layers(py_pools, news, slots)
    for a, b in zip(c_pools, py_pools, strict=True):
        assert a.tobytes() == b.tobytes()


def test_scatter_kv_known_values() -> None:
    pool = np.zeros((3, 2, 1, 2), np.float32)
    new = np.arange(6, dtype=np.float32).reshape(3, 1, 2)
    _core.scatter_kv(pool, new, np.array([5, 0, 2], np.int64))
    np.testing.assert_array_equal(pool.reshape(6, 2), [[2, 3], [0, 0], [4, 5], [0, 0], [0, 0], [0, 1]])


def test_scatter_accepts_other_buffers() -> None:
    pool = np.zeros((2, 2, 1, 1), np.float32)
    new = np.array([[[1.5]], [[2.5]]], np.float32)
    _core.scatter_kv(memoryview(pool), memoryview(new), memoryview(np.array([3, 1], np.int64)))
    np.testing.assert_array_equal(pool.reshape(-1), [0, 2.5, 0, 1.5])
    _core.scatter_kv(pool, new[:0], np.zeros(0, np.int64))  # T = 0 is a no-op


def _good() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros((4, 4, 2, 8), np.float32), np.ones((3, 2, 8), np.float32), np.array([0, 5, 15], np.int64)


def _bad_cases() -> list[tuple[str, tuple, type[Exception], str]]:
    pool, new, slots = _good()
    ro = pool.copy()
    ro.flags.writeable = False
    return [
        ("pool not a buffer", ([[0.0]], new, slots), TypeError, "pool"),
        ("new not a buffer", (pool, "abc", slots), TypeError, "new"),
        ("slots not a buffer", (pool, new, [0, 1, 2]), TypeError, "slot_mapping"),
        ("new dtype", (pool, new.astype(np.float16), slots), TypeError, "new"),
        ("new float64", (pool, new.astype(np.float64), slots), TypeError, "new"),
        ("pool int vs new float", (pool.astype(np.int32), new, slots), TypeError, "new"),
        ("complex pool", (pool.astype(np.complex64), new.astype(np.complex64), slots), TypeError, "pool"),
        ("slots int32", (pool, new, slots.astype(np.int32)), TypeError, "slot_mapping"),
        ("slots float", (pool, new, slots.astype(np.float64)), TypeError, "slot_mapping"),
        ("big-endian pool", (pool.astype(">f4"), new.astype(">f4"), slots), TypeError, "pool"),
        ("pool 3-D", (pool[0], new, slots), ValueError, "pool"),
        ("new 2-D", (pool, new[0], slots[:2]), ValueError, "new"),
        ("slots 2-D", (pool, new, slots[None]), ValueError, "slot_mapping"),
        ("head mismatch", (pool, np.ones((3, 1, 8), np.float32), slots), ValueError, "new"),
        ("dim mismatch", (pool, np.ones((3, 2, 4), np.float32), slots), ValueError, "new"),
        ("T mismatch", (pool, new, slots[:2]), ValueError, "slot_mapping"),
        ("slot too big", (pool, new, np.array([0, 16, 1], np.int64)), ValueError, "slot_mapping"),
        ("slot negative", (pool, new, np.array([0, -1, 1], np.int64)), ValueError, "slot_mapping"),
        ("slot huge", (pool, new, np.array([2**62, 0, 1], np.int64)), ValueError, "slot_mapping"),
        ("read-only pool", (ro, new, slots), ValueError, "read-only"),
        ("pool not contiguous", (np.zeros((4, 4, 2, 16), np.float32)[..., ::2], new, slots), ValueError, "pool"),
        ("new not contiguous", (pool, np.ones((3, 2, 16), np.float32)[..., ::2], slots), ValueError, "new"),
        ("slots not contiguous", (pool, new, np.array([0, 9, 5, 9, 15, 9], np.int64)[::2]), ValueError,
         "slot_mapping"),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("label", "args", "exc", "match"), _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_scatter_rejects(impl, label: str, args: tuple, exc: type[Exception], match: str) -> None:
    pool = args[0]
    before = np.array(pool, copy=True) if isinstance(pool, np.ndarray) else None
    with pytest.raises(exc, match=match):
        impl.scatter_kv(*args)
    if before is not None:
        np.testing.assert_array_equal(pool, before)  # nothing written


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_layers_validates_all_before_writing(impl) -> None:
    pool, new, slots = _good()
    pools = [pool.copy(), pool.copy(), pool.copy()]
    news = [new, new, new.astype(np.float16)]
    with pytest.raises(TypeError, match="layer 2"):
        impl.scatter_kv_layers(pools, news, slots)
    assert all(not p.any() for p in pools)
    with pytest.raises(ValueError, match="2 pools but 3"):
        impl.scatter_kv_layers(pools[:2], news, slots)
    with pytest.raises(TypeError):
        impl.scatter_kv_layers(5, news, slots)
    with pytest.raises(ValueError, match="layer 1: slot_mapping"):
        impl.scatter_kv_layers([pool, pool[:1].copy()], [new, new], slots)
    impl.scatter_kv_layers([], [], slots)


def test_core_impl_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import runtime.core as core

    try:
        monkeypatch.setenv("OPTIMIZE_CORE", "python")
        importlib.reload(core)
        assert core.CORE_IMPL == "python" and core.scatter_kv is reference.scatter_kv
        monkeypatch.setenv("OPTIMIZE_CORE", "c")
        importlib.reload(core)
        assert core.CORE_IMPL == "c" and core.scatter_kv is _core.scatter_kv
        monkeypatch.setenv("OPTIMIZE_CORE", "fortran")
        with pytest.raises(ValueError, match="OPTIMIZE_CORE"):
            importlib.reload(core)
    finally:
        monkeypatch.undo()  # back to the caller's environment, then to its choice of core
        importlib.reload(core)
