"""Speculative verification in the engine core: drafts scheduled as multi-token decode chunks, the
accepted prefix kept and the rest rolled back (KV slots overwritten later, whole blocks freed), in
the C scheduler against its twin and against the fake model run without a scheduler."""

from __future__ import annotations

import random
from collections import Counter
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_c import same_call, same_fb, same_state, stream
from test_core_fixtures import (
    HAVE_C,
    SCHEDULERS,
    CScheduler,
    PagedFakeModel,
    check_pool,
    next_token,
    reference_generation,
    tiny,
)

from runtime.core import reference
from runtime.core.reference import SchedulerConfig
from runtime.forward_batch import ForwardBatch


def verify_rows(model: PagedFakeModel, fb: ForwardBatch, copies) -> list[list[int]]:
    """The fake model's next token after every position of every chunk that needs logits (one list per
    logits entry): row j of a chunk reads the history up to its own position, as causal attention."""
    if copies:
        model.copy([model.pool], copies)
    model.kv[fb.slot_mapping] = fb.input_ids
    out = []
    for idx in fb.logits_index:
        b = int(np.searchsorted(fb.cu_seqlens, idx, side="right")) - 1
        past, n = int(fb.past_lens[b]), int(fb.cu_seqlens[b + 1] - fb.cu_seqlens[b])
        rows = []
        for j in range(n):
            pos = np.arange(past + j + 1)
            history = model.kv[fb.block_table[b, pos // model.bs].astype(np.int64) * model.bs + pos % model.bs]
            assert (history >= 0).all(), "history read from a slot never written"
            rows.append(next_token(history.tolist()))
        out.append(rows)
    return out


def accept(draft: list[int], rows: list[int]) -> list[int]:
    """Greedy verification: the longest prefix of the draft the model agrees with, then its next token."""
    m = 0
    while m < len(draft) and draft[m] == rows[m]:
        m += 1
    return draft[:m] + [rows[m]]


def proposals(rng: random.Random, s, known: dict[int, list[int]]) -> dict[int, list[int]]:
    """Per live sequence, 0-5 tokens: a prefix of the true continuation, then (sometimes) garbage."""
    drafts = {}
    for sid, tokens in known.items():
        k = rng.randint(0, 5)
        good = reference_generation(tokens, k)[len(tokens):]
        cut = rng.randint(0, k)
        drafts[sid] = good[:cut] + [rng.randint(0, 99) for _ in range(k - cut)]
    return drafts


def run_speculative_side_by_side(cfg: SchedulerConfig, reqs: list, seed: int) -> Counter:
    c, p = CScheduler(cfg), reference.Scheduler(cfg)
    mc, mp = PagedFakeModel(cfg), PagedFakeModel(cfg)
    rng = random.Random(seed)
    events: Counter = Counter()
    limits = {i: len(pr) + m for i, (_, pr, m, _, _) in enumerate(reqs)}
    last_arrival = max(r[0] for r in reqs)
    t = 0
    while t <= last_arrival or p.has_unfinished():
        assert t < 3000, "no progress"
        for i, (arrival, prompt, _, abort_at, _) in enumerate(reqs):
            if arrival == t:
                same_call(lambda i=i, pr=prompt: c.add(i, pr), lambda i=i, pr=prompt: p.add(i, pr))
            if abort_at == t:
                c.abort(i)
                p.abort(i)
        t += 1
        drafts = proposals(rng, p, {sid: p.seq_tokens(sid) for sid in p.seq_ids()})
        res, exc = same_call(partial(c.schedule, drafts), partial(p.schedule, drafts))
        if exc is not None:
            same_state(c, p)
            break
        bc, bp = res
        if bp is None:
            assert bc is None
            continue
        assert [tuple(e) for e in bc.entries] == [tuple(e) for e in bp.entries]
        assert bc.block_copies == bp.block_copies
        fc, fp = c.pack(bc), p.pack(bp)
        same_fb(fc, fp)
        fp.validate(cfg.num_blocks, cfg.block_size)
        logit_entries = [e for e in bp.entries if e.needs_logits]
        rows_c, rows_p = verify_rows(mc, fc, bc.block_copies), verify_rows(mp, fp, bp.block_copies)
        assert rows_c == rows_p
        tokens = {}
        for e, rows in zip(logit_entries, rows_p, strict=True):
            known = len(p.seq_tokens(e.seq_id))
            d = e.start + e.num_tokens - known  # proposals run in this chunk
            assert d >= 0 and len(rows) == e.num_tokens
            if d:
                draft = drafts[e.seq_id][:d]
                tokens[e.seq_id] = accept(draft, rows[-d - 1:])
                events["verified"] += 1
                events["accepted"] += len(tokens[e.seq_id]) - 1
                events["rejected"] += d + 1 - len(tokens[e.seq_id])
            else:
                tokens[e.seq_id] = rows[-1]
        same_call(partial(c.update, bc, tokens), partial(p.update, bp, tokens))
        events["steps"] += 1
        for sid in p.seq_ids():
            toks = p.seq_tokens(sid)
            if len(toks) >= min(limits[sid], cfg.max_model_len):
                prompt = reqs[sid][1]
                # the run may go past the request's own limit by the accepted tokens: compare all of it
                assert toks == reference_generation(prompt, len(toks) - len(prompt)), sid
                events["finished_checked"] += 1
                c.finish(sid)
                p.finish(sid)
        same_state(c, p)
        check_pool(p)
    else:
        assert c.num_free_blocks == p.num_free_blocks == cfg.num_blocks
    events["preemptions"] = p.num_preemptions
    return events


@pytest.mark.skipif(not HAVE_C, reason="the C extension is not built")
def test_speculative_schedule_matches_twin_and_oracle() -> None:
    """Random streams with random drafts (partly right): C and the twin make the same batches and state,
    and every finished sequence equals the model's own continuation (the rollback never leaks a
    rejected proposal's K/V into the history, with prefix caching, copy-on-write and preemption)."""
    seen: Counter = Counter()

    @settings(max_examples=120, deadline=None)
    @given(stream(), st.integers(0, 2**32 - 1))
    def check(case, seed: int) -> None:
        ev = run_speculative_side_by_side(*case, seed)
        for k, v in ev.items():
            seen[k] += v
            seen["with_" + k] += v > 0

    check()
    assert seen["verified"] >= 100 and seen["accepted"] >= 50 and seen["rejected"] >= 50, seen
    assert seen["finished_checked"] >= 100, seen  # preemption with drafts: test_speculative.py (engine)


@pytest.mark.parametrize("make", SCHEDULERS)
def test_rejected_proposals_free_their_blocks(make) -> None:
    s = make(tiny(block_size=4, num_blocks=8, max_model_len=40))
    s.add(0, [1, 2, 3])
    batch = s.schedule()
    s.update(batch, {0: 9})  # prompt computed, token 9 sampled: 4 tokens, 1 block
    assert s.seq_block_table(0) == [0]
    batch = s.schedule({0: [5, 6, 7, 8, 9, 10]})
    assert [tuple(e) for e in batch.entries] == [(0, 3, 7, True)]  # g0 + 6 proposals: positions 3..9
    assert len(s.seq_block_table(0)) == 3
    fb = s.pack(batch)
    assert fb.input_ids.tolist() == [9, 5, 6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="prefix of its draft"):
        s.update(batch, {0: [5, 7, 1]})
    with pytest.raises(ValueError, match="expected 1 to 7"):
        s.update(batch, {0: [5, 6, 7, 8, 9, 10, 11, 12]})
    s.update(batch, {0: [5, 42]})  # one accepted, then 42
    assert s.seq_tokens(0) == [1, 2, 3, 9, 5, 42]
    assert len(s.seq_block_table(0)) == 2  # 6 tokens: the third block went back
    check_pool(s)
    batch = s.schedule()  # plain decode again: one token at position 5
    assert [tuple(e) for e in batch.entries] == [(0, 5, 1, True)]


@pytest.mark.parametrize("make", SCHEDULERS)
def test_drafts_never_take_the_last_decoders_budget_or_the_context(make) -> None:
    s = make(tiny(block_size=4, num_blocks=16, max_num_batched_tokens=6, max_model_len=12))
    for sid in (0, 1, 2):
        s.add(sid, [1, 2])
    s.update(s.schedule(), {0: 3, 1: 3, 2: 3})
    batch = s.schedule({0: [7] * 9, 2: [7] * 9})
    # budget 6: seq 0 leaves one token each to 1 and 2 -> 4 tokens; seq 2 gets what is left (1)
    assert [(e.seq_id, e.num_tokens) for e in batch.entries] == [(0, 4), (1, 1), (2, 1)]
    s.update(batch, {0: [7, 7, 7, 1], 1: 1, 2: 1})
    assert len(s.seq_tokens(0)) == 7
    s.finish(1)
    s.finish(2)
    batch = s.schedule({0: [7] * 9})  # max_model_len 12: L 7 + d + 1 <= 12
    assert [(e.seq_id, e.num_tokens) for e in batch.entries] == [(0, 5)]
    with pytest.raises(TypeError, match="drafts"):
        s.schedule([1, 2])  # type: ignore[arg-type]
