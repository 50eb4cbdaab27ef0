"""Prefix caching and copy-on-write, pinned to exact block ids on a tiny pool (11 blocks x 4 tokens),
on the C scheduler and its Python twin alike.

Reading guide for the pool state: `free` are unreferenced blocks outside the cache (allocated
first, FIFO), `cached_free` unreferenced blocks still in the cache (evicted LRU first, only when
`free` is empty), `cached` the blocks with a hash. A finished sequence frees its blocks last
first, so its tail is evicted before its head.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_core_fixtures import (
    SCHEDULERS,
    PagedFakeModel,
    check_pool,
    entries,
    hash_bits,
    reference_generation,
    step,
    tiny,
)

from runtime.core import reference
from runtime.core.reference import SchedulerConfig

pytestmark = pytest.mark.parametrize("Sched", SCHEDULERS)


def cached_ids(s) -> list[int]:
    return [b for b, _ in s.block_pool_state()["cached"]]


def run_to_completion(s, model, max_tokens: dict[int, int]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Step until every sequence in max_tokens has generated that many; (tokens, computed prompt tokens)."""
    done: dict[int, list[int]] = {}
    prefill: dict[int, int] = {sid: 0 for sid in max_tokens}
    while s.has_unfinished():
        batch, _ = step(s, model)
        for e in batch.entries:
            if e.start < s.seq_num_prompt(e.seq_id):
                prefill[e.seq_id] += min(e.num_tokens, s.seq_num_prompt(e.seq_id) - e.start)
        check_pool(s)
        for sid in list(s.seq_ids()):
            if len(s.seq_tokens(sid)) == s.seq_num_prompt(sid) + max_tokens[sid]:
                done[sid] = s.seq_tokens(sid)
                s.finish(sid)
    return done, prefill


def test_prefill_shares_cached_blocks_and_evicts_lru(Sched) -> None:
    s = Sched(tiny())
    common = list(range(12))  # three full blocks
    s.add(0, common + [100, 101])
    batch, fb = step(s, tokens={0: 50})
    assert entries(batch) == [(0, 0, 14, True)]
    assert s.seq_block_table(0) == [0, 1, 2, 3]
    assert cached_ids(s) == [0, 1, 2]  # full and computed; block 3 holds 2 tokens
    assert s.prefix_cache_stats() == (1, 14, 0) and s.seq_num_cached(0) == 0

    s.add(1, common + [200, 201, 202])
    batch, fb = step(s, tokens={0: 51, 1: 60})
    assert entries(batch) == [(0, 14, 1, True), (1, 12, 3, True)]  # 12 tokens not computed again
    assert batch.block_copies == []
    assert s.seq_block_table(1) == [0, 1, 2, 4]
    np.testing.assert_array_equal(fb.input_ids, [50, 200, 201, 202])
    np.testing.assert_array_equal(fb.past_lens, [14, 12])
    np.testing.assert_array_equal(fb.slot_mapping, [14, 16, 17, 18])
    np.testing.assert_array_equal(fb.block_table, [[0, 1, 2, 3], [0, 1, 2, 4]])
    assert s.block_pool_state()["ref_counts"][:5] == [2, 2, 2, 1, 1]
    assert s.prefix_cache_stats() == (2, 29, 12) and s.seq_num_cached(1) == 12
    assert s.num_free_blocks == 6

    s.finish(0)  # 3 is not cached: back to the fresh queue; 0-2 are still held by seq 1
    assert s.block_pool_state()["free"] == [5, 6, 7, 8, 9, 10, 3]
    assert s.block_pool_state()["cached_free"] == []
    s.finish(1)
    st = s.block_pool_state()
    assert st["free"] == [5, 6, 7, 8, 9, 10, 3, 4]
    assert st["cached_free"] == [2, 1, 0]  # last block first: evicted first
    assert s.num_free_blocks == 11

    s.add(2, list(range(300, 331)))  # 31 tokens: the 8 fresh blocks, no eviction
    step(s, tokens={2: 7})
    assert s.seq_block_table(2) == [5, 6, 7, 8, 9, 10, 3, 4]
    assert s.block_pool_state()["cached_free"] == [2, 1, 0]
    s.add(3, list(range(400, 406)))  # no fresh block left: evicts 2, then 1
    batch, _ = step(s, tokens={2: 8, 3: 9})
    assert entries(batch) == [(2, 31, 1, True), (3, 0, 6, True)]
    assert s.seq_block_table(3) == [2, 1]
    assert s.block_pool_state()["cached_free"] == [0]
    assert cached_ids(s) == [0, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 2 now caches seq 3's first block; 1 is gone

    s.finish(2)  # all 8 blocks are full and computed: cached, tail first
    assert s.block_pool_state()["cached_free"] == [0, 4, 3, 10, 9, 8, 7, 6, 5]
    s.add(4, common + [7])  # block 0 still cached, block 1 was evicted
    batch, _ = step(s, tokens={3: 1, 4: 2})
    assert entries(batch) == [(3, 6, 1, True), (4, 4, 9, True)]
    assert s.seq_block_table(4) == [0, 4, 3, 10]  # hit, then evictions in LRU order
    assert s.prefix_cache_stats() == (5, 29 + 31 + 6 + 13, 12 + 4)
    check_pool(s)


def test_full_prompt_hit_copies_the_last_block(Sched) -> None:
    s = Sched(tiny())
    model = PagedFakeModel(s.config)
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    s.add(0, p)
    step(s, model)
    assert cached_ids(s) == [0, 1]
    s.add(1, p)  # identical prompt while seq 0 runs
    batch, fb = step(s, model)
    # seq 1: block 0 shared, block 1 copied into a fresh block (3); only its last token runs
    assert entries(batch) == [(0, 8, 1, True), (1, 7, 1, True)]
    assert batch.block_copies == [(1, 3)]
    assert s.seq_block_table(0) == [0, 1, 2] and s.seq_block_table(1) == [0, 3]
    np.testing.assert_array_equal(fb.positions, [8, 7])
    np.testing.assert_array_equal(fb.slot_mapping, [8, 15])
    np.testing.assert_array_equal(fb.past_lens, [8, 7])
    np.testing.assert_array_equal(fb.block_table, [[0, 1, 2], [0, 3, -1]])
    assert s.block_pool_state()["ref_counts"][:4] == [2, 1, 1, 1]
    assert s.prefix_cache_stats() == (2, 16, 7) and s.seq_num_cached(1) == 7
    assert s.seq_tokens(1) == reference_generation(p, 1)  # the copy carried the K/V of tokens 4..6
    done, _ = run_to_completion(s, model, {0: 4, 1: 4})
    assert done == {0: reference_generation(p, 4), 1: reference_generation(p, 4)}


def test_without_copy_on_write_a_fully_cached_prompt_recomputes_its_last_block(Sched) -> None:
    assert SchedulerConfig().enable_copy_on_write is False  # safe for an engine that ignores block_copies
    s = Sched(tiny(enable_copy_on_write=False))
    model = PagedFakeModel(s.config)
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    s.add(0, p)
    step(s, model)
    s.add(1, p)
    batch, _ = step(s, model)
    assert entries(batch) == [(0, 8, 1, True), (1, 4, 4, True)] and batch.block_copies == []
    assert s.seq_block_table(1) == [0, 3]
    assert s.prefix_cache_stats() == (2, 16, 4) and s.seq_num_cached(1) == 4
    assert s.seq_tokens(1) == reference_generation(p, 1)


def test_copy_on_write_source_evicted_for_its_own_copy(Sched) -> None:
    s = Sched(tiny(num_blocks=2, max_model_len=9))
    model = PagedFakeModel(s.config)
    p = [2, 7, 1, 8, 2, 8, 1, 8]
    s.add(0, p)
    step(s, model)
    s.finish(0)
    assert s.block_pool_state()["cached_free"] == [1, 0]
    s.add(1, p)
    batch, _ = step(s, model)
    # block 0 is shared; the only block left to copy into is the source itself: no copy needed
    assert entries(batch) == [(1, 7, 1, True)] and batch.block_copies == []
    assert s.seq_block_table(1) == [0, 1] and cached_ids(s) == [0, 1]  # 1 re-cached once computed
    assert s.seq_tokens(1) == reference_generation(p, 1)


def test_same_step_requests_do_not_share_uncomputed_blocks(Sched) -> None:
    s = Sched(tiny())
    p = list(range(10, 18))
    s.add(0, p)
    s.add(1, p)
    batch, _ = step(s)
    assert entries(batch) == [(0, 0, 8, True), (1, 0, 8, True)]  # nothing was computed yet
    assert s.seq_block_table(1) == [2, 3]
    assert cached_ids(s) == [0, 1]  # one block per hash: seq 1's duplicates stay uncached
    s.finish(0)
    s.finish(1)
    st = s.block_pool_state()
    assert st["cached_free"] == [1, 0] and st["free"][-2:] == [3, 2]
    assert s.prefix_cache_stats() == (2, 16, 0)


def test_generated_tokens_fill_cached_blocks(Sched) -> None:
    s = Sched(tiny())
    model = PagedFakeModel(s.config)
    p = [5, 6, 7, 8, 9, 10]
    s.add(0, p)
    for _ in range(4):
        step(s, model)
    tokens = s.seq_tokens(0)  # 10 tokens, 9 computed: blocks 0 and 1 (with 2 generated tokens) cached
    assert tokens == reference_generation(p, 4) and cached_ids(s) == [0, 1]
    s.add(1, tokens[:8] + [42, 43])
    batch, _ = step(s, model)
    assert entries(batch)[1] == (1, 8, 2, True)
    assert s.seq_num_cached(1) == 8


def test_preempted_sequence_finds_its_own_blocks(Sched) -> None:
    cfg = tiny(num_blocks=6, max_model_len=20)
    s, model = Sched(cfg), PagedFakeModel(cfg)
    p0, p1 = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    s.add(0, p0)
    s.add(1, p1)
    batches = []
    done, num_cached = {}, {}
    while s.has_unfinished():
        batch, _ = step(s, model)
        batches.append(entries(batch))
        check_pool(s)
        for sid, (p, n) in {0: (p0, 8), 1: (p1, 8)}.items():
            if sid not in done and sid in s.seq_ids() and len(s.seq_tokens(sid)) == len(p) + n:
                done[sid] = s.seq_tokens(sid)
                num_cached[sid] = s.seq_num_cached(sid)
                s.finish(sid)
    assert s.num_preemptions == 1
    # seq 1 was preempted holding 13 tokens in blocks [2, 3, 5]; its tail block 5 was evicted for
    # seq 0, the first two were still cached when seq 0 finished: only 5 tokens are recomputed
    assert [(0, 12, 1, True)] in batches
    assert [(1, 8, 5, True)] in batches
    assert num_cached == {0: 0, 1: 0}  # counted at the first admission
    assert s.prefix_cache_stats() == (3, 8 + 8 + 13, 8)
    assert done == {0: reference_generation(p0, 8), 1: reference_generation(p1, 8)}


def test_second_request_with_a_256_token_prefix_computes_only_its_tail(Sched) -> None:
    cfg = SchedulerConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=512, prefix_cache_seed=1, enable_copy_on_write=True)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 100, 256).tolist()
    a, b = prefix + rng.integers(0, 100, 20).tolist(), prefix + rng.integers(0, 100, 30).tolist()
    counts = {}
    for caching in (True, False):
        cfg.enable_prefix_caching = caching
        s, model = Sched(cfg), PagedFakeModel(cfg)
        s.add(0, a)
        done_a, prefill_a = run_to_completion(s, model, {0: 3})
        s.add(1, b)
        steps_to_first_token = 0
        while len(s.seq_tokens(1)) == len(b):
            step(s, model)
            steps_to_first_token += 1
        done_b, prefill_b = run_to_completion(s, model, {1: 2})
        prefill_b[1] += 0
        assert done_a[0] == reference_generation(a, 3) and done_b[1] == reference_generation(b, 2)
        counts[caching] = (prefill_a[0], steps_to_first_token, s.prefix_cache_stats())
        if caching:
            cached_b = 256
            assert s.prefix_cache_stats() == (2, 276 + 286, cached_b)
        else:
            assert s.prefix_cache_stats() == (0, 0, 0)
    assert counts[False][:2] == (276, 5)  # 286 tokens in chunks of 64
    assert counts[True][:2] == (276, 1)  # 30 tokens after 256 cached


def test_prefill_tokens_counted_for_the_second_request(Sched) -> None:
    cfg = SchedulerConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=512, prefix_cache_seed=1, enable_copy_on_write=True)
    prefix = list(range(256))
    s, model = Sched(cfg), PagedFakeModel(cfg)
    s.add(0, prefix + [1, 2, 3])
    done, prefill = run_to_completion(s, model, {0: 2})
    s.add(1, prefix + [4, 5])
    done, prefill = run_to_completion(s, model, {1: 2})
    assert prefill == {1: 2} and s.prefix_cache_stats().hits == 256
    assert done[1] == reference_generation(prefix + [4, 5], 2)


@pytest.mark.parametrize(("caching", "cow"), [(True, True), (True, False), (False, False)])
def test_tight_pool_completes_with_preemptions_like_a_large_pool(Sched, caching: bool, cow: bool) -> None:
    rng = np.random.default_rng(3)
    stem = rng.integers(0, 100, 24).tolist()
    prompts = {i: stem[: int(rng.integers(4, 24))] + rng.integers(0, 100, int(rng.integers(1, 9))).tolist()
               for i in range(8)}
    outs = {}
    for num_blocks in (10, 200):
        cfg = SchedulerConfig(block_size=4, num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=24,
                              max_model_len=40, enable_prefix_caching=caching, enable_copy_on_write=cow,
                              prefix_cache_seed=2)
        s, model = Sched(cfg), PagedFakeModel(cfg)
        for i, p in prompts.items():
            s.add(i, p)
        done, _ = run_to_completion(s, model, {i: 8 for i in prompts})
        outs[num_blocks] = (done, s.num_preemptions)
        assert s.num_free_blocks == num_blocks
    assert outs[10][0] == outs[200][0] == {i: reference_generation(p, 8) for i, p in prompts.items()}
    assert outs[10][1] > 0 and outs[200][1] == 0


def test_caching_off_never_shares(Sched) -> None:
    s = Sched(tiny(enable_prefix_caching=False))
    p = list(range(8))
    s.add(0, p)
    step(s)
    s.finish(0)
    s.add(1, p)
    batch, _ = step(s)
    assert entries(batch) == [(1, 0, 8, True)] and batch.block_copies == []
    assert s.seq_block_table(1) == [2, 3]  # the fresh queue: 0 and 1 went to its tail
    assert cached_ids(s) == [] and s.prefix_cache_stats() == (0, 0, 0)


def test_hash_collision_is_a_miss(Sched) -> None:
    """Block hashes narrowed to 8 bits in both cores (the test-only hook): [9, 9, 9, x] is chosen to
    share the hash of [1, 2, 3, 4]; looking it up must verify the tokens and miss."""
    cfg = tiny()
    key = reference.hash_key(cfg.prefix_cache_seed)
    h = reference.block_hash(0, [1, 2, 3, 4], key) & 0xFF
    x = next(x for x in range(100_000) if reference.block_hash(0, [9, 9, 9, x], key) & 0xFF == h)
    with hash_bits(8):
        s = Sched(cfg)
    s.add(0, [1, 2, 3, 4, 5])
    step(s)
    assert s.block_pool_state()["cached"] == [[0, h]]
    s.add(1, [9, 9, 9, x, 5])  # the same hash, other tokens: must not be served block 0
    batch, _ = step(s)
    assert entries(batch)[1] == (1, 0, 5, True)
    assert s.prefix_cache_stats().hits == 0
    s.add(2, [1, 2, 3, 4, 6])
    batch, _ = step(s)
    assert entries(batch)[-1] == (2, 4, 1, True)
