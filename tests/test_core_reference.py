"""The pure-Python engine core: block manager, scheduler step and ForwardBatch packing.

The fake paged model and the helpers are in test_core_fixtures.py. These tests pin the twin's
decisions; test_core_c.py drives the C core beside it on random streams, and
test_prefix_cache.py pins prefix caching on both.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_fixtures import (
    SCHEDULERS,
    PagedFakeModel,
    check_pool,
    entries,
    reference_generation,
    step,
    tiny,
)

from runtime.core.reference import BatchEntry, BlockManager, ScheduledBatch, Scheduler, SchedulerConfig

# ---- block manager ---------------------------------------------------------------------------


def test_block_manager_basics() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    a = bm.allocate(2)
    assert a == [0, 1] and bm.num_free == 1
    bm.incref(0)
    bm.free(a)
    assert bm.num_free == 2 and bm.blocks[0].ref_count == 1  # still shared
    bm.free([0])
    assert bm.num_free == 3
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free([0])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(4)


# ---- exact ids -------------------------------------------------------------------------------


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_block_tables_and_slot_mapping(Sched) -> None:
    s = Sched(tiny())
    s.add(0, [1, 2, 3, 4, 5, 6])
    s.add(1, [7, 8, 9])
    batch, fb = step(s, tokens={0: 50, 1: 60})
    assert entries(batch) == [(0, 0, 6, True), (1, 0, 3, True)]
    np.testing.assert_array_equal(fb.input_ids, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(fb.positions, [0, 1, 2, 3, 4, 5, 0, 1, 2])
    np.testing.assert_array_equal(fb.cu_seqlens, [0, 6, 9])
    np.testing.assert_array_equal(fb.past_lens, [0, 0])
    np.testing.assert_array_equal(fb.block_table, [[0, 1], [2, -1]])
    np.testing.assert_array_equal(fb.slot_mapping, [0, 1, 2, 3, 4, 5, 8, 9, 10])
    np.testing.assert_array_equal(fb.logits_index, [5, 8])
    assert (fb.input_ids.dtype, fb.positions.dtype, fb.slot_mapping.dtype, fb.logits_index.dtype) == (np.int64,) * 4
    assert (fb.cu_seqlens.dtype, fb.past_lens.dtype, fb.block_table.dtype) == (np.int32,) * 3

    batch, fb = step(s, tokens={0: 51, 1: 61})
    assert entries(batch) == [(0, 6, 1, True), (1, 3, 1, True)]
    np.testing.assert_array_equal(fb.input_ids, [50, 60])
    np.testing.assert_array_equal(fb.positions, [6, 3])
    np.testing.assert_array_equal(fb.slot_mapping, [6, 11])
    np.testing.assert_array_equal(fb.block_table, [[0, 1], [2, -1]])
    np.testing.assert_array_equal(fb.logits_index, [0, 1])

    batch, fb = step(s, tokens={0: 52, 1: 62})
    np.testing.assert_array_equal(fb.positions, [7, 4])
    np.testing.assert_array_equal(fb.slot_mapping, [7, 12])  # seq 1 crossed into a new block: 3
    np.testing.assert_array_equal(fb.block_table, [[0, 1], [2, 3]])
    assert s.num_free_blocks == 7
    assert s.seq_tokens(0) == [1, 2, 3, 4, 5, 6, 50, 51, 52]
    assert s.seq_tokens(1) == [7, 8, 9, 60, 61, 62]

    s.finish(0)  # leaves at once, blocks back
    assert s.num_running == 1 and s.num_free_blocks == 9
    s.add(2, list(range(9)))
    batch, fb = step(s)
    assert entries(batch) == [(1, 5, 1, True), (2, 0, 9, True)]
    assert s.seq_block_table(2) == [4, 5, 6]
    np.testing.assert_array_equal(fb.slot_mapping, [13] + list(range(16, 25)))


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_chunked_prefill_under_budget(Sched) -> None:
    s = Sched(tiny(max_num_batched_tokens=5))
    s.add(0, list(range(12)))
    batch, fb = step(s, tokens={})
    assert entries(batch) == [(0, 0, 5, False)]
    assert fb.logits_index.size == 0 and s.seq_block_table(0) == [0, 1]
    batch, fb = step(s, tokens={})
    assert entries(batch) == [(0, 5, 5, False)]
    np.testing.assert_array_equal(fb.positions, range(5, 10))
    np.testing.assert_array_equal(fb.past_lens, [5])
    assert s.seq_block_table(0) == [0, 1, 2]
    batch, fb = step(s, tokens={0: 99})
    assert entries(batch) == [(0, 10, 2, True)]
    np.testing.assert_array_equal(fb.logits_index, [1])
    batch, fb = step(s)
    assert entries(batch) == [(0, 12, 1, True)]
    np.testing.assert_array_equal(fb.input_ids, [99])
    np.testing.assert_array_equal(fb.slot_mapping, [12])
    assert s.seq_block_table(0) == [0, 1, 2, 3]


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_decode_first_then_prefill_chunk_shares_budget(Sched) -> None:
    s = Sched(tiny(max_num_batched_tokens=5))
    s.add(0, [1, 2])
    step(s)
    s.add(1, list(range(8)))  # joins a running batch
    batch, _ = step(s)
    assert entries(batch) == [(0, 2, 1, True), (1, 0, 4, False)]
    batch, _ = step(s)
    assert entries(batch) == [(0, 3, 1, True), (1, 4, 4, True)]
    batch, _ = step(s)
    assert entries(batch) == [(0, 4, 1, True), (1, 8, 1, True)]


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_max_num_seqs_and_fcfs(Sched) -> None:
    s = Sched(tiny(max_num_seqs=2))
    for i in range(3):
        s.add(i, [i + 1, i + 2])
    batch, _ = step(s)
    assert [e.seq_id for e in batch.entries] == [0, 1]
    assert s.num_running == 2 and s.num_waiting == 1
    batch, _ = step(s)
    assert [e.seq_id for e in batch.entries] == [0, 1]
    s.finish(0)
    batch, _ = step(s)
    assert entries(batch) == [(1, 3, 1, True), (2, 0, 2, True)]


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_head_of_queue_waiting_for_blocks_is_not_overtaken(Sched) -> None:
    s = Sched(tiny())
    s.add(0, list(range(36)))  # 9 of 11 blocks
    s.add(1, list(range(9)))  # needs 3 blocks: only 2 free
    s.add(2, [1, 2])  # would fit, but arrived later
    batch, _ = step(s)
    assert [e.seq_id for e in batch.entries] == [0]
    assert s.num_waiting == 2
    s.finish(0)
    batch, _ = step(s)
    assert [e.seq_id for e in batch.entries] == [1, 2]


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_abort_frees_blocks_everywhere(Sched) -> None:
    s = Sched(tiny())
    s.add(0, list(range(10)))
    s.add(1, list(range(5)))
    step(s)
    s.add(2, [1])
    assert s.num_free_blocks == 11 - 3 - 2
    s.abort(0)
    assert s.num_free_blocks == 11 - 2 and s.num_running == 1
    s.abort(2)  # waiting
    assert s.num_waiting == 0
    s.abort(12345)  # unknown: no-op
    batch = s.schedule()
    assert batch is not None
    s.abort(1)  # aborted while "the model runs": update skips it
    s.update(batch, {1: 3})
    assert not s.has_unfinished() and s.num_free_blocks == 11
    assert s.schedule() is None


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_preemption_recomputes_and_everything_completes(Sched) -> None:
    cfg = SchedulerConfig(block_size=4, num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    s, model = Sched(cfg), PagedFakeModel(cfg)
    prompts = {0: [3, 1, 4, 1, 5, 9, 2], 1: [2, 7, 1, 8, 2, 8, 1]}
    for sid, p in prompts.items():
        s.add(sid, p)
    batches = []
    done: dict[int, list[int]] = {}
    while s.has_unfinished():
        batch, _ = step(s, model)
        batches.append(entries(batch))
        check_pool(s)
        for sid in list(prompts):
            if sid not in done and sid in s.seq_ids() and len(s.seq_tokens(sid)) == len(prompts[sid]) + 8:
                done[sid] = s.seq_tokens(sid)
                s.finish(sid)
    assert batches[0] == [(0, 0, 7, True), (1, 0, 7, True)]
    assert batches[1] == [(0, 7, 1, True), (1, 7, 1, True)]
    assert batches[2] == [(0, 8, 1, True)]  # seq 0 needs a 3rd block: seq 1 (newest) is preempted
    assert s.num_preemptions == 1
    assert [(1, 0, 9, True)] in batches  # recompute of prompt + generated, then logits
    for sid, p in prompts.items():
        assert done[sid] == reference_generation(p, 8)
    assert s.num_free_blocks == 4


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_sequence_outgrowing_the_pool_alone_raises(Sched) -> None:
    s = Sched(SchedulerConfig(block_size=2, num_blocks=2, max_model_len=10))
    s.add(0, [1, 2, 3])
    step(s)
    step(s)
    with pytest.raises(RuntimeError, match="whole pool has 2"):
        s.schedule()


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_add_rejects(Sched) -> None:
    s = Sched(tiny(max_model_len=100))
    s.add(0, [1])
    with pytest.raises(ValueError, match="already"):
        s.add(0, [1])
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(1, [])
    with pytest.raises(ValueError, match="max_model_len=100"):
        s.add(1, [1] * 101)
    with pytest.raises(ValueError, match="needs 12 KV blocks of 4 tokens; the pool has only 11"):
        s.add(1, [1] * 45)
    with pytest.raises(ValueError, match="block_size"):
        Sched(SchedulerConfig(block_size=0))
    with pytest.raises(ValueError, match="unknown sequence"):
        s.finish(7)


@pytest.mark.parametrize("Sched", SCHEDULERS)
def test_update_rejects(Sched) -> None:
    s = Sched(tiny(max_model_len=3))
    s.add(0, [1, 2])
    batch = s.schedule()
    with pytest.raises(ValueError, match="no next token"):
        s.update(batch, {})
    s2 = Sched(tiny(max_model_len=3))
    s2.add(0, [1, 2])
    step(s2)  # 3 tokens now
    batch = s2.schedule()
    with pytest.raises(RuntimeError, match="must finish it"):
        s2.update(batch, {0: 1})
    with pytest.raises(ValueError, match="stale"):
        s2.pack(ScheduledBatch([BatchEntry(0, 0, 1, False)]))


# ---- random streams --------------------------------------------------------------------------


@st.composite
def workload(draw: st.DrawFn):
    block_size = draw(st.sampled_from([1, 2, 4]))
    reqs = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 14), st.integers(1, 8)),
                         min_size=1, max_size=8))
    longest = max(p + m for _, p, m in reqs)
    min_blocks = -(-longest // block_size)
    cfg = SchedulerConfig(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, min_blocks * 3)),
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
        max_model_len=longest,
    )
    aborts = draw(st.sets(st.integers(0, len(reqs) - 1), max_size=2))
    return cfg, reqs, aborts, draw(st.integers(0, 2**16))


@settings(max_examples=120, deadline=None)
@given(workload(), st.booleans())
def test_random_streams_complete(case, caching: bool) -> None:
    cfg, reqs, aborts, seed = case
    cfg.enable_prefix_caching = caching
    rng = np.random.default_rng(seed)
    s, model = Scheduler(cfg), PagedFakeModel(cfg)
    stem = rng.integers(0, 100, size=14).tolist()  # prompts share prefixes of it half of the time
    prompts = {i: (stem[: int(rng.integers(0, p + 1))] if rng.random() < 0.5 else []) for i, (_, p, _) in enumerate(reqs)}
    prompts = {i: (pre + rng.integers(0, 100, size=reqs[i][1] - len(pre)).tolist()) for i, pre in prompts.items()}
    results: dict[int, list[int]] = {}
    abort_at = {i: int(rng.integers(0, 20)) for i in aborts}
    t = 0
    while t <= 12 or s.has_unfinished():
        assert t < 2000, "no progress"
        for i, (arrival, _, _) in enumerate(reqs):
            if arrival == t:
                s.add(i, prompts[i])
        for i, at in abort_at.items():
            if at == t:
                s.abort(i)
        t += 1
        if not s.has_unfinished():
            continue
        assert s.num_running <= cfg.max_num_seqs
        batch, fb = step(s, model)
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        assert len({e.seq_id for e in batch.entries}) == len(batch.entries)
        check_pool(s)
        for i in s.seq_ids():
            if len(s.seq_tokens(i)) == len(prompts[i]) + reqs[i][2]:
                results[i] = s.seq_tokens(i)
                s.finish(i)
                check_pool(s)
    assert s.num_free_blocks == cfg.num_blocks
    for i, (_, _, max_tokens) in enumerate(reqs):
        if i in results:
            assert results[i] == reference_generation(prompts[i], max_tokens)
        else:
            assert i in aborts
