"""KV-cache events of the engine core: the C scheduler's log against its twin's, and both against the
block pool's own state.

Hypothesis streams (shared prefixes, repeats, aborts, tight pools: evictions, salted roots) run
through both schedulers with events on; after every step the two logs are byte-identical, and
replaying the log (stored adds a hash, removed drops it, cleared empties) gives exactly the hashes
the pool holds in its prefix cache: every block the core caches was announced and not since
removed, and nothing else. The stored records also carry the block's tokens and its parent's hash
as the pool keeps them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_c import stream
from test_core_fixtures import CScheduler, PagedFakeModel

from runtime.core import _core, decode_kv_events, reference
from runtime.core.reference import KVEvent, SchedulerConfig


def replay(held: dict[int, KVEvent], events: list[KVEvent]) -> None:
    """Apply events to a subscriber's view (hash -> its stored event); a bad transition fails."""
    for ev in events:
        if ev.kind == "cleared":
            held.clear()
        elif ev.kind == "stored":
            assert ev.block_hash not in held, "stored twice without a removal"
            held[ev.block_hash] = ev
        else:
            assert ev.kind == "removed" and ev.block_hash in held, "removed a block never announced"
            del held[ev.block_hash]


def pool_view(p: reference.Scheduler) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """The twin's prefix cache: hash -> (parent hash or None for a first block, tokens)."""
    out = {}
    for b in p.block_manager.blocks:
        if b.hash is not None:
            out[b.hash] = (b.parent, b.tokens)
    return out


def run_with_events(cfg: SchedulerConfig, reqs: list, roots: list[int]) -> Counter:
    c, p = CScheduler(cfg), reference.Scheduler(cfg)
    c.enable_kv_events()
    p.enable_kv_events()
    mc, mp = PagedFakeModel(cfg, copy=_core.copy_blocks), PagedFakeModel(cfg)
    held: dict[int, KVEvent] = {}
    seen: Counter = Counter()
    limits = {i: len(pr) + m for i, (_, pr, m, _, _) in enumerate(reqs)}
    t, last = 0, max(r[0] for r in reqs)
    while t <= last or p.has_unfinished():
        assert t < 3000
        for i, (arrival, prompt, _, abort_at, _) in enumerate(reqs):
            if arrival == t:
                try:
                    p.add(i, prompt, roots[i % len(roots)])
                except ValueError:
                    continue
                c.add(i, prompt, roots[i % len(roots)])
            if abort_at == t:
                c.abort(i)
                p.abort(i)
        t += 1
        try:
            bp = p.schedule()
        except RuntimeError:
            with pytest.raises(RuntimeError):
                c.schedule()
            break
        bc = c.schedule()
        if bp is not None:
            tc = dict(zip([e.seq_id for e in bc.entries if e.needs_logits], mc(c.pack(bc), bc.block_copies),
                          strict=True))
            tp = dict(zip([e.seq_id for e in bp.entries if e.needs_logits], mp(p.pack(bp), bp.block_copies),
                          strict=True))
            c.update(bc, tc)
            p.update(bp, tp)
            for sid in p.seq_ids():
                if len(p.seq_tokens(sid)) >= min(limits[sid], cfg.max_model_len):
                    c.finish(sid)
                    p.finish(sid)
        data_c, data_p = c.kv_events(), p.kv_events()
        assert data_c == data_p
        events = decode_kv_events(data_p, cfg.block_size)
        seen.update(ev.kind for ev in events)
        replay(held, events)
        pool = pool_view(p)
        assert set(held) == set(pool)
        assert {h for _, h in c.block_pool_state()["cached"]} == set(pool)
        for h, ev in held.items():
            parent, tokens = pool[h]
            assert ev.token_ids == tokens
            if ev.parent_hash is not None:
                assert ev.parent_hash == parent
    assert c.kv_events() == p.kv_events() == b""
    return seen


@pytest.mark.skipif(CScheduler is None, reason="the C core is not built")
def test_event_log_matches_twin_and_pool_on_random_streams() -> None:
    totals: Counter = Counter()

    @settings(max_examples=60, deadline=None)
    @given(stream(), st.lists(st.sampled_from([0, 7, 2**63 + 5]), min_size=1, max_size=3))
    def run(case, roots) -> None:
        cfg, reqs = case
        cfg.enable_prefix_caching = True
        totals.update(run_with_events(cfg, reqs, roots))

    run()
    # the streams stored and evicted blocks (a cleared record opens every log)
    assert totals["cleared"] >= 60 and totals["stored"] > 100 and totals["removed"] > 10, totals


@pytest.mark.parametrize("impl", [pytest.param(CScheduler, id="c"), pytest.param(reference.Scheduler, id="python")])
def test_enable_needs_empty_cache_and_off_logs_nothing(impl) -> None:
    if impl is None:
        pytest.skip("the C core is not built")
    cfg = SchedulerConfig(block_size=2, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16,
                          prefix_cache_seed=1)
    s = impl(cfg)
    s.add(0, [1, 2, 3, 4, 5])
    b = s.schedule()
    s.update(b, {0: 6})
    assert s.kv_events() == b""  # off
    with pytest.raises(RuntimeError, match="empty prefix cache"):
        s.enable_kv_events()
    fresh = impl(cfg)
    fresh.enable_kv_events()
    fresh.enable_kv_events()  # no-op: one cleared record
    fresh.add(0, [1, 2, 3, 4, 5])
    b = fresh.schedule()
    fresh.update(b, {0: 6})
    evs = decode_kv_events(fresh.kv_events(), 2)
    assert [e.kind for e in evs] == ["cleared", "stored", "stored"]
    assert evs[1].parent_hash is None and evs[1].token_ids == (1, 2)
    assert evs[2].parent_hash == evs[1].block_hash and evs[2].token_ids == (3, 4)
    with pytest.raises(ValueError, match="malformed"):
        decode_kv_events(b"\x09" + b"\x00" * 7, 2)
