"""The C core (runtime.core._core) against its pure-Python twin (runtime.core.reference).

KV scatter and block copy on random tensors; the scheduler on hypothesis-generated request streams
(arrivals, shared prefixes, identical prompts, aborts at any time, tight pools, tiny budgets) run
side by side, asserting after every step identical entries, copies, packed arrays, block tables,
pool state (reference counts, both free queues in order, cached blocks and their hashes),
counters and generated tokens; and identical exceptions (type and message) on bad input. Every
finished sequence's tokens are also checked against `reference_generation` (the fake model run
without any scheduler: an oracle independent of both cores), and each stream test asserts that
its streams exercised preemption, copy-on-write, prefix-cache eviction and hits, aborts of live
requests and (block hashes narrowed to a few bits in both cores) hash collisions, at least as often
as a floor set from measured runs. Sampling equivalence is in test_sampling.py."""

from __future__ import annotations

from collections import Counter
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_fixtures import CScheduler, PagedFakeModel, hash_bits, reference_generation

from runtime.core import _core, reference
from runtime.core.reference import BatchEntry, ScheduledBatch, SchedulerConfig

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


# ---- copy_blocks ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([np.float32, np.float16, np.int8]), st.integers(1, 6), st.integers(1, 3),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=6), st.integers(0, 2**32 - 1))
def test_copy_blocks_matches_twin(dtype, nb: int, layers: int, pairs: list, seed: int) -> None:
    pairs = [(a % nb, b % nb) for a, b in pairs]
    rng = np.random.default_rng(seed)
    pools = [(rng.normal(size=(nb, 2, 2, 3)) * 9).astype(dtype) for _ in range(layers)]
    c, py = [p.copy() for p in pools], [p.copy() for p in pools]
    _core.copy_blocks(c, pairs)
    reference.copy_blocks(py, np.asarray(pairs, np.int64).reshape(-1, 2))
    for a, b in zip(c, py, strict=True):
        assert a.tobytes() == b.tobytes()
    if pairs:  # sequential semantics: a later pair sees an earlier copy
        expect = [p.copy() for p in pools]
        for p in expect:
            for src, dst in pairs:
                p[dst] = p[src]
        assert all(np.array_equal(a, e) for a, e in zip(c, expect, strict=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_blocks_rejects_and_writes_nothing(impl) -> None:
    pool = np.arange(2 * 4 * 1 * 2, dtype=np.float32).reshape(4, 2, 1, 2)
    small = np.zeros((2, 2, 1, 2), np.float32)
    ro = pool.copy()
    ro.flags.writeable = False
    cases = [
        (([pool, small], [(0, 3)]), ValueError, r"block id 3 \(pair 0\) outside pools\[1\]'s \[0, 2\)"),
        (([pool], [(0, -1)]), ValueError, "block id -1"),
        (([pool], [(0, 1, 2)]), TypeError, "pairs"),
        (([pool], [(0.5, 1)]), TypeError, "pairs"),
        (([pool], np.zeros((2, 3), np.int64)), TypeError, "pairs"),
        (([pool[0]], [(0, 1)]), ValueError, "4 dimensions"),
        (([ro], [(0, 1)]), ValueError, "read-only"),
        (([np.zeros((4, 2, 1, 4), np.float32)[..., ::2]], [(0, 1)]), ValueError, "C-contiguous"),
        (([[1.0]], [(0, 1)]), TypeError, "buffer protocol"),
        ((5, [(0, 1)]), TypeError, "pools"),
    ]
    for args, exc, match in cases:
        before = pool.copy()
        with pytest.raises(exc, match=match):
            impl.copy_blocks(*args)
        np.testing.assert_array_equal(pool, before)
    impl.copy_blocks([pool], [])  # nothing to copy
    impl.copy_blocks([pool], np.zeros((0, 2), np.int64))
    impl.copy_blocks([pool], [(1, 1)])  # src == dst
    np.testing.assert_array_equal(pool, np.arange(16, dtype=np.float32).reshape(4, 2, 1, 2))


# ---- the scheduler, side by side ---------------------------------------------------------------

def same_state(c, p) -> None:
    """Every observable of the C scheduler equals the twin's."""
    assert (c.num_waiting, c.num_running, c.num_free_blocks, c.num_preemptions, c.has_unfinished()) == \
        (p.num_waiting, p.num_running, p.num_free_blocks, p.num_preemptions, p.has_unfinished())
    assert c.prefix_cache_stats() == p.prefix_cache_stats()
    assert c.block_pool_state() == p.block_pool_state()
    assert c.seq_ids() == p.seq_ids()
    for sid in p.seq_ids():
        assert c.seq_block_table(sid) == p.seq_block_table(sid)
        assert c.seq_tokens(sid) == p.seq_tokens(sid)
        assert (c.seq_num_cached(sid), c.seq_num_prompt(sid)) == (p.seq_num_cached(sid), p.seq_num_prompt(sid))


def same_fb(a, b) -> None:
    for name in ("input_ids", "positions", "cu_seqlens", "past_lens", "block_table", "slot_mapping", "logits_index"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name


def same_call(fc, fp):
    """Call both; equal results, or equal exception types and messages."""
    try:
        rp = fp()
    except Exception as exc:  # noqa: BLE001 - any exception must be mirrored
        with pytest.raises(type(exc)) as info:
            fc()
        assert str(info.value) == str(exc)
        return None, exc
    rc = fc()
    return (rc, rp), None


@st.composite
def stream(draw: st.DrawFn):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    vocab = draw(st.sampled_from([3, 20, 1000]))  # tiny vocabularies make identical blocks likely
    stems = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24), min_size=1, max_size=3))
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["stem", "block-aligned", "repeat", "fresh"]))
        stem = draw(st.sampled_from(stems))
        arrival = draw(st.integers(0, 30))
        if kind == "repeat" and reqs:  # an earlier prompt again, or its full blocks: full hits, copy-on-write
            src_arrival, src = draw(st.sampled_from(reqs))[:2]
            whole = (len(src) // block_size) * block_size
            prompt = list(src[:whole] if whole and draw(st.booleans()) else src)
            arrival = src_arrival + draw(st.integers(0, 30))  # after it: its blocks may be cached by then
        elif kind == "block-aligned":
            prompt = stem[: max(1, (len(stem) // block_size) * block_size)]
        elif kind == "stem":
            prompt = stem[: draw(st.integers(0, len(stem)))] + draw(st.lists(st.integers(0, vocab - 1), max_size=10))
        else:
            prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20))
        prompt = prompt or [0]
        reqs.append((arrival, prompt, draw(st.integers(1, 10)),
                     draw(st.one_of(st.none(), st.integers(0, 40))), draw(st.booleans())))
    longest = max(len(p) + m for _, p, m, _, _ in reqs)
    min_blocks = -(-longest // block_size)
    cfg = SchedulerConfig(
        block_size=block_size,
        # mostly tight pools; a little below the longest sequence's need now and then (errors mirrored)
        num_blocks=max(1, draw(st.integers(min_blocks, min_blocks * 2 + 2)) - draw(st.sampled_from([0] * 8 + [1, 2]))),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 32)),
        max_model_len=longest + draw(st.integers(0, 3)),
        enable_prefix_caching=draw(st.booleans()) or draw(st.booleans()),
        enable_copy_on_write=draw(st.booleans()) or draw(st.booleans()),
        prefix_cache_seed=draw(st.integers(0, 2**64 - 1)),
    )
    return cfg, reqs


def count_collisions(p: reference.Scheduler, events: Counter) -> None:
    """Count the twin's prefix-cache lookups that found the hash but another block (parent or tokens
    differ): the collision branch. The C scheduler's equal state after every step shows it took the
    same branch."""
    bm = p.block_manager
    lookup = bm.lookup

    def spy(h: int, parent: int, tokens) -> int | None:
        found = lookup(h, parent, tokens)
        if found is None and h in bm.hash_to_block:
            events["collisions"] += 1
        return found

    bm.lookup = spy  # type: ignore[method-assign]


def run_side_by_side(cfg: SchedulerConfig, reqs: list) -> Counter:
    """Drive both schedulers (each with its own fake model and KV) through one stream. Every finished
    sequence's tokens are checked against `reference_generation` (the model run without a scheduler).
    Returns what happened: steps, preemptions, copy-on-write copies, evictions from the prefix cache,
    cache hits (tokens), hash collisions, aborts of live requests, finished sequences checked, and
    whether a sequence outgrew the pool."""
    c, p = CScheduler(cfg), reference.Scheduler(cfg)
    mc, mp = PagedFakeModel(cfg, copy=_core.copy_blocks), PagedFakeModel(cfg)
    events: Counter = Counter()
    count_collisions(p, events)
    t = 0
    limits = {i: len(pr) + m for i, (_, pr, m, _, _) in enumerate(reqs)}
    last_arrival = max(r[0] for r in reqs)
    cached = set()

    def abort(i: int) -> None:
        events["aborts"] += i in p.seq_ids()
        c.abort(i)
        p.abort(i)

    while t <= last_arrival or p.has_unfinished():
        assert t < 3000, "no progress"
        for i, (arrival, prompt, _, abort_at, _) in enumerate(reqs):
            if arrival == t:
                same_call(lambda i=i, pr=prompt: c.add(i, pr), lambda i=i, pr=prompt: p.add(i, pr))
            if abort_at == t:
                abort(i)
        t += 1
        res, exc = same_call(c.schedule, p.schedule)
        if exc is not None:  # one sequence outgrew the pool: both raised the same error
            same_state(c, p)
            events["outgrew_pool"] += 1
            break
        bc, bp = res
        if bp is None:
            assert bc is None
            continue
        assert [tuple(e) for e in bc.entries] == [tuple(e) for e in bp.entries]
        assert bc.block_copies == bp.block_copies
        events["copy_on_write"] += len(bp.block_copies)
        assert all(type(e).__name__ == "BatchEntry" for e in bc.entries)
        fc, fp = c.pack(bc), p.pack(bp)
        same_fb(fc, fp)
        fp.validate(cfg.num_blocks, cfg.block_size)
        logit_ids = [e.seq_id for e in bp.entries if e.needs_logits]
        tokens_c = dict(zip(logit_ids, mc(fc, bc.block_copies), strict=True))
        tokens_p = dict(zip(logit_ids, mp(fp, bp.block_copies), strict=True))
        assert tokens_c == tokens_p
        for i, (_, _, _, abort_at, abort_in_flight) in enumerate(reqs):
            if abort_in_flight and abort_at == t and i in logit_ids:  # aborted while the model ran
                abort(i)
        same_call(partial(c.update, bc, tokens_c), partial(p.update, bp, tokens_p))
        events["steps"] += 1
        for sid in p.seq_ids():
            tokens = p.seq_tokens(sid)
            if len(tokens) >= min(limits[sid], cfg.max_model_len):
                prompt = reqs[sid][1]
                assert tokens == reference_generation(prompt, len(tokens) - len(prompt)), sid
                events["finished_checked"] += 1
                c.finish(sid)
                p.finish(sid)
        same_state(c, p)
        now = {tuple(pair) for pair in p.block_pool_state()["cached"]}
        events["evictions"] += len(cached - now)  # a cached (block, hash) pair gone: the block was reused
        cached = now
    else:
        assert c.num_free_blocks == p.num_free_blocks == cfg.num_blocks
    events["preemptions"] = p.num_preemptions
    events["cache_hit_tokens"] = p.prefix_cache_stats().hits
    return events


def examples_with(totals: Counter, per_example: Counter) -> None:
    """Add one stream's events to the totals, and count the streams where each kind occurred."""
    totals["examples"] += 1
    for k, v in per_example.items():
        totals[k] += v
        totals["examples_with_" + k] += v > 0


def test_scheduler_matches_twin_on_random_streams() -> None:
    """200 hypothesis streams, C against the twin and every finished sequence against the oracle; the
    streams must exercise what they are for. Measured on 200 examples (ten runs): preemption in
    7-36 streams, copy-on-write in 10-51, eviction in 60-101, aborts of live requests in 51-108,
    prefix-cache hits in 48-87; 926-1,120 sequences checked against the oracle, 3,929-5,935 steps
    (a sequence outgrowing the pool: 0-8 streams, not floored). Hypothesis varies its streams from
    run to run a lot, so the floors are well below the lowest."""
    seen: Counter = Counter()

    @settings(max_examples=200, deadline=None)
    @given(stream())
    def check(case) -> None:
        examples_with(seen, run_side_by_side(*case))

    check()
    assert seen["examples"] >= 200, seen
    for kind, n in [("preemptions", 3), ("copy_on_write", 3), ("evictions", 25), ("aborts", 20),
                    ("cache_hit_tokens", 20)]:
        assert seen["examples_with_" + kind] >= n, (kind, seen)
    assert seen["finished_checked"] >= 300 and seen["steps"] >= 1500, seen


def test_scheduler_matches_twin_with_colliding_hashes() -> None:
    """Block hashes narrowed to 1-4 bits in both cores: distinct blocks share hashes, so lookups hit
    the collision branch (a miss, never another block's K/V) and registration skips taken hashes;
    C and twin must still agree, and every sequence must still generate the oracle's tokens.
    Measured on 100 examples: collisions in 26-52 streams over fourteen runs, but 7 in one run under
    AddressSanitizer; 200 examples keep the floor far below what a run sees."""
    seen: Counter = Counter()

    @settings(max_examples=200, deadline=None)
    @given(stream(), st.integers(1, 4))
    def check(case, bits: int) -> None:
        with hash_bits(bits):
            examples_with(seen, run_side_by_side(*case))

    check()
    assert seen["examples_with_collisions"] >= 10, seen
    assert seen["finished_checked"] >= 300, seen


def test_hash_width_hook_defaults_to_64_bits_and_validates_alike() -> None:
    """Production hashes are 64-bit (the hook's default); both cores check the width the same way, and
    a scheduler keeps the width it was created with."""
    for impl in (_core, reference):
        assert impl.set_hash_bits_for_tests(64) == 64
        for bad in (0, 65, -1):
            with pytest.raises(ValueError, match=rf"hash bits must be in \[1, 64\], got {bad}"):
                impl.set_hash_bits_for_tests(bad)
        assert impl.set_hash_bits_for_tests(64) == 64
    cfg = SchedulerConfig(block_size=2, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=8,
                          prefix_cache_seed=5)
    hashes = {}
    for bits in (64, 3):
        with hash_bits(bits):
            scheds = (CScheduler(cfg), reference.Scheduler(cfg))
        for s in scheds:  # created under the hook, used after it
            s.add(0, [1, 2, 3, 4, 5])
            s.update(s.schedule(), {0: 6})
        assert scheds[0].block_pool_state() == scheds[1].block_pool_state()
        hashes[bits] = [h for _, h in scheds[1].block_pool_state()["cached"]]
    key = reference.hash_key(5)
    first = reference.block_hash(0, [1, 2], key)
    assert hashes[64] == [first, reference.block_hash(first, [3, 4], key)]
    assert hashes[3] == [first & 7, reference.block_hash(first & 7, [3, 4], key) & 7]


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_matches_twin_on_long_busy_streams(seed: int) -> None:
    """Many overlapping requests with a common system prompt on a pool that keeps evicting; some
    prompts repeat an earlier one or stop at a block boundary of the system prompt (full hits:
    copy-on-write)."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([2, 4, 16]))
    system = rng.integers(0, 50, 40).tolist()
    reqs = []
    for _ in range(60):
        own = rng.integers(0, 50, int(rng.integers(1, 30))).tolist()
        kind = rng.random()
        if kind < 0.1 and reqs:
            prompt = list(reqs[int(rng.integers(0, len(reqs)))][1])
        elif kind < 0.2:
            prompt = system[: block_size * int(rng.integers(1, 40 // block_size + 1))]
        elif kind < 0.85:
            prompt = system[: int(rng.integers(0, 41))] + own
        else:
            prompt = own
        arrival = int(rng.integers(0, 150))
        abort = arrival + int(rng.integers(0, 40)) if rng.random() < 0.15 else None
        reqs.append((arrival, prompt, int(rng.integers(1, 25)), abort, bool(rng.random() < 0.5)))
    cfg = SchedulerConfig(block_size=block_size, num_blocks=0, max_num_seqs=12,
                          max_num_batched_tokens=64, max_model_len=96, prefix_cache_seed=seed,
                          enable_copy_on_write=True)
    cfg.num_blocks = 2 * -(-96 // cfg.block_size) + 4
    events = run_side_by_side(cfg, reqs)
    # deterministic streams: measured per seed 0/1/2: copy-on-write 2/5/7, preemptions 3/14/9, aborts
    # of live requests 1/3/3, evictions 78/369/79, sequences checked against the oracle 59/57/57
    assert events["outgrew_pool"] == 0 and events["finished_checked"] >= 50, events
    for kind in ("preemptions", "copy_on_write", "evictions", "aborts", "cache_hit_tokens"):
        assert events[kind] >= 1, (kind, events)


def test_scheduler_errors_match_twin() -> None:
    cfg = SchedulerConfig(block_size=4, num_blocks=6, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=12,
                          prefix_cache_seed=0)
    c, p = CScheduler(cfg), reference.Scheduler(cfg)

    def both(name: str, *args) -> Exception | None:
        _, exc = same_call(lambda: getattr(c, name)(*args), lambda: getattr(p, name)(*args))
        same_state(c, p)
        return exc

    for args in [(0, [1, 2, 3]), (0, [1]), (1, []), (1, [1] * 13), (-1, [1]), ("x", [1]), (2**63, [1]),
                 (1, [1.5]), (1, [-3]), (1, [2**63]), (1, [np.int64(4), 5]), (True, [1])]:
        both("add", *args)
    for sid in (0, 5, "x", 1.0, None, np.int64(0), True):
        both("seq_tokens", sid)
        both("seq_num_cached", sid)
    for sid in (99, "x", None, 1.5):
        both("finish", sid)
        both("abort", sid)
    batch_c, batch_p = c.schedule(), p.schedule()
    E = BatchEntry
    bad_batches = [
        [E(7, 0, 1, False)],  # unknown
        [E(0, 0, 3, True), E(0, 0, 3, True)],  # twice
        [E(0, 1, 2, True)],  # stale start
        [E(0, 0, 0, False)],  # empty chunk
        [E(0, 0, 3, False)],  # wrong needs_logits
        [E(0, 0, 4, True)],  # past the known tokens
        [E("a", 0, 3, True)],
        [E(0, 0.0, 3, True)],
        [E(0, 2**70, 3, True)],
    ]
    for entries_ in bad_batches:
        both("pack", ScheduledBatch(entries_))
    for tokens in ({}, {0: -1}, {0: 1.5}, {0: 2**64}, [], {0: 7, 1: 8}):
        _, exc = same_call(lambda tk=tokens: c.update(batch_c, tk), lambda tk=tokens: p.update(batch_p, tk))
        same_state(c, p)
    # a sequence that outgrows the pool alone
    cfg2 = SchedulerConfig(block_size=2, num_blocks=2, max_model_len=10, prefix_cache_seed=0)
    c2, p2 = CScheduler(cfg2), reference.Scheduler(cfg2)
    for s in (c2, p2):
        s.add(0, [1, 2, 3])
        for _ in range(2):
            b = s.schedule()
            s.update(b, {0: 9})
    _, exc = same_call(c2.schedule, p2.schedule)
    assert isinstance(exc, RuntimeError) and "whole pool has 2" in str(exc)
    same_state(c2, p2)


def test_c_scheduler_constructor_checks() -> None:
    cfg = SchedulerConfig(block_size=4, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    good = CScheduler(cfg)._bufs

    def make(**kw):
        args = dict(block_size=4, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16,
                    enable_prefix_caching=True, enable_copy_on_write=True, seed=0, entry_type=BatchEntry, batch_type=ScheduledBatch,
                    stats_type=reference.PrefixCacheStats, buffers=good)
        args.update(kw)
        return _core.Scheduler(**args)

    make()
    for kw, exc in [
        ({"block_size": 0}, ValueError), ({"num_blocks": 2**31}, ValueError), ({"max_model_len": 1.5}, TypeError),
        ({"enable_prefix_caching": 1}, TypeError), ({"enable_copy_on_write": None}, TypeError), ({"seed": -1}, ValueError), ({"seed": 2**64}, ValueError),
        ({"entry_type": tuple}, None), ({"entry_type": list}, TypeError), ({"entry_type": reference.Block}, TypeError),
        ({"batch_type": 3}, TypeError), ({"buffers": good[:6]}, ValueError),
        ({"buffers": (good[0][:7],) + good[1:]}, ValueError),
        ({"buffers": good[:3] + (good[3].astype(np.int64),) + good[4:]}, ValueError),
        ({"buffers": (np.zeros(8, np.int64)[::1].copy()[None],) + good[1:]}, ValueError),
        ({"max_num_seqs": 3}, ValueError),  # the buffers are too small for it
    ]:
        if exc is None:
            make(**kw)
            continue
        with pytest.raises(exc):
            make(**kw)
    ro = good[0].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="input_ids"):
        make(buffers=(ro,) + good[1:])
    raw = _core.Scheduler.__new__(_core.Scheduler)
    with pytest.raises(RuntimeError, match="not initialized"):
        raw.schedule()
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = raw.num_running
    s = make()
    with pytest.raises(RuntimeError, match="twice"):
        s.__init__(4, 8, 2, 8, 16, True, True, 0, BatchEntry, ScheduledBatch, reference.PrefixCacheStats, good)
    assert s.schedule() is None


def test_c_scheduler_survives_many_requests_and_map_growth() -> None:
    cfg = SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                          max_model_len=16, prefix_cache_seed=3)
    c, p = CScheduler(cfg), reference.Scheduler(cfg)
    for i in range(0, 3000, 7):  # sparse, growing ids: the id map grows and deletes with backward shifts
        for s in (c, p):
            s.add(i * 1_000_003, [i % 5, 1, 2, 3, i % 3])
    for k, i in enumerate(range(0, 3000, 7)):
        if k % 3 == 0:
            c.abort(i * 1_000_003)
            p.abort(i * 1_000_003)
    same_state(c, p)
    while p.has_unfinished():
        bc, bp = c.schedule(), p.schedule()
        assert [tuple(e) for e in bc.entries] == [tuple(e) for e in bp.entries]
        same_fb(c.pack(bc), p.pack(bp))
        toks = {e.seq_id: 1 for e in bp.entries if e.needs_logits}
        c.update(bc, toks)
        p.update(bp, toks)
        for sid in p.seq_ids():
            if len(p.seq_tokens(sid)) >= 7:
                c.finish(sid)
                p.finish(sid)
        same_state(c, p)


def test_onnxruntime_backend_copy_blocks_copies_every_layer() -> None:
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    backend = object.__new__(OnnxRuntimeBackend)  # the pools only; no ONNX session needed
    rng = np.random.default_rng(0)
    backend.k_pools = [rng.normal(size=(5, 4, 2, 3)).astype(np.float32) for _ in range(2)]
    backend.v_pools = [rng.normal(size=(5, 4, 2, 3)).astype(np.float32) for _ in range(2)]
    backend._copy_blocks = _core.copy_blocks
    want = [p.copy() for p in backend.k_pools + backend.v_pools]
    for p in want:
        p[3] = p[1]
        p[0] = p[3]
    backend.copy_blocks([(1, 3), (3, 0)])
    backend.copy_blocks([])
    for got, exp in zip(backend.k_pools + backend.v_pools, want, strict=True):
        np.testing.assert_array_equal(got, exp)


def test_no_memory_growth_over_many_schedulers_and_samples() -> None:
    """The C core returns what it allocates (tracemalloc sees PyMem) and keeps no references to its
    arguments (reference counts unchanged)."""
    import gc
    import sys
    import tracemalloc

    from runtime.sampling import SamplingParams, make_generator

    params = [SamplingParams(top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=2)] * 3
    gens = [make_generator(i) for i in range(3)]
    logits = np.random.default_rng(0).normal(size=(3, 500)).astype(np.float32)
    pool = np.zeros((4, 2, 1, 1))
    history = [[1, 2]] * 3
    watched = [params[0], gens[0], gens[0].state, logits, pool, history, BatchEntry, ScheduledBatch,
               reference.PrefixCacheStats]

    def work() -> None:
        cfg = SchedulerConfig(block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16,
                              max_model_len=40, prefix_cache_seed=1, enable_copy_on_write=True)
        s = CScheduler(cfg)
        for i in range(12):
            s.add(i, [1, 2, 3, 4, 5, 6, 7, 8][: 4 + i % 5])
        while s.has_unfinished():
            b = s.schedule()
            s.pack(b)
            s.update(b, {e.seq_id: 3 for e in b.entries if e.needs_logits})
            s.prefix_cache_stats()
            for sid in s.seq_ids()[:1]:
                if len(s.seq_tokens(sid)) > 12:
                    s.finish(sid)
        s.abort(0)
        out = np.empty(3, np.int64)
        lp = (np.empty(3), np.empty((3, 2), np.int64), np.empty((3, 2)))
        _core.sample(logits, params, gens, history, [[3]] * 3, out, lp)
        _core.copy_blocks([pool], [(0, 1)])

    for _ in range(50):
        work()
    gc.collect()
    refs = [sys.getrefcount(o) for o in watched]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            work()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(o) for o in watched] == refs
    assert grown < 4_000, f"{grown} bytes more after 300 rounds"  # one leaked object per round: >= 9 kB


def test_pack_and_update_accept_rebuilt_or_edited_entries() -> None:
    """Entries made by the last schedule() take a fast path; copies, reorderings and hand-made entries the
    generic one: the same ForwardBatch, the same checks."""
    cfg = SchedulerConfig(block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=40, prefix_cache_seed=0)
    c = CScheduler(cfg)
    for i in range(4):
        c.add(i, list(range(3 + i)))
    batch = c.schedule()
    fast = c.pack(batch)
    fast = {k: getattr(fast, k).copy() for k in ("input_ids", "positions", "cu_seqlens", "past_lens",
                                                   "block_table", "slot_mapping", "logits_index")}
    rebuilt = ScheduledBatch([BatchEntry(*e) for e in batch.entries])
    slow = c.pack(rebuilt)
    for k, v in fast.items():
        np.testing.assert_array_equal(getattr(slow, k), v)
    swapped = ScheduledBatch(batch.entries[::-1])
    fb = c.pack(swapped)
    np.testing.assert_array_equal(fb.past_lens, fast["past_lens"][::-1])
    with pytest.raises(ValueError, match="appears twice"):
        c.pack(ScheduledBatch(batch.entries + batch.entries[:1]))
    c.abort(2)
    with pytest.raises(ValueError, match="unknown sequence id 2"):
        c.pack(batch)
    c.update(batch, {0: 5, 1: 5, 3: 5})  # the aborted one is skipped
    with pytest.raises(ValueError, match="stale"):
        c.update(batch, {0: 5, 1: 5, 3: 5})  # the same entries again: no longer at their start
    assert [len(c.seq_tokens(i)) for i in (0, 1, 3)] == [4, 5, 7]
