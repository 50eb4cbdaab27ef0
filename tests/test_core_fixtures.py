"""Shared helpers of the engine-core tests (test_core_*.py, test_prefix_cache.py); no tests here.

A fake paged "model" drives the scheduler: it writes each step's input ids into a token-id KV
pool through `slot_mapping` (after applying the step's copy-on-write block copies) and, for every
logits row, reads the sequence's whole history back through `block_table`, so wrong block tables,
slots, shared blocks or copies change the generated tokens. The next token is a hash of that
history (no neural network is mocked; this only exercises the core).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from runtime.core import reference
from runtime.core.reference import ScheduledBatch, SchedulerConfig
from runtime.forward_batch import ForwardBatch

try:
    from runtime.core import _core
    from runtime.core._cwrap import Scheduler as CScheduler

    HAVE_C = True
except ImportError:  # the C scheduler is not built: only the twin runs
    _core = None  # type: ignore[assignment]
    CScheduler = None  # type: ignore[assignment,misc]
    HAVE_C = False

SCHEDULERS = [pytest.param(reference.Scheduler, id="python")]
if HAVE_C:
    SCHEDULERS.insert(0, pytest.param(CScheduler, id="c"))


class hash_bits:  # noqa: N801 - used as a context manager, like a function
    """Block hashes of the schedulers created inside narrowed to `bits` bits, in both cores (the
    test-only hook `set_hash_bits_for_tests`), so that distinct blocks collide."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def __enter__(self) -> int:
        self.saved = (reference.set_hash_bits_for_tests(self.bits),
                      _core.set_hash_bits_for_tests(self.bits) if HAVE_C else None)
        return self.bits

    def __exit__(self, *exc: object) -> None:
        reference.set_hash_bits_for_tests(self.saved[0])
        if HAVE_C:
            _core.set_hash_bits_for_tests(self.saved[1])


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
    """Token ids as the KV cache: copy blocks, scatter by slot_mapping, gather the history by block_table."""

    def __init__(self, cfg: SchedulerConfig, copy=reference.copy_blocks) -> None:
        self.bs = cfg.block_size
        self.pool = np.full((cfg.num_blocks, cfg.block_size, 1, 1), -1, np.int64)
        self.kv = self.pool.reshape(-1)
        self.copy = copy

    def __call__(self, fb: ForwardBatch, copies: list[tuple[int, int]] = ()) -> list[int]:  # type: ignore[assignment]
        if copies:
            self.copy([self.pool], copies)
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


def step(s, model: PagedFakeModel | None = None,
         tokens: dict[int, int] | None = None) -> tuple[ScheduledBatch, ForwardBatch]:
    """schedule + pack + validate + (fake) model + update."""
    batch = s.schedule()
    assert batch is not None
    fb = s.pack(batch)
    fb.validate(s.config.num_blocks, s.config.block_size)
    logit_seqs = [e.seq_id for e in batch.entries if e.needs_logits]
    if model is not None:
        tokens = dict(zip(logit_seqs, model(fb, batch.block_copies), strict=True))
    elif tokens is None:
        tokens = {sid: 50 + sid for sid in logit_seqs}
    s.update(batch, tokens)
    return batch, fb


def entries(batch: ScheduledBatch) -> list[tuple[int, int, int, bool]]:
    return [(e.seq_id, e.start, e.num_tokens, e.needs_logits) for e in batch.entries]


def tiny(**kw) -> SchedulerConfig:
    base = dict(block_size=4, num_blocks=11, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=44,
                prefix_cache_seed=0, enable_copy_on_write=True)
    base.update(kw)
    return SchedulerConfig(**base)


def check_pool(s) -> None:
    """Reference counts equal table memberships; free queues hold exactly the unreferenced blocks."""
    st = s.block_pool_state()
    refs = Counter()
    for sid in s.seq_ids():
        table = s.seq_block_table(sid)
        assert len(table) == len(set(table)), f"sequence {sid} holds a block twice: {table}"
        refs.update(table)
    assert st["ref_counts"] == [refs.get(b, 0) for b in range(s.config.num_blocks)]
    free, cached_free = st["free"], st["cached_free"]
    assert len(free) + len(cached_free) == len(set(free) | set(cached_free)) == s.num_free_blocks
    assert set(free) | set(cached_free) == {b for b in range(s.config.num_blocks) if b not in refs}
    cached = {b for b, _ in st["cached"]}
    assert set(cached_free) <= cached and not set(free) & cached
    if not s.config.enable_prefix_caching:
        assert not cached
