"""The pure-Python engine core: block manager, scheduler step and ForwardBatch packing.

A fake paged "model" drives the scheduler: it writes each step's input ids into a token-id KV
pool through `slot_mapping` and, for every logits row, reads the sequence's whole history back
through `block_table`, so wrong block tables or slots change the generated tokens. The next
token is a hash of that history (no neural network is mocked; this only exercises the core).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.core.reference import BatchEntry, BlockManager, ScheduledBatch, Scheduler, SchedulerConfig
from runtime.forward_batch import ForwardBatch


def next_token(history: list[int]) -> int:
    h = 0
    for t in history:
        h = (h * 31 + int(t) + 7) % 1_000_003
    return h % 100


def reference_generation(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens


class PagedFakeModel:
    """Token ids as the KV cache: scatter by slot_mapping, gather the history by block_table."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.bs = cfg.block_size
        self.kv = np.full(cfg.num_blocks * cfg.block_size, -1, np.int64)

    def __call__(self, fb: ForwardBatch) -> list[int]:
        self.kv[fb.slot_mapping] = fb.input_ids
        out = []
        for idx in fb.logits_index:
            b = int(np.searchsorted(fb.cu_seqlens, idx, side="right")) - 1
            n = int(fb.past_lens[b]) + int(fb.cu_seqlens[b + 1] - fb.cu_seqlens[b])
            pos = np.arange(n)
            history = self.kv[fb.block_table[b, pos // self.bs].astype(np.int64) * self.bs + pos % self.bs]
            assert (history >= 0).all(), "history read from a slot never written"
            out.append(next_token(history.tolist()))
        return out


def step(s: Scheduler, model: PagedFakeModel | None = None,
         tokens: dict[int, int] | None = None) -> tuple[ScheduledBatch, ForwardBatch]:
    """schedule + pack + validate + (fake) model + update."""
    batch = s.schedule()
    assert batch is not None
    fb = s.pack(batch)
    fb.validate(s.config.num_blocks, s.config.block_size)
    logit_seqs = [e.seq_id for e in batch.entries if e.needs_logits]
    if model is not None:
        tokens = dict(zip(logit_seqs, model(fb), strict=True))
    elif tokens is None:
        tokens = {sid: 50 + sid for sid in logit_seqs}
    s.update(batch, tokens)
    return batch, fb


def entries(batch: ScheduledBatch) -> list[tuple[int, int, int, bool]]:
    return [(e.seq_id, e.start, e.num_tokens, e.needs_logits) for e in batch.entries]


def tiny(**kw) -> SchedulerConfig:
    base = dict(block_size=4, num_blocks=11, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=44)
    base.update(kw)
    return SchedulerConfig(**base)


def check_ownership(s: Scheduler) -> None:
    owned = [b for sid in s.seq_ids() for b in s.seq_block_table(sid)]
    assert len(owned) == len(set(owned)), "a block is owned by two sequences"
    assert len(owned) + s.num_free_blocks == s.config.num_blocks
    bm = s.block_manager
    assert all(bm.blocks[b].ref_count == 1 for b in owned)
    assert set(owned).isdisjoint(bm.free_ids)


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


def test_block_tables_and_slot_mapping() -> None:
    s = Scheduler(tiny())
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


def test_chunked_prefill_under_budget() -> None:
    s = Scheduler(tiny(max_num_batched_tokens=5))
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


def test_decode_first_then_prefill_chunk_shares_budget() -> None:
    s = Scheduler(tiny(max_num_batched_tokens=5))
    s.add(0, [1, 2])
    step(s)
    s.add(1, list(range(8)))  # joins a running batch
    batch, _ = step(s)
    assert entries(batch) == [(0, 2, 1, True), (1, 0, 4, False)]
    batch, _ = step(s)
    assert entries(batch) == [(0, 3, 1, True), (1, 4, 4, True)]
    batch, _ = step(s)
    assert entries(batch) == [(0, 4, 1, True), (1, 8, 1, True)]


def test_max_num_seqs_and_fcfs() -> None:
    s = Scheduler(tiny(max_num_seqs=2))
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


def test_head_of_queue_waiting_for_blocks_is_not_overtaken() -> None:
    s = Scheduler(tiny())
    s.add(0, list(range(36)))  # 9 of 11 blocks
    s.add(1, list(range(9)))  # needs 3 blocks: only 2 free
    s.add(2, [1, 2])  # would fit, but arrived later
    batch, _ = step(s)
    assert [e.seq_id for e in batch.entries] == [0]
    assert s.num_waiting == 2
    s.finish(0)
    batch, _ = step(s)
    assert [e.seq_id for e in batch.entries] == [1, 2]


def test_abort_frees_blocks_everywhere() -> None:
    s = Scheduler(tiny())
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


def test_preemption_recomputes_and_everything_completes() -> None:
    cfg = SchedulerConfig(block_size=4, num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    s, model = Scheduler(cfg), PagedFakeModel(cfg)
    prompts = {0: [3, 1, 4, 1, 5, 9, 2], 1: [2, 7, 1, 8, 2, 8, 1]}
    for sid, p in prompts.items():
        s.add(sid, p)
    batches = []
    done: dict[int, list[int]] = {}
    while s.has_unfinished():
        batch, _ = step(s, model)
        batches.append(entries(batch))
        check_ownership(s)
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


def test_sequence_outgrowing_the_pool_alone_raises() -> None:
    s = Scheduler(SchedulerConfig(block_size=2, num_blocks=2, max_model_len=10))
    s.add(0, [1, 2, 3])
    step(s)
    step(s)
    with pytest.raises(RuntimeError, match="whole pool has 2"):
        s.schedule()


def test_add_rejects() -> None:
    s = Scheduler(tiny(max_model_len=100))
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
        Scheduler(SchedulerConfig(block_size=0))
    with pytest.raises(ValueError, match="unknown sequence"):
        s.finish(7)


def test_update_rejects() -> None:
    s = Scheduler(tiny(max_model_len=3))
    s.add(0, [1, 2])
    batch = s.schedule()
    with pytest.raises(ValueError, match="no next token"):
        s.update(batch, {})
    s2 = Scheduler(tiny(max_model_len=3))
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
@given(workload())
def test_random_streams_complete(case) -> None:
    cfg, reqs, aborts, seed = case
    rng = np.random.default_rng(seed)
    s, model = Scheduler(cfg), PagedFakeModel(cfg)
    prompts = {i: rng.integers(0, 100, size=p).tolist() for i, (_, p, _) in enumerate(reqs)}
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
        check_ownership(s)
        for i in s.seq_ids():
            if len(s.seq_tokens(i)) == len(prompts[i]) + reqs[i][2]:
                results[i] = s.seq_tokens(i)
                s.finish(i)
                check_ownership(s)
    assert s.num_free_blocks == cfg.num_blocks
    for i, (_, _, max_tokens) in enumerate(reqs):
        if i in results:
            assert results[i] == reference_generation(prompts[i], max_tokens)
        else:
            assert i in aborts
