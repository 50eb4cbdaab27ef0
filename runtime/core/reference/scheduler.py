"""The scheduler of the Python twin (twin of runtime/core/_scheduler.c): sequences, the waiting and
running queues, the scheduler step (decode first, chunked prefill, FCFS admission, preemption by
recompute), ForwardBatch packing and the post-step update, on the block pool (block_pool.py) and the
prefix cache (prefix_cache.py). Also the plain data types both implementations share
(SchedulerConfig, BatchEntry, ScheduledBatch, PrefixCacheStats).

Index arithmetic of one sequence in one step (block_size = 4, `start` = tokens already computed,
`n` = this step's chunk, `L` = tokens known so far = prompt + generated):

    position     0   1   2   3   4   5   6   7   8   9   10  11
    token        p0  p1  p2  p3  p4  p5  p6  g0  g1  g2
                 |----- computed -----|  |- new --|      start = 6, n = 3, L = 10
                 [0, start)              [start, start+n)
    block        |- table[0] -|  |- table[1] -|  |- table[2] -|
                 allocated: ceil((start + n) / block_size) = 3 blocks
    slot of position p:  block_table[p // block_size] * block_size + p % block_size

    needs_logits  <=>  start + n == L   (the chunk ends at the last known token; its logits
                                          sample token L). A prefill chunk that stops earlier
                                          produces no logits (here 6 + 3 != 10: none).

After a preemption a sequence's blocks are freed and `computed` drops to 0: its next chunks
recompute prompt + generated tokens (up to L), and only the chunk reaching L needs logits.

Speculative verification (`schedule(drafts)`). A decoding sequence given d proposed tokens runs
them after its last token in one chunk of 1 + d tokens, all needing logits (the engine asks for
every row of the chunk); the proposals are this step's *draft*, not known tokens:

    position     ..  7   8   9   10  11               L = 8 (g0 at 7 sampled, not computed)
    token        ..  g0  x1  x2  x3                   draft = [x1, x2, x3], start = 7, n = 4
    needs_logits  <=>  start + n == L + d

`update(batch, {seq: [x1, t]})` then says the first proposal was accepted and `t` comes next:
the tokens become .. g0 x1 t (L = 10), computed = start + 2 (g0 and x1; the K/V written for x2
and x3 are garbage that the next chunks overwrite), and blocks past ceil(L / block_size) go
back to the pool. Only tokens below the new computed count are ever registered in the prefix
cache, so a rejected proposal never reaches it. A draft never costs a preemption: it is cut to
the step's spare budget (one token is kept for each decoding sequence after it), to the free
blocks beyond one per such sequence, and so that L + d + 1 <= max_model_len.
"""

from __future__ import annotations

import bisect
import logging
import operator
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from runtime.core.reference.common import I64_MAX, M64, is_int
from runtime.core.reference.prefix_cache import BlockManager, PrefixCache
from runtime.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

__all__ = ["BatchEntry", "PrefixCacheStats", "ScheduledBatch", "Scheduler", "SchedulerConfig"]


def _int64(value: object, expected: str, named: str) -> int:
    """An integer in [0, 2**63) as a Python int: TypeError "`expected`, got TYPE" or ValueError "`named` VALUE
    outside [0, 2**63)" otherwise, as the C core's parse_token and parse_seq_id say."""
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{expected}, got {type(value).__name__}") from None
    if v < 0 or v > I64_MAX:
        raise ValueError(f"{named} {v} outside [0, 2**63)")
    return v


def _token(value: object, what: str) -> int:
    """A token id; the errors name `what`."""
    return _int64(value, f"{what}: expected an integer token id", f"{what}: token id")


def _seq_id(value: object) -> int:
    return _int64(value, "sequence id: expected an integer", "sequence id")


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class SchedulerConfig:
    block_size: int = 16
    num_blocks: int = 512  # KV pool size in blocks
    max_num_seqs: int = 16  # running sequences at most
    max_num_batched_tokens: int = 512  # token budget per step (decode tokens + prefill chunks)
    max_model_len: int = 1024  # prompt + output tokens per sequence at most
    enable_prefix_caching: bool = True  # share cached full blocks between requests (see module doc)
    # Fully cached prompt: copy its last block and compute only the last token (True), or compute
    # the whole last block again (False). True only where the engine applies
    # ScheduledBatch.block_copies before each forward; otherwise the copied K/V would be missing.
    enable_copy_on_write: bool = False
    prefix_cache_seed: int | None = None  # key of the block hash, in [0, 2**64); None: random per scheduler

    def validate(self) -> None:
        """Raise ValueError when a limit is not a positive integer or an option has the wrong type."""
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > 2**31 - 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer below 2**31, got {value!r}")
        for name in ("enable_prefix_caching", "enable_copy_on_write"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SchedulerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        seed = self.prefix_cache_seed
        if seed is not None and (not is_int(seed) or not 0 <= seed <= M64):
            raise ValueError(f"SchedulerConfig.prefix_cache_seed must be None or an integer in [0, 2**64), got {seed!r}")


@dataclass(eq=False)
class _Sequence:
    seq_id: int
    arrival: int  # admission order key (FCFS, "newest" for preemption)
    token_ids: list[int]  # prompt + generated
    num_prompt: int
    num_computed: int = 0  # tokens whose K/V are in the cache
    decoding: bool = False  # True once a chunk produced logits (until a preemption)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its first full blocks
    num_registered: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached: int | None = None  # prompt tokens served by the prefix cache at its first admission
    root: int = 0  # parent hash of its first block: 0, or its cache salt (prefix-cache isolation)
    draft: list[int] = field(default_factory=list)  # proposals verified in this step (speculative decoding)

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed


class BatchEntry(NamedTuple):
    seq_id: int
    start: int  # tokens already computed (positions start .. start+num_tokens-1 run now)
    num_tokens: int  # chunk length (>= 1)
    needs_logits: bool  # the chunk ends at the sequence's last known token


@dataclass
class ScheduledBatch:
    # This step's chunks in packing order: decodes, then continuing prefills, then admissions.
    entries: list[BatchEntry]
    # (src, dst) KV block pairs the engine copies, in order, in every layer's K and V pool
    # *before* the forward (copy-on-write of a fully cached prompt's last block).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


class PrefixCacheStats(NamedTuple):
    requests: int  # admissions that looked up the cache (a re-admission after preemption counts)
    queries: int  # tokens looked up (all known tokens of each admitted sequence)
    hits: int  # of which served from the cache (not computed)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class Scheduler:
    """Continuous batching with chunked prefill, FCFS admission, prefix caching and preemption by
    recompute.

    One `schedule()` builds a step under `max_num_batched_tokens`:
      1. every running sequence that is decoding gets 1 token (in order of arrival);
      2. running sequences that are mid-prefill continue with a chunk;
      3. waiting requests are admitted FCFS while fewer than `max_num_seqs` run and budget and
         free blocks allow (skipped in a step that preempted, so a victim does not bounce back);
         an admitted request starts after its longest cached prefix.
    When a decode token finds no free block, the newest running sequence that has not been
    scheduled in this step is preempted (blocks freed, back to the front of the queue).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self._caching = config.enable_prefix_caching
        seed = config.prefix_cache_seed
        self.prefix_cache = PrefixCache(self.block_manager, secrets.randbits(64) if seed is None else int(seed),
                                        config.enable_prefix_caching, config.enable_copy_on_write)
        self._seqs: dict[int, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # sorted by arrival
        self._arrivals = 0
        self.num_preemptions = 0
        self._stats = [0, 0, 0]  # prefix cache: requests, queries, hits

    # ---- introspection ------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def seq_tokens(self, seq_id: int) -> list[int]:
        """Prompt + generated tokens so far (a copy)."""
        return list(self._get(seq_id).token_ids)

    def seq_num_prompt(self, seq_id: int) -> int:
        return self._get(seq_id).num_prompt

    def seq_num_cached(self, seq_id: int) -> int:
        """Prompt tokens served from the prefix cache when the sequence was first admitted (0 before)."""
        return self._get(seq_id).num_cached or 0

    def seq_block_table(self, seq_id: int) -> list[int]:
        """The blocks a sequence holds now (a copy; empty while it waits)."""
        return list(self._get(seq_id).block_table)

    def seq_ids(self) -> list[int]:
        """Every live sequence: running (by arrival) then waiting (queue order)."""
        return [s.seq_id for s in self._running] + [s.seq_id for s in self._waiting]

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the scheduler was made (all zero with prefix caching off)."""
        return PrefixCacheStats(*self._stats)

    def enable_kv_events(self) -> None:
        """Start the KV-cache event log (see `kv_events`); the prefix cache must be empty (RuntimeError
        otherwise: call it before the first step). It opens with a "cleared" record. A second call: no-op."""
        self.prefix_cache.enable_events()

    def kv_events(self) -> bytes:
        """The event records logged since the last call, then forgets them (b"" when off or none): native
        uint64 words, one record per change of the prefix cache in the order it happened:
        [1, hash, parent, has_parent, block_size token ids] a block entered the cache (parent: the previous
        block's hash, 0 and has_parent 0 for a sequence's first block); [2, hash] a cached block was
        evicted; [3] everything was cleared (the log's first record). `decode_kv_events` reads them."""
        return self.prefix_cache.take_events()

    def block_pool_state(self) -> dict[str, list[int]]:
        """The pool, for tests and debugging: ref counts, both free queues in allocation order, and
        the cached blocks as [block, hash] pairs by block id."""
        bm = self.block_manager
        return {
            "ref_counts": [b.ref_count for b in bm.blocks],
            "free": list(bm.free_ids),
            "cached_free": list(bm.cached_free),
            "cached": [[b.block_id, b.hash] for b in bm.blocks if b.hash is not None],
        }

    def _get(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id) if is_int(seq_id) else None
        if seq is None:
            raise ValueError(f"unknown sequence id {seq_id!r}")
        return seq

    # ---- lifecycle ----------------------------------------------------------------------

    def add(self, seq_id: int, prompt_ids: Sequence[int], root: int = 0) -> None:
        """Queue a request (FCFS). `root` (in [0, 2**64)): its first block's parent hash, a cache salt;
        only sequences with the same root share prefix-cache blocks."""
        cfg = self.config
        seq_id = _seq_id(seq_id)
        if seq_id in self._seqs:
            raise ValueError(f"sequence id {seq_id} is already in the scheduler")
        tokens = [_token(t, f"sequence {seq_id}: prompt") for t in prompt_ids]
        if len(tokens) == 0:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        if len(tokens) > cfg.max_model_len:
            raise ValueError(f"sequence {seq_id}: prompt of {len(tokens)} tokens exceeds "
                             f"max_model_len={cfg.max_model_len}")
        need = self.block_manager.blocks_needed(len(tokens))
        if need > cfg.num_blocks:
            raise ValueError(f"sequence {seq_id}: prompt of {len(tokens)} tokens needs {need} KV blocks "
                             f"of {cfg.block_size} tokens; the pool has only {cfg.num_blocks}")
        if not is_int(root) or not 0 <= root < 2**64:
            raise ValueError(f"sequence {seq_id}: root must be an integer in [0, 2**64), got {root!r}")
        seq = _Sequence(seq_id, self._arrivals, tokens, len(tokens), root=root)
        self._arrivals += 1
        self._seqs[seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        """Drop a request wherever it is and free its blocks at once; unknown ids are ignored."""
        seq = self._seqs.get(seq_id) if is_int(seq_id) else None
        if seq is None:
            return
        self._drop(seq)

    def finish(self, seq_id: int) -> None:
        """The engine decided the sequence is done: free its blocks and forget it."""
        self._drop(self._get(seq_id))

    def _drop(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.block_table = []
        del self._seqs[seq.seq_id]

    # ---- one step -----------------------------------------------------------------------

    def schedule(self, drafts: dict[int, Sequence[int]] | None = None) -> ScheduledBatch | None:
        """Pick this step's chunks; None when nothing runs.

        `drafts`: seq id -> proposed tokens (speculative decoding): a decoding sequence named there
        verifies (a prefix of) its proposals in this step (see the module doc); other ids are ignored.
        """
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        entries: list[BatchEntry] = []
        copies: list[tuple[int, int]] = []
        scheduled: set[int] = set()
        preempted = False
        proposals = _check_drafts(drafts)
        for seq in self._running:
            seq.draft = []
        decoders_left = sum(1 for seq in self._running if seq.decoding)

        # 1. decode: one token per decoding sequence (plus its draft), in order of arrival.
        for seq in list(self._running):
            if budget == 0:
                break
            if seq not in self._running or not seq.decoding:
                continue  # preempted earlier in this loop, or still prefilling
            decoders_left -= 1
            need = bm.blocks_needed(seq.num_computed + 1) - len(seq.block_table)
            while not bm.can_allocate(need):
                victim = self._newest_unscheduled(scheduled)
                if victim is seq and len(self._running) == 1:
                    raise RuntimeError(self._too_long_message(seq))
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in self._running:
                continue
            seq.block_table += bm.allocate(need)
            proposal = proposals.get(seq.seq_id) if proposals else None
            if proposal:
                seq.draft = proposal[: self._draft_room(seq, budget - 1 - decoders_left, decoders_left)]
                seq.block_table += bm.allocate(bm.blocks_needed(seq.num_computed + 1 + len(seq.draft))
                                               - len(seq.block_table))
            entries.append(self._entry(seq, 1 + len(seq.draft)))
            scheduled.add(seq.seq_id)
            budget -= 1 + len(seq.draft)

        # 2. running sequences in the middle of their prefill (or recompute) continue.
        for seq in list(self._running):
            if budget == 0:
                break
            if seq not in self._running or seq.decoding or seq.seq_id in scheduled:
                continue
            n = self._fit_chunk(seq, min(seq.num_to_compute, budget))
            while n == 0:
                victim = self._newest_unscheduled(scheduled)
                if victim is seq:
                    if len(self._running) == 1:
                        raise RuntimeError(self._too_long_message(seq))
                    break  # keep its blocks; it continues when decoders free some
                self._preempt(victim)
                preempted = True
                n = self._fit_chunk(seq, min(seq.num_to_compute, budget))
            if n == 0:
                continue
            seq.block_table += bm.allocate(bm.blocks_needed(seq.num_computed + n) - len(seq.block_table))
            entries.append(self._entry(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n

        # 3. admit waiting requests, FCFS, each after its longest cached prefix.
        while (not preempted and budget > 0 and self._waiting
               and len(self._running) < self.config.max_num_seqs):
            seq = self._waiting[0]
            hits, cow_src, cached = self.prefix_cache.lookup(seq)
            n = min(len(seq.token_ids) - cached, budget)
            need = bm.blocks_needed(cached + n) - len(hits)
            reclaimed = sum(1 for b in hits if bm.blocks[b].ref_count == 0)  # hits that are free now
            if need > bm.num_free - reclaimed:
                if not self._running:  # the whole pool is free and still too small
                    raise RuntimeError(self._too_long_message(seq))
                break  # the head of the queue waits for blocks (FCFS: no overtaking)
            self._waiting.popleft()
            bisect.insort(self._running, seq, key=lambda s: s.arrival)
            for b in hits:
                bm.claim(b)
            if cow_src is not None:
                bm.touch(cow_src)
            new = bm.allocate(need)
            seq.block_table = hits + new
            if cow_src is not None and new[0] != cow_src:  # new == [the copy]; an evicted source is the copy
                copies.append((cow_src, new[0]))
            seq.num_computed = cached
            seq.num_registered = len(hits)
            if self._caching:
                self._stats[0] += 1
                self._stats[1] += len(seq.token_ids)
                self._stats[2] += cached
            if seq.num_cached is None:
                seq.num_cached = min(cached, seq.num_prompt)
            entries.append(self._entry(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n

        if not entries:
            return None
        return ScheduledBatch(entries, copies)

    def _draft_room(self, seq: _Sequence, spare: int, reserve: int) -> int:
        """How many proposals a decoding sequence (its next token's block allocated) may verify now: at
        most `spare` tokens of budget, blocks while `reserve` stay free, and L + d + 1 <= max_model_len."""
        bs = self.config.block_size
        blocks = max(0, self.block_manager.num_free - reserve)
        by_blocks = (len(seq.block_table) + blocks) * bs - seq.num_computed - 1
        return max(0, min(spare, by_blocks, self.config.max_model_len - len(seq.token_ids) - 1))

    def _entry(self, seq: _Sequence, n: int) -> BatchEntry:
        known = len(seq.token_ids) + len(seq.draft)
        return BatchEntry(seq.seq_id, seq.num_computed, n, seq.num_computed + n == known)

    def _fit_chunk(self, seq: _Sequence, n: int) -> int:
        """The longest chunk of at most `n` tokens that its blocks plus the free ones can hold."""
        capacity = (len(seq.block_table) + self.block_manager.num_free) * self.config.block_size
        return max(0, min(n, capacity - seq.num_computed))

    def _newest_unscheduled(self, scheduled: set[int]) -> _Sequence:
        for seq in reversed(self._running):
            if seq.seq_id not in scheduled:
                return seq
        raise RuntimeError("no running sequence left to preempt")  # unreachable: the caller is unscheduled

    def _preempt(self, seq: _Sequence) -> None:
        logger.debug("preempting sequence %d (%d tokens, %d blocks)",
                     seq.seq_id, len(seq.token_ids), len(seq.block_table))
        self._running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.decoding = False
        seq.draft = []
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    def _too_long_message(self, seq: _Sequence) -> str:
        cfg = self.config
        return (f"sequence {seq.seq_id} has {len(seq.token_ids)} tokens and needs "
                f"{self.block_manager.blocks_needed(len(seq.token_ids))} KV blocks of {cfg.block_size} "
                f"tokens to continue; the whole pool has {cfg.num_blocks}")

    # ---- packing ------------------------------------------------------------------------

    def _check_entries(self, batch: ScheduledBatch, skip_unknown: bool) -> list[tuple[BatchEntry, _Sequence]]:
        """Validate a batch against the sequences' state (the same checks, in the same order, as C)."""
        cfg = self.config
        out = []
        seen: set[int] = set()
        for e in batch.entries:
            sid = _seq_id(e.seq_id)
            seq = self._seqs.get(sid)
            if seq is None:
                if skip_unknown:
                    continue  # aborted while the model ran
                raise ValueError(f"unknown sequence id {sid}")
            if sid in seen:
                raise ValueError(f"sequence {sid} appears twice in the batch")
            seen.add(sid)
            start, n = operator.index(e.start), operator.index(e.num_tokens)
            known = len(seq.token_ids) + len(seq.draft)
            if (start != seq.num_computed or n < 1 or start + n > known
                    or bool(e.needs_logits) != (start + n == known)):
                raise ValueError(f"stale batch entry for sequence {sid}: start={start}, "
                                 f"num_tokens={n}, computed={seq.num_computed}, known={known}")
            if -(-(start + n) // cfg.block_size) > len(seq.block_table):
                raise ValueError(f"sequence {sid} holds {len(seq.block_table)} blocks; the entry needs "
                                 f"{-(-(start + n) // cfg.block_size)}")
            out.append((e, seq))
        return out

    def pack(self, batch: ScheduledBatch) -> ForwardBatch:
        """The ForwardBatch arrays of a step, entries in the order of `batch.entries`."""
        cfg = self.config
        bs = cfg.block_size
        checked = self._check_entries(batch, skip_unknown=False)
        t = sum(operator.index(e.num_tokens) for e, _ in checked)
        b = len(checked)
        if t > cfg.max_num_batched_tokens or b > cfg.max_num_seqs:
            raise ValueError(f"batch of {b} sequences and {t} tokens exceeds max_num_seqs={cfg.max_num_seqs} "
                             f"or max_num_batched_tokens={cfg.max_num_batched_tokens}")
        needed = [-(-(e.start + e.num_tokens) // bs) for e, _ in checked]
        max_blocks = max(needed, default=0)
        input_ids = np.empty(t, np.int64)
        positions = np.empty(t, np.int64)
        slot_mapping = np.empty(t, np.int64)
        cu_seqlens = np.zeros(b + 1, np.int32)
        past_lens = np.empty(b, np.int32)
        block_table = np.full((b, max_blocks), -1, np.int32)
        logits_index: list[int] = []
        off = 0
        for i, (e, seq) in enumerate(checked):
            lo, hi = e.start, e.start + e.num_tokens
            table = np.asarray(seq.block_table[: needed[i]], np.int64)
            pos = np.arange(lo, hi, dtype=np.int64)
            input_ids[off: off + e.num_tokens] = (seq.token_ids + seq.draft)[lo:hi]
            positions[off: off + e.num_tokens] = pos
            slot_mapping[off: off + e.num_tokens] = table[pos // bs] * bs + pos % bs
            block_table[i, : needed[i]] = table
            past_lens[i] = lo
            off += e.num_tokens
            cu_seqlens[i + 1] = off
            if e.needs_logits:
                logits_index.append(off - 1)
        return ForwardBatch(input_ids, positions, cu_seqlens, past_lens, block_table, slot_mapping,
                            np.asarray(logits_index, np.int64))

    def update(self, batch: ScheduledBatch, next_tokens: dict[int, int | Sequence[int]]) -> None:
        """After the model ran: advance each entry's computed count; append sampled tokens; offer
        newly full blocks to the prefix cache.

        next_tokens[seq_id]: the next token, or a list of tokens: for a sequence that verified a
        draft of d proposals, its first m - 1 accepted proposals then the token after them
        (1 <= m <= d + 1); the rest of the draft is rolled back (module doc). Entries of sequences
        aborted since `schedule()` are skipped. A sequence must be finished by the engine once it
        holds `max_model_len` tokens; appending past that raises RuntimeError.
        Everything is checked before anything changes: on error the scheduler is as before.
        """
        todo: list[tuple[_Sequence, int, list[int]]] = []
        for e, seq in self._check_entries(batch, skip_unknown=True):
            tokens: list[int] = []
            n = operator.index(e.num_tokens)
            if e.needs_logits:
                try:
                    value = next_tokens[seq.seq_id]
                except KeyError:
                    raise ValueError(f"sequence {seq.seq_id} got logits in this step but no next token") from None
                what = f"sequence {seq.seq_id}: next token"
                if isinstance(value, list | tuple):
                    tokens = [_token(t, what) for t in value]
                else:
                    tokens = [_token(value, what)]
                d = len(seq.draft)
                if not 1 <= len(tokens) <= d + 1:
                    raise ValueError(f"sequence {seq.seq_id}: {len(tokens)} next tokens after a draft of {d}; "
                                     f"expected 1 to {d + 1}")
                if tokens[:-1] != seq.draft[: len(tokens) - 1]:
                    raise ValueError(f"sequence {seq.seq_id}: the accepted tokens must be a prefix of its draft")
                if len(seq.token_ids) + len(tokens) > self.config.max_model_len:
                    raise RuntimeError(f"sequence {seq.seq_id} already has max_model_len="
                                       f"{self.config.max_model_len} tokens; the engine must finish it")
                n -= d + 1 - len(tokens)  # the rejected proposals are not computed
            todo.append((seq, n, tokens))
        for seq, n, tokens in todo:
            seq.num_computed += n
            if tokens:
                seq.token_ids += tokens
                seq.decoding = True
            if seq.draft:
                seq.draft = []
                keep = self.block_manager.blocks_needed(len(seq.token_ids))
                if len(seq.block_table) > keep:  # blocks that held only rejected proposals
                    self.block_manager.free(seq.block_table[keep:])
                    del seq.block_table[keep:]
            if self._caching:
                self.prefix_cache.register_full_blocks(seq)



def _check_drafts(drafts: object) -> dict[int, list[int]]:
    """schedule()'s `drafts`, checked whole before anything changes: None or a dict of seq id -> tokens."""
    if drafts is None:
        return {}
    if not isinstance(drafts, dict):
        raise TypeError(f"drafts: expected None or a dict of sequence id -> token ids, got {type(drafts).__name__}")
    out: dict[int, list[int]] = {}
    for key, value in drafts.items():
        sid = _seq_id(key)
        if not isinstance(value, list | tuple):
            raise TypeError(f"drafts[{sid}]: expected a list of token ids, got {type(value).__name__}")
        out[sid] = [_token(t, f"sequence {sid}: draft token") for t in value]
    return out
