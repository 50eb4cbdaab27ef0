"""Pure-Python engine core: block manager, scheduler step, ForwardBatch packing, KV scatter.

This is the reference "twin" of the C extension (`runtime/core/_core.c`): plain, slow, obviously
correct, and the oracle the C code is tested against. The engine can run on it directly
(`OPTIMIZE_CORE=python`).

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
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from runtime.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

__all__ = [
    "Block",
    "BlockManager",
    "BatchEntry",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "scatter_kv",
    "scatter_kv_layers",
]


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

    def validate(self) -> None:
        """Raise ValueError when a limit is not a positive integer."""
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------------------------
# Block manager
# --------------------------------------------------------------------------------------------


@dataclass
class Block:
    block_id: int
    ref_count: int = 0


class BlockManager:
    """A fixed pool of KV blocks: a free deque and a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the free deque (ref_count 1 each)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self.free_ids):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.blocks[i].ref_count = 1
        return ids

    def incref(self, block_id: int) -> None:
        """Share a block (prefix caching / copy-on-write keep it alive for another owner)."""
        block = self.blocks[block_id]
        if block.ref_count < 1:
            raise RuntimeError(f"block {block_id} is free; it cannot be shared")
        block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks whose count reaches 0 return to the free deque."""
        for i in reversed(block_ids):
            block = self.blocks[i]
            if block.ref_count < 1:
                raise RuntimeError(f"block {i} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids.append(i)


# --------------------------------------------------------------------------------------------
# Scheduler
# --------------------------------------------------------------------------------------------


@dataclass
class _Sequence:
    seq_id: int
    arrival: int  # admission order key (FCFS, "newest" for preemption)
    token_ids: list[int]  # prompt + generated
    num_prompt: int
    num_computed: int = 0  # tokens whose K/V are in the cache
    decoding: bool = False  # True once a chunk produced logits (until a preemption)
    block_table: list[int] = field(default_factory=list)

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclass
class BatchEntry:
    seq_id: int
    start: int  # tokens already computed (positions start .. start+num_tokens-1 run now)
    num_tokens: int  # chunk length
    needs_logits: bool  # the chunk ends at the sequence's last known token


@dataclass
class ScheduledBatch:
    entries: list[BatchEntry]

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


class Scheduler:
    """Continuous batching with chunked prefill, FCFS admission and preemption by recompute.

    One `schedule()` builds a step under `max_num_batched_tokens`:
      1. every running sequence that is decoding gets 1 token (in order of arrival);
      2. running sequences that are mid-prefill continue with a chunk;
      3. waiting requests are admitted FCFS while fewer than `max_num_seqs` run and budget and
         free blocks allow (skipped in a step that preempted, so a victim does not bounce back).
    When a decode token finds no free block, the newest running sequence that has not been
    scheduled in this step is preempted (blocks freed, back to the front of the queue).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self._seqs: dict[int, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # sorted by arrival
        self._arrivals = 0
        self.num_preemptions = 0

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
        return bool(self._waiting or self._running)

    def seq_tokens(self, seq_id: int) -> list[int]:
        """Prompt + generated tokens so far (a copy)."""
        return list(self._get(seq_id).token_ids)

    def seq_num_prompt(self, seq_id: int) -> int:
        return self._get(seq_id).num_prompt

    def seq_block_table(self, seq_id: int) -> list[int]:
        """The blocks a sequence holds now (a copy; empty while it waits)."""
        return list(self._get(seq_id).block_table)

    def seq_ids(self) -> list[int]:
        """Every live sequence: running (by arrival) then waiting (queue order)."""
        return [s.seq_id for s in self._running] + [s.seq_id for s in self._waiting]

    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence id {seq_id}") from None

    # ---- lifecycle ----------------------------------------------------------------------

    def add(self, seq_id: int, prompt_ids: list[int]) -> None:
        """Queue a request (FCFS)."""
        cfg = self.config
        if seq_id in self._seqs:
            raise ValueError(f"sequence id {seq_id} is already in the scheduler")
        if len(prompt_ids) == 0:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        if len(prompt_ids) > cfg.max_model_len:
            raise ValueError(f"sequence {seq_id}: prompt of {len(prompt_ids)} tokens exceeds "
                             f"max_model_len={cfg.max_model_len}")
        need = self.block_manager.blocks_needed(len(prompt_ids))
        if need > cfg.num_blocks:
            raise ValueError(f"sequence {seq_id}: prompt of {len(prompt_ids)} tokens needs {need} KV blocks "
                             f"of {cfg.block_size} tokens; the pool has only {cfg.num_blocks}")
        seq = _Sequence(seq_id, self._arrivals, [int(t) for t in prompt_ids], len(prompt_ids))
        self._arrivals += 1
        self._seqs[seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        """Drop a request wherever it is and free its blocks at once; unknown ids are ignored."""
        seq = self._seqs.get(seq_id)
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

    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's chunks; None when nothing runs."""
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        entries: list[BatchEntry] = []
        scheduled: set[int] = set()
        preempted = False

        # 1. decode: one token per decoding sequence, in order of arrival.
        for seq in list(self._running):
            if budget == 0:
                break
            if seq not in self._running or not seq.decoding:
                continue  # preempted earlier in this loop, or still prefilling
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
            entries.append(self._entry(seq, 1))
            scheduled.add(seq.seq_id)
            budget -= 1

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

        # 3. admit waiting requests, FCFS.
        while (not preempted and budget > 0 and self._waiting
               and len(self._running) < self.config.max_num_seqs):
            seq = self._waiting[0]
            n = min(seq.num_to_compute, budget)
            need = bm.blocks_needed(seq.num_computed + n) - len(seq.block_table)
            if not bm.can_allocate(need):
                if not self._running:  # the whole pool is free and still too small
                    raise RuntimeError(self._too_long_message(seq))
                break  # the head of the queue waits for blocks (FCFS: no overtaking)
            self._waiting.popleft()
            bisect.insort(self._running, seq, key=lambda s: s.arrival)
            seq.block_table += bm.allocate(need)
            entries.append(self._entry(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n

        if not entries:
            return None
        return ScheduledBatch(entries)

    def _entry(self, seq: _Sequence, n: int) -> BatchEntry:
        return BatchEntry(seq.seq_id, seq.num_computed, n, seq.num_computed + n == len(seq.token_ids))

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
        seq.decoding = False
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    def _too_long_message(self, seq: _Sequence) -> str:
        cfg = self.config
        return (f"sequence {seq.seq_id} has {len(seq.token_ids)} tokens and needs "
                f"{self.block_manager.blocks_needed(len(seq.token_ids))} KV blocks of {cfg.block_size} "
                f"tokens to continue; the whole pool has {cfg.num_blocks}")

    # ---- packing ------------------------------------------------------------------------

    def pack(self, batch: ScheduledBatch) -> ForwardBatch:
        """The ForwardBatch arrays of a step, entries in the order of `batch.entries`."""
        bs = self.config.block_size
        seqs = [self._get(e.seq_id) for e in batch.entries]
        for e, seq in zip(batch.entries, seqs, strict=True):
            if e.start != seq.num_computed or e.start + e.num_tokens > len(seq.token_ids):
                raise ValueError(f"stale batch entry for sequence {e.seq_id}: start={e.start}, "
                                 f"num_tokens={e.num_tokens}, computed={seq.num_computed}, "
                                 f"known={len(seq.token_ids)}")
        b = len(seqs)
        t = batch.num_tokens
        needed = [-(-(e.start + e.num_tokens) // bs) for e in batch.entries]
        max_blocks = max(needed, default=0)
        input_ids = np.empty(t, np.int64)
        positions = np.empty(t, np.int64)
        slot_mapping = np.empty(t, np.int64)
        cu_seqlens = np.zeros(b + 1, np.int32)
        past_lens = np.empty(b, np.int32)
        block_table = np.full((b, max_blocks), -1, np.int32)
        logits_index: list[int] = []
        off = 0
        for i, (e, seq) in enumerate(zip(batch.entries, seqs, strict=True)):
            lo, hi = e.start, e.start + e.num_tokens
            table = np.asarray(seq.block_table[: needed[i]], np.int64)
            pos = np.arange(lo, hi, dtype=np.int64)
            input_ids[off: off + e.num_tokens] = seq.token_ids[lo:hi]
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

    def update(self, batch: ScheduledBatch, next_tokens: dict[int, int]) -> None:
        """After the model ran: advance each entry's computed count; append sampled tokens.

        Entries of sequences aborted since `schedule()` are skipped. A sequence must be finished by
        the engine once it holds `max_model_len` tokens; appending past that raises RuntimeError.
        """
        for e in batch.entries:
            seq = self._seqs.get(e.seq_id)
            if seq is None:
                continue  # aborted while the model ran
            if e.start != seq.num_computed:
                raise ValueError(f"stale batch entry for sequence {e.seq_id}: start={e.start}, "
                                 f"computed={seq.num_computed}")
            seq.num_computed += e.num_tokens
            if not e.needs_logits:
                continue
            if e.seq_id not in next_tokens:
                raise ValueError(f"sequence {e.seq_id} got logits in this step but no next token")
            if len(seq.token_ids) >= self.config.max_model_len:
                raise RuntimeError(f"sequence {e.seq_id} already has max_model_len="
                                   f"{self.config.max_model_len} tokens; the engine must finish it")
            seq.token_ids.append(int(next_tokens[e.seq_id]))
            seq.decoding = True


# --------------------------------------------------------------------------------------------
# KV scatter (twin of _core.scatter_kv / _core.scatter_kv_layers)
# --------------------------------------------------------------------------------------------

_KINDS = {"f": "float", "i": "int", "u": "uint", "b": "bool"}


def _as_array(obj: object, name: str) -> np.ndarray:
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected an object with the buffer protocol, got {type(obj).__name__}") from None
    return obj if isinstance(obj, np.ndarray) else np.asarray(obj)


def _check_slots(slots: np.ndarray) -> None:
    if slots.ndim != 1:
        raise ValueError(f"slot_mapping: expected 1 dimension [T], got {slots.ndim}")
    if slots.dtype.kind != "i" or slots.dtype.itemsize != 8 or not slots.dtype.isnative:
        raise TypeError(f"slot_mapping: expected int64, got {slots.dtype}")
    if not slots.flags.c_contiguous:
        raise ValueError("slot_mapping: must be C-contiguous")


def _check_layer(pool: np.ndarray, new: np.ndarray, slots: np.ndarray) -> None:
    """The same checks, in the same order, as check_layer() in _core.c."""
    if pool.ndim != 4:
        raise ValueError(f"pool: expected 4 dimensions [num_blocks, block_size, kv_heads, head_dim], got {pool.ndim}")
    if new.ndim != 3:
        raise ValueError(f"new: expected 3 dimensions [T, kv_heads, head_dim], got {new.ndim}")
    if pool.dtype.kind not in _KINDS or not pool.dtype.isnative:
        raise TypeError(f"pool: unsupported element type {pool.dtype}")
    if (new.dtype.kind, new.dtype.itemsize, new.dtype.isnative) != (pool.dtype.kind, pool.dtype.itemsize, True):
        raise TypeError(f"new: dtype {new.dtype} does not match pool dtype {pool.dtype}")
    if new.shape[1:] != pool.shape[2:]:
        raise ValueError(f"new: shape {list(new.shape)} does not match pool's [kv_heads, head_dim] = "
                         f"{list(pool.shape[2:])}")
    if slots.shape[0] != new.shape[0]:
        raise ValueError(f"slot_mapping: length {slots.shape[0]} != new's T={new.shape[0]}")
    if not pool.flags.c_contiguous:
        raise ValueError("pool: must be C-contiguous")
    if not new.flags.c_contiguous:
        raise ValueError("new: must be C-contiguous")
    if not pool.flags.writeable:
        raise ValueError("pool: buffer is read-only")
    num_slots = pool.shape[0] * pool.shape[1]
    bad = np.flatnonzero((slots < 0) | (slots >= num_slots))
    if bad.size:
        raise ValueError(f"slot_mapping: slot {int(slots[bad[0]])} (token {int(bad[0])}) outside the pool's "
                         f"[0, {num_slots})")


def scatter_kv(pool: np.ndarray, new: np.ndarray, slot_mapping: np.ndarray) -> None:
    """pool[num_blocks, block_size, H, D] flat slot slot_mapping[t] <- new[t]; validates everything."""
    s = _as_array(slot_mapping, "slot_mapping")
    _check_slots(s)
    p, n = _as_array(pool, "pool"), _as_array(new, "new")
    _check_layer(p, n, s)
    p.reshape(-1, *p.shape[2:])[s] = n


def scatter_kv_layers(pools: list[np.ndarray], news: list[np.ndarray], slot_mapping: np.ndarray) -> None:
    """scatter_kv for every layer; validates all layers before writing any."""
    pools, news = list(pools), list(news)
    if len(pools) != len(news):
        raise ValueError(f"pools and news: {len(pools)} pools but {len(news)} new tensors")
    s = _as_array(slot_mapping, "slot_mapping")
    _check_slots(s)
    arrays = []
    for i, (pool, new) in enumerate(zip(pools, news, strict=True)):
        try:
            p, n = _as_array(pool, "pool"), _as_array(new, "new")
            _check_layer(p, n, s)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"layer {i}: {exc}") from None
        arrays.append((p, n))
    for p, n in arrays:
        p.reshape(-1, *p.shape[2:])[s] = n
