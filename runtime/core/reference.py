"""Pure-Python engine core: block manager with prefix caching, scheduler step, ForwardBatch packing,
KV scatter/copy, and sampling.

This is the reference "twin" of the C extension (`runtime/core/_core.c`, `_scheduler.c`,
`_sampler.c`): plain, slow, obviously correct, and the oracle the C code is tested against. Both
make the same decisions (same block ids, same eviction order, same hash function, same random
numbers, bit-identical sampling arithmetic). The engine can run on it directly
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

Prefix caching. A block is *cached* once it is full and its K/V are computed (registered in
`update()`, after the model ran, never before: the graph reads past K/V from the pool, so a
block being written in this very step must not be offered to another sequence). Its key is a
chained hash: hash(block j) = H(hash(block j-1), its block_size token ids), H keyed by
`SchedulerConfig.prefix_cache_seed`; a hit also compares the stored parent hash and tokens, so a
hash collision is a miss, never a wrong KV. When a request is admitted, its longest cached
prefix of full blocks is shared (ref_count + 1, no compute, no budget):

    block_size 4, L = 11, blocks with the hashes of [a b c d] and [e f g h] are cached as 7, 2:

    position     0   1   2   3   4   5   6   7   8   9   10
    token        a   b   c   d   e   f   g   h   x   y   z
    table        |-- 7 (hit) --| |-- 2 (hit) --| |-- new --|
                 |------ cached: num_computed = 8 -------| |- chunk: 3 tokens -|

The last known token always runs (its logits are needed). When every full block hits and L is a
multiple of block_size, the last block cannot be shared. With `enable_copy_on_write` it is copied
(copy-on-write): a fresh block `d` joins the table, `ScheduledBatch.block_copies` gets
(cached block, d) — the engine copies the K/V before the forward — and only the last token is
computed. Without, the last block is computed again in a fresh block:

    L = 8, both blocks cached as 7, 2:   table = [7, d], block_copies = [(2, d)], num_computed = 7
                                         (no copy-on-write: table = [7, d], num_computed = 4)

Block tables stay append-only: shared blocks are full and never written again. Free blocks live
in two queues: never-cached ("fresh") ones are allocated first, FIFO; free blocks that are still
cached are evicted only when no fresh block is left, least recently used first (a sequence's
blocks are freed last-block-first, so its tail is evicted before its head).
"""

from __future__ import annotations

import array
import bisect
import logging
import math
import operator
import secrets
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from runtime.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

__all__ = [
    "Block",
    "BlockManager",
    "BatchEntry",
    "PrefixCacheStats",
    "RNG",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "KVEvent",
    "block_hash",
    "copy_blocks",
    "decode_kv_events",
    "make_rng",
    "sample",
    "sample_probs",
    "scatter_kv",
    "scatter_kv_layers",
]

_M64 = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _token(value: object, what: str) -> int:
    """A token id as a Python int in [0, 2**63); TypeError/ValueError naming `what` otherwise."""
    try:
        t = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what}: expected an integer token id, got {type(value).__name__}") from None
    if t < 0 or t > _I64_MAX:
        raise ValueError(f"{what}: token id {t} outside [0, 2**63)")
    return t


def _seq_id(value: object) -> int:
    try:
        s = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"sequence id: expected an integer, got {type(value).__name__}") from None
    if s < 0 or s > _I64_MAX:
        raise ValueError(f"sequence id {s} outside [0, 2**63)")
    return s


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
        if seed is not None and (not _is_int(seed) or not 0 <= seed <= _M64):
            raise ValueError(f"SchedulerConfig.prefix_cache_seed must be None or an integer in [0, 2**64), got {seed!r}")


# --------------------------------------------------------------------------------------------
# Block hash (twin of mix64 / block_hash in _scheduler.c)
# --------------------------------------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hash_key(seed: int) -> int:
    """The per-scheduler key mixed into every block hash."""
    return _mix64((seed + _GOLDEN) & _M64)


_hash_bits = 64  # block-hash width of schedulers created from now on (set_hash_bits_for_tests)


def set_hash_bits_for_tests(bits: int) -> int:
    """Narrow the block hashes of schedulers created from now on to their low `bits` bits (64: the
    production width) so that distinct blocks collide and the collision path runs; returns the
    previous width. Twin of `_core.set_hash_bits_for_tests` (every chained hash, parents included,
    is masked). Tests only."""
    global _hash_bits
    if not _is_int(bits) or not 1 <= bits <= 64:
        raise ValueError(f"hash bits must be in [1, 64], got {bits!r}")
    previous, _hash_bits = _hash_bits, int(bits)
    return previous


def block_hash(parent: int, tokens: Sequence[int], key: int) -> int:
    """Chained hash of one full block: parent is the previous block's hash (0 for the first)."""
    h = parent ^ key
    for t in tokens:
        h = _mix64(((h ^ (t & _M64)) + _GOLDEN) & _M64)
    return h


# --------------------------------------------------------------------------------------------
# Block manager
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is in the prefix cache
    parent: int = 0  # the previous block's hash (checked on a hit)
    tokens: tuple[int, ...] = ()  # its token ids (checked on a hit)


class BlockManager:
    """A fixed pool of KV blocks with reference counts and a prefix cache.

    `free_ids`: free blocks that are not cached, allocated first (FIFO). `cached_free`: free
    blocks that are still cached, least recently used first; evicted only when `free_ids` is
    empty. `hash_to_block`: the cache, one block per hash.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.events: list[int] | None = None  # the KV-cache event log (Scheduler.enable_kv_events), uint64 words

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now: fresh ones plus cached ones nobody references."""
        return len(self.free_ids) + len(self.cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (ref_count 1 each): fresh ones first, then evict cached ones, LRU first."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: asked for {n}, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self.free_ids:
                i = self.free_ids.popleft()
            else:
                i, _ = self.cached_free.popitem(last=False)
                self._uncache(i)
            self.blocks[i].ref_count = 1
            ids.append(i)
        return ids

    def incref(self, block_id: int) -> None:
        """Share a block that is in use."""
        block = self.blocks[block_id]
        if block.ref_count < 1:
            raise RuntimeError(f"block {block_id} is free; it cannot be shared")
        block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, last first; a block whose count reaches 0 goes to the
        tail of `cached_free` when it is cached, else to the tail of `free_ids`."""
        for i in reversed(block_ids):
            block = self.blocks[i]
            if block.ref_count < 1:
                raise RuntimeError(f"block {i} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached_free[i] = None
                else:
                    self.free_ids.append(i)

    # ---- prefix cache ---------------------------------------------------------------------

    def lookup(self, h: int, parent: int, tokens: Sequence[int]) -> int | None:
        """The cached block with hash `h`, parent hash and tokens, or None."""
        i = self.hash_to_block.get(h)
        if i is None:
            return None
        block = self.blocks[i]
        if block.parent != parent or block.tokens != tuple(tokens):
            return None  # a hash collision: a miss, never somebody else's K/V
        return i

    def claim(self, block_id: int) -> None:
        """Take a reference to a cached block (a prefix-cache hit); it leaves `cached_free`."""
        block = self.blocks[block_id]
        if block.hash is None:
            raise RuntimeError(f"block {block_id} is not cached")
        if block.ref_count == 0:
            del self.cached_free[block_id]
        block.ref_count += 1

    def touch(self, block_id: int) -> None:
        """Mark a free cached block as just used (moves it to the MRU end of `cached_free`)."""
        if block_id in self.cached_free:
            self.cached_free.move_to_end(block_id)

    def cache(self, block_id: int, h: int, parent: int, tokens: Sequence[int]) -> bool:
        """Register a full, computed block under hash `h`; False when `h` is already cached."""
        block = self.blocks[block_id]
        if block.hash is not None or block.ref_count < 1:
            raise RuntimeError(f"block {block_id} cannot be cached (hash {block.hash}, ref_count {block.ref_count})")
        if h in self.hash_to_block:
            return False
        block.hash, block.parent, block.tokens = h, parent, tuple(tokens)
        self.hash_to_block[h] = block_id
        return True

    def _uncache(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if self.events is not None:
            self.events += (_EV_REMOVED, block.hash)  # type: ignore[arg-type]
        del self.hash_to_block[block.hash]  # type: ignore[arg-type]
        block.hash, block.parent, block.tokens = None, 0, ()


# --------------------------------------------------------------------------------------------
# Scheduler
# --------------------------------------------------------------------------------------------


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
        self._hash_key = hash_key(secrets.randbits(64) if seed is None else int(seed))
        self._hash_mask = (1 << _hash_bits) - 1
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
        bm = self.block_manager
        if bm.events is not None:
            return
        if bm.hash_to_block:
            raise RuntimeError("enable_kv_events() needs an empty prefix cache: call it before the first step")
        bm.events = [_EV_CLEARED]

    def kv_events(self) -> bytes:
        """The event records logged since the last call, then forgets them (b"" when off or none): native
        uint64 words, one record per change of the prefix cache in the order it happened:
        [1, hash, parent, has_parent, block_size token ids] a block entered the cache (parent: the previous
        block's hash, 0 and has_parent 0 for a sequence's first block); [2, hash] a cached block was
        evicted; [3] everything was cleared (the log's first record). `decode_kv_events` reads them."""
        bm = self.block_manager
        if not bm.events:
            return b""
        out = array.array("Q", bm.events).tobytes()
        bm.events = []
        return out

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
        seq = self._seqs.get(seq_id) if _is_int(seq_id) else None
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
        if not _is_int(root) or not 0 <= root < 2**64:
            raise ValueError(f"sequence {seq_id}: root must be an integer in [0, 2**64), got {root!r}")
        seq = _Sequence(seq_id, self._arrivals, tokens, len(tokens), root=root)
        self._arrivals += 1
        self._seqs[seq_id] = seq
        self._waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        """Drop a request wherever it is and free its blocks at once; unknown ids are ignored."""
        seq = self._seqs.get(seq_id) if _is_int(seq_id) else None
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
            hits, cow_src, cached = self._cache_lookup(seq)
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

    def _cache_lookup(self, seq: _Sequence) -> tuple[list[int], int | None, int]:
        """(hit blocks, copy-on-write source or None, cached tokens) for a waiting sequence; no effects.

        The longest run of leading full blocks found in the cache. The last known token is never
        served from the cache: when the hits cover every known token, the last hit is dropped; with
        copy-on-write it becomes the source of the copy and only the last token runs (block_size > 1;
        with block_size 1 there is nothing to copy), without, its whole block runs again.
        """
        if not self._caching:
            return [], None, 0
        bs = self.config.block_size
        tokens = seq.token_ids
        hits: list[int] = []
        parent = seq.root
        for j in range(len(tokens) // bs):
            h = self._block_hash(seq, j)
            b = self.block_manager.lookup(h, parent, tokens[j * bs: (j + 1) * bs])
            if b is None:
                break
            hits.append(b)
            parent = h
        if len(hits) * bs < len(tokens):
            return hits, None, len(hits) * bs
        last = hits.pop()
        if self.config.enable_copy_on_write and bs > 1:
            return hits, last, len(tokens) - 1
        return hits, None, len(hits) * bs

    def _block_hash(self, seq: _Sequence, j: int) -> int:
        """Hash of the sequence's full block j (its tokens must be known); memoised on the sequence."""
        bs = self.config.block_size
        hashes = seq.block_hashes
        while len(hashes) <= j:
            k = len(hashes)
            hashes.append(block_hash(hashes[k - 1] if k else seq.root, seq.token_ids[k * bs: (k + 1) * bs],
                                     self._hash_key) & self._hash_mask)
        return hashes[j]

    def _register_full_blocks(self, seq: _Sequence) -> None:
        """Offer the sequence's newly full, computed blocks to the prefix cache."""
        bs = self.config.block_size
        full = seq.num_computed // bs
        for j in range(seq.num_registered, full):
            h = self._block_hash(seq, j)
            parent = seq.block_hashes[j - 1] if j else seq.root
            tokens = seq.token_ids[j * bs: (j + 1) * bs]
            if self.block_manager.cache(seq.block_table[j], h, parent, tokens) and self.block_manager.events is not None:
                self.block_manager.events += (_EV_STORED, h, parent if j else 0, 1 if j else 0, *tokens)
        seq.num_registered = max(seq.num_registered, full)

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
                self._register_full_blocks(seq)


# --------------------------------------------------------------------------------------------
# KV-cache event records (Scheduler.kv_events, both implementations)
# --------------------------------------------------------------------------------------------

_EV_STORED, _EV_REMOVED, _EV_CLEARED = 1, 2, 3


class KVEvent(NamedTuple):
    kind: str  # "stored" | "removed" | "cleared"
    block_hash: int = 0  # stored, removed
    parent_hash: int | None = None  # stored: the previous block's hash; None for a sequence's first block
    token_ids: tuple[int, ...] = ()  # stored: the block's block_size token ids


def decode_kv_events(data: bytes, block_size: int) -> list[KVEvent]:
    """The records of `Scheduler.kv_events()` as KVEvents; ValueError on a malformed log."""
    words = array.array("Q")
    words.frombytes(data)
    out: list[KVEvent] = []
    i, n = 0, len(words)
    while i < n:
        kind = words[i]
        if kind == _EV_STORED and i + 4 + block_size <= n:
            out.append(KVEvent("stored", words[i + 1], words[i + 2] if words[i + 3] else None,
                               tuple(words[i + 4: i + 4 + block_size])))
            i += 4 + block_size
        elif kind == _EV_REMOVED and i + 2 <= n:
            out.append(KVEvent("removed", words[i + 1]))
            i += 2
        elif kind == _EV_CLEARED:
            out.append(KVEvent("cleared"))
            i += 1
        else:
            raise ValueError(f"malformed KV event log at word {i} of {n} (kind {kind})")
    return out


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


# --------------------------------------------------------------------------------------------
# Random numbers (twin of the xoshiro256** generator in _sampler.c)
# --------------------------------------------------------------------------------------------


def _rotl(x: int, k: int) -> int:
    return ((x << k) | (x >> (64 - k))) & _M64


class RNG:
    """A request's random stream: xoshiro256** over `state`, a uint64[4] array.

    The C sampler reads and advances `state` in place through the buffer protocol, the Python
    twin does the same arithmetic on Python ints, so a seed gives the same draws in both.
    One non-greedy sampled token consumes exactly one draw.
    """

    __slots__ = ("state",)

    def __init__(self, state: np.ndarray) -> None:
        state = np.asarray(state)
        if state.dtype != np.uint64 or state.shape != (4,) or not state.flags.c_contiguous:
            raise ValueError(f"RNG state: expected a C-contiguous uint64[4] array, got {state.dtype}{list(state.shape)}")
        if not state.any():
            raise ValueError("RNG state: all zero (xoshiro256** would only return zeros)")
        self.state = state

    def next_u64(self) -> int:
        s0, s1, s2, s3 = (int(v) for v in self.state)
        result = (_rotl((s1 * 5) & _M64, 7) * 9) & _M64
        t = (s1 << 17) & _M64
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        s3 = _rotl(s3, 45)
        self.state[:] = (s0, s1, s2, s3)
        return result

    def random(self) -> float:
        """The next double in [0, 1): the top 53 bits of a draw."""
        return (self.next_u64() >> 11) * 2.0**-53

    def __repr__(self) -> str:
        return f"RNG(state=[{', '.join(hex(int(v)) for v in self.state)}])"


def make_rng(seed: int | None) -> RNG:
    """A generator seeded through splitmix64 (a seed wider than 64 bits is folded by XOR of its
    64-bit words); fresh entropy for None."""
    if seed is None:
        seed = secrets.randbits(64)
    seed = operator.index(seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    s = 0
    while True:
        s ^= seed & _M64
        seed >>= 64
        if not seed:
            break
    words = []
    for _ in range(4):
        s = (s + _GOLDEN) & _M64
        words.append(_mix64(s))
    return RNG(np.array(words, dtype=np.uint64))


# --------------------------------------------------------------------------------------------
# Sampling (twin of _sampler.c)
# --------------------------------------------------------------------------------------------
#
# Every step is an IEEE-754 basic operation (+ - * /, comparisons) in a fixed order, so numpy here
# and C there give the same bits: exp is our own (below); sums are "lane sums" (8 interleaved
# sequential sums, then the 8 in order: vectorizable in C, np.cumsum here, never the pairwise
# np.sum); the only libm call is one log per logprobs row (math.log here, log() there: the same
# libm). Per row:
#
#   x = float64(logits)                                    NaN -> ValueError
#   penalties (only tokens in the history change):
#     repetition r, tokens in prompt + output:  x = x / r if x > 0 else x * r
#     frequency f, presence p, tokens in output (count c):  x = x - f * c;  x = x - p
#   token mask (a packed int32 row, bit i % 32 of word i / 32 = token i allowed; all ones = none):
#     x = -inf on disallowed tokens; no allowed finite x -> ValueError
#   greedy (temperature 0): argmax x, first maximum on ties; the RNG is not touched
#   s = x / temperature;  m = max s (not finite -> ValueError)
#   top-k (0 < k < V):  keep s >= k-th largest s (ties with it are kept)
#   e = exp_neg(s - m) on kept tokens, 0 elsewhere
#   top-p (< 1):  rank kept tokens by (e desc, id asc); keep a token while the sequential sum of
#                 e before it (in rank order) is < top_p * lane_sum(e)
#   min-p (> 0):  keep e >= min_p * max e
#   draw:  u = rng.random();  token = first id whose sequential cumulative e (id order) exceeds
#          u * lane_sum(e) (the last kept id if rounding leaves none)
#   logprobs (raw logits, before penalties and temperature):
#     logprob = (x - max x) - log(lane_sum(exp_neg(x - max x))); top-N by (x desc, id asc)

_EXP_C = [float.fromhex(h) for h in (
    "0x1.0p+0", "0x1.0p+0", "0x1.0p-1", "0x1.5555555555555p-3", "0x1.5555555555555p-5",
    "0x1.1111111111111p-7", "0x1.6c16c16c16c17p-10", "0x1.a01a01a01a01ap-13", "0x1.a01a01a01a01ap-16",
    "0x1.71de3a556c734p-19", "0x1.27e4fb7789f5cp-22", "0x1.ae64567f544e4p-26", "0x1.1eed8eff8d898p-29",
    "0x1.6124613a86d09p-33",
)]  # 1/n!, n = 0..13
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
_EXP_MIN = -708.0  # below: 0 (exp(-708) ~ 3e-308, the normal range's edge)


_MAGIC = float.fromhex("0x1.8p52")  # 1.5 * 2**52: adding it rounds |y| < 2**51 to an integer (ties to even)
_MAGIC_BITS = int(np.array(_MAGIC).view(np.int64))


def exp_neg(x: np.ndarray) -> np.ndarray:
    """exp(x) for x <= 0 (float64), bit-identical to exp_neg() in _sampler.c.

    Cody-Waite reduction x = k ln2 + r (|r| <= ln2/2; k rounded with the 1.5 * 2**52 trick), a
    degree-13 Taylor polynomial of e^r by Estrin's scheme (truncation < 1e-17), times 2^k from k's
    bits; x < -708 (and -inf) gives 0. Within 2 ulp of the true exp; what matters here is that it
    is the same in C and numpy (basic IEEE operations only, so it vectorizes in C as well).
    """
    x = np.asarray(x, dtype=np.float64)
    ok = x >= _EXP_MIN
    xs = np.where(ok, x, 0.0)
    t = xs * _INV_LN2 + _MAGIC
    k = t - _MAGIC
    r = (xs - k * _LN2_HI) - k * _LN2_LO
    c = _EXP_C  # Estrin's scheme, the same tree as C
    r2 = r * r
    r4 = r2 * r2
    r8 = r4 * r4
    q0 = (c[0] + c[1] * r) + (c[2] + c[3] * r) * r2
    q1 = (c[4] + c[5] * r) + (c[6] + c[7] * r) * r2
    q2 = (c[8] + c[9] * r) + (c[10] + c[11] * r) * r2
    q3 = c[12] + c[13] * r
    p = (q0 + q1 * r4) + (q2 + q3 * r4) * r8
    scale = ((t.view(np.int64) - _MAGIC_BITS + 1023) << 52).view(np.float64)
    return np.where(ok, p * scale, 0.0)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class _RowParams(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int  # -1: none

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _row_params(p: object, i: int) -> _RowParams:
    """Read and check one row's SamplingParams (the same checks, in the same order, as C)."""
    vals: dict[str, float] = {}
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logprobs"):
        if not hasattr(p, name):
            raise TypeError(f"params[{i}]: expected SamplingParams, {type(p).__name__} has no '{name}'")
        v = getattr(p, name)
        if name in ("top_k", "logprobs"):
            if name == "logprobs" and v is None:
                vals[name] = -1
                continue
            if not _is_int(v) or isinstance(v, bool):
                raise TypeError(f"params[{i}].{name}: expected an integer, got {type(v).__name__}")
            v = int(v)
            if v < 0 or v > 2**31 - 1:
                raise ValueError(f"params[{i}].{name} must be in [0, 2**31), got {v}")
        else:
            if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
                raise TypeError(f"params[{i}].{name}: expected a number, got {type(v).__name__}")
            v = float(v)
            if not math.isfinite(v):
                raise ValueError(f"params[{i}].{name} must be finite, got {v}")
        vals[name] = v
    rp = _RowParams(**vals)  # type: ignore[arg-type]
    if rp.temperature < 0:
        raise ValueError(f"params[{i}].temperature must be >= 0, got {rp.temperature}")
    if not 0.0 < rp.top_p <= 1.0:
        raise ValueError(f"params[{i}].top_p must be in (0, 1], got {rp.top_p}")
    if not 0.0 <= rp.min_p <= 1.0:
        raise ValueError(f"params[{i}].min_p must be in [0, 1], got {rp.min_p}")
    if rp.repetition_penalty <= 0.0:
        raise ValueError(f"params[{i}].repetition_penalty must be > 0, got {rp.repetition_penalty}")
    return rp


def _history(seqs: Sequence[object] | None, i: int, name: str, vocab: int) -> np.ndarray | None:
    if seqs is None:
        return None
    h = seqs[i]
    if h is None:
        return None
    try:
        arr = np.asarray(h)
    except Exception:  # noqa: BLE001 - ragged or odd objects
        raise TypeError(f"{name}[{i}]: expected a sequence of token ids") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(f"{name}[{i}]: expected a 1-D sequence of integer token ids")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab))
    if bad.size:
        raise ValueError(f"{name}[{i}]: token id {int(arr[bad[0]])} outside the vocabulary [0, {vocab})")
    return arr.astype(np.int64)


def _rng_state(rng: object, i: int) -> np.ndarray:
    state = getattr(rng, "state", None)
    if (not isinstance(state, np.ndarray) or state.dtype != np.uint64 or state.shape != (4,)
            or not state.flags.c_contiguous or not state.flags.writeable):
        raise TypeError(f"generators[{i}]: expected an RNG from make_generator (a writable uint64[4] state)")
    if not state.any():
        raise ValueError(f"generators[{i}]: RNG state is all zero")
    return state


def _penalized(row: np.ndarray, rp: _RowParams, prompt: np.ndarray | None, output: np.ndarray | None) -> np.ndarray:
    x = row.astype(np.float64)
    if not rp.penalized:
        return x
    if rp.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([prompt, output]))  # type: ignore[list-item]
        v = x[seen]
        x[seen] = np.where(v > 0, v / rp.repetition_penalty, v * rp.repetition_penalty)
    if output is not None and output.size and (rp.frequency_penalty != 0.0 or rp.presence_penalty != 0.0):
        uo, cnt = np.unique(output, return_counts=True)
        if rp.frequency_penalty != 0.0:
            x[uo] = x[uo] - rp.frequency_penalty * cnt.astype(np.float64)
        if rp.presence_penalty != 0.0:
            x[uo] = x[uo] - rp.presence_penalty
    return x


def _check_masks(masks: object, name: str, rows: int | None, vocab: int) -> np.ndarray | None:
    """A token-mask buffer: int32 words, C-contiguous, [rows, ceil(vocab / 32)] (rows None: one row
    [ceil(vocab / 32)]); the same checks and messages as C."""
    if masks is None:
        return None
    m = _as_array(masks, name)
    if m.dtype.kind != "i" or m.dtype.itemsize != 4 or not m.dtype.isnative:
        raise TypeError(f"{name}: expected int32 words, got format '{m.dtype.char}' with itemsize {m.dtype.itemsize}")
    words = (vocab + 31) // 32
    if m.shape != ((words,) if rows is None else (rows, words)):
        shown = "[" if rows is None else "[rows of logits, "
        raise ValueError(f"{name}: expected shape {shown}{words} words (ceil(vocab / 32) for a vocabulary of {vocab})")
    if not m.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return m


def unpack_mask(words: np.ndarray, vocab: int) -> np.ndarray | None:
    """bool [vocab] from one packed mask row (bit i % 32 of word i / 32 = token i allowed); None when the
    row is all ones (it constrains nothing)."""
    w = words.view(np.uint32)
    if (w == 0xFFFFFFFF).all():
        return None
    bits = (w[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:vocab].astype(bool)


def _masked(x: np.ndarray, allowed: np.ndarray | None, i: int) -> np.ndarray:
    """x with -inf on the tokens the mask disallows; ValueError when no allowed token is finite."""
    if allowed is None:
        return x
    x = np.where(allowed, x, -np.inf)
    if x.max() == -np.inf:
        raise ValueError(f"logits row {i}: its token mask allows no token with a finite logit")
    return x


def _lane_sum(e: np.ndarray) -> float:
    """Sum in 8 interleaved lanes (lane j: e[j], e[j+8], ... sequentially), then the lanes in order:
    lane_sum() in _sampler.c, whose 8 accumulators vectorize where one sequential sum cannot."""
    lanes = np.cumsum(np.concatenate([e, np.zeros(-e.shape[0] % 8)]).reshape(-1, 8), axis=0)[-1]
    return float(np.cumsum(lanes)[-1])


def _kept_weights(x: np.ndarray, rp: _RowParams, i: int, allowed: np.ndarray | None = None) -> np.ndarray:
    """Unnormalised weights e after temperature, the token mask, top-k, top-p, min-p (0 = dropped)."""
    v = x.shape[0]
    s = x / rp.temperature
    if allowed is not None:  # after the division, as C does (-inf / t = -inf: the same weights either way)
        s = np.where(allowed, s, -np.inf)
        if s.max() == -np.inf:
            raise ValueError(f"logits row {i}: its token mask allows no token with a finite logit")
    m = s.max()
    if not math.isfinite(m):
        raise ValueError(f"logits row {i} has no finite maximum (all -inf, or +inf)")
    if 0 < rp.top_k < v:
        kth = np.partition(s, v - rp.top_k)[v - rp.top_k]
        keep = s >= kth
        e = np.where(keep, exp_neg(np.where(keep, s - m, 0.0)), 0.0)
    else:
        e = exp_neg(s - m)
    if rp.top_p < 1.0:
        threshold = rp.top_p * _lane_sum(e)
        order = np.lexsort((np.arange(v), -e))
        ranked = e[order]
        before = np.concatenate(([0.0], np.cumsum(ranked)[:-1]))
        e[order[before >= threshold]] = 0.0
    if rp.min_p > 0.0:
        e[e < rp.min_p * e.max()] = 0.0
    return e


def _draw(e: np.ndarray, u: float) -> int:
    cdf = np.cumsum(e)
    idx = int(np.searchsorted(cdf, u * _lane_sum(e), side="right"))
    return min(idx, int(np.flatnonzero(e)[-1]))


def _logprobs(row: np.ndarray, token: int, n: int, i: int) -> tuple[float, np.ndarray, np.ndarray]:
    x = row.astype(np.float64)
    m = x.max()
    if not math.isfinite(m):
        raise ValueError(f"logits row {i} has no finite maximum (all -inf, or +inf)")
    d = x - m
    lse = math.log(_lane_sum(exp_neg(d)))
    lp = d - lse
    top = np.lexsort((np.arange(x.shape[0]), -x))[:n]
    return float(lp[token]), top.astype(np.int64), lp[top]


def _check_logits(logits: object) -> np.ndarray:
    a = _as_array(logits, "logits")
    if a.ndim != 2:
        raise ValueError(f"logits: expected 2 dimensions [B, vocab], got {a.ndim}")
    if a.dtype not in (np.float32, np.float64) or not a.dtype.isnative:
        raise TypeError(f"logits: expected float32 or float64, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError("logits: must be C-contiguous")
    if a.shape[1] < 1:
        raise ValueError("logits: vocabulary of size 0")
    return a


def _check_out(arr: object, name: str, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    a = _as_array(arr, name)
    if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError(f"{name}: expected a writable C-contiguous {np.dtype(dtype).name}{list(shape)}, "
                         f"got {'read-only ' if not a.flags.writeable else ''}{a.dtype}{list(a.shape)}")
    return a


def _check_len(seq: object, name: str, b: int, optional: bool) -> Sequence[object] | None:
    if seq is None and optional:
        return None
    try:
        n = len(seq)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of {b} items, got {type(seq).__name__}") from None
    if n != b:
        raise ValueError(f"{name}: {n} items for {b} logits rows")
    return seq  # type: ignore[return-value]


def sample(logits: np.ndarray, params: Sequence[object], rngs: Sequence[object],
           prompt_ids: Sequence[object] | None, output_ids: Sequence[object] | None,
           tokens_out: np.ndarray,
           logprobs_out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
           masks: np.ndarray | None = None) -> None:
    """Sample one token per row of logits [B, V] into tokens_out (int64 [B]); twin of _core.sample.

    params[i]: SamplingParams-like; rngs[i]: an RNG (None allowed for greedy rows);
    prompt_ids / output_ids: None, or per row None or a sequence of token ids (needed by rows
    with penalties); logprobs_out: None or (chosen float64[B], top_ids int64[B, N],
    top_logprobs float64[B, N]) filled for rows whose params.logprobs is not None (needs <= N);
    without it params.logprobs is ignored. masks: None or int32 [B, ceil(V / 32)], a packed token mask
    per row (bit i % 32 of word i / 32 = token i allowed; a row of all ones constrains nothing),
    applied after the penalties and before greedy / temperature and the rest; logprobs stay raw.
    Every input is checked before any row is computed, and RNG states and outputs are written
    only when every row succeeded: on error nothing changed.
    """
    a = _check_logits(logits)
    b, vocab = a.shape
    params = _check_len(params, "params", b, False)  # type: ignore[assignment]
    rngs = _check_len(rngs, "generators", b, False)  # type: ignore[assignment]
    prompt_ids = _check_len(prompt_ids, "prompt_ids", b, True)
    output_ids = _check_len(output_ids, "output_ids", b, True)
    tok = _check_out(tokens_out, "tokens_out", np.int64, (b,))
    lp_outs = None
    width = 0
    if logprobs_out is not None:
        if not isinstance(logprobs_out, tuple | list) or len(logprobs_out) != 3:
            raise TypeError("logprobs_out: expected None or (chosen, top_ids, top_logprobs)")
        chosen = _check_out(logprobs_out[0], "logprobs_out[0]", np.float64, (b,))
        top_ids = _as_array(logprobs_out[1], "logprobs_out[1]")
        if top_ids.ndim != 2:
            raise ValueError("logprobs_out[1]: expected 2 dimensions [B, N]")
        width = top_ids.shape[1]
        top_ids = _check_out(top_ids, "logprobs_out[1]", np.int64, (b, width))
        top_lp = _check_out(logprobs_out[2], "logprobs_out[2]", np.float64, (b, width))
        lp_outs = (chosen, top_ids, top_lp)
    mask_rows = _check_masks(masks, "masks", b, vocab)
    rows = []
    for i in range(b):
        rp = _row_params(params[i], i)  # type: ignore[index]
        state = None
        if rp.temperature != 0.0:
            state = _rng_state(rngs[i], i)  # type: ignore[index]
        prompt = _history(prompt_ids, i, "prompt_ids", vocab)
        output = _history(output_ids, i, "output_ids", vocab)
        if rp.penalized and (prompt is None or output is None):
            raise ValueError(f"params[{i}]: penalties need the row's prompt_ids and output_ids")
        if rp.logprobs > width and lp_outs is not None:
            raise ValueError(f"params[{i}].logprobs={rp.logprobs} exceeds logprobs_out's width {width}")
        if rp.logprobs > vocab and lp_outs is not None:
            raise ValueError(f"params[{i}].logprobs={rp.logprobs} exceeds the vocabulary size {vocab}")
        rows.append((rp, state, prompt, output))
    tokens = np.empty(b, np.int64)
    states: list[tuple[int, np.ndarray, RNG] | None] = []
    lps = []
    for i, (rp, state, prompt, output) in enumerate(rows):
        row = a[i]
        if np.isnan(row).any():
            raise ValueError(f"logits row {i} contains NaN")
        x = _penalized(row, rp, prompt, output)
        allowed = None if mask_rows is None else unpack_mask(mask_rows[i], vocab)
        if rp.temperature == 0.0:
            tokens[i] = int(np.argmax(_masked(x, allowed, i)))
            states.append(None)
        else:
            e = _kept_weights(x, rp, i, allowed)
            rng = RNG(state.copy())  # type: ignore[union-attr]
            tokens[i] = _draw(e, rng.random())
            states.append((i, state, rng))  # type: ignore[arg-type]
        want = rp.logprobs >= 0 and lp_outs is not None
        lps.append(_logprobs(row, int(tokens[i]), rp.logprobs, i) if want else None)
    for st in states:
        if st is not None:
            st[1][:] = st[2].state
    tok[:] = tokens
    if lp_outs is not None:
        for i, lp in enumerate(lps):
            if lp is not None:
                n = rows[i][0].logprobs
                lp_outs[0][i] = lp[0]
                lp_outs[1][i, :n] = lp[1]
                lp_outs[2][i, :n] = lp[2]


def sample_probs(row: np.ndarray, params: object, prompt_ids: Sequence[int] | None,
                 output_ids: Sequence[int] | None, out: np.ndarray, mask: np.ndarray | None = None) -> None:
    """The distribution one row is drawn from, into out (float64 [V]); twin of _core.sample_probs.

    Greedy rows get a one-hot distribution on the argmax. mask: None or one packed row (int32
    [ceil(V / 32)]) as in `sample`.
    """
    a = _as_array(row, "logits")
    if a.ndim != 1:
        raise ValueError(f"logits: expected 1 dimension [vocab], got {a.ndim}")
    a = _check_logits(a.reshape(1, -1))
    vocab = a.shape[1]
    dst = _check_out(out, "out", np.float64, (vocab,))
    rp = _row_params(params, 0)
    prompt = _history([prompt_ids], 0, "prompt_ids", vocab)
    output = _history([output_ids], 0, "output_ids", vocab)
    if rp.penalized and (prompt is None or output is None):
        raise ValueError("params[0]: penalties need the row's prompt_ids and output_ids")
    words = _check_masks(mask, "mask", None, vocab)
    allowed = None if words is None else unpack_mask(words, vocab)
    if np.isnan(a[0]).any():
        raise ValueError("logits row 0 contains NaN")
    x = _penalized(a[0], rp, prompt, output)
    if rp.temperature == 0.0:
        best = int(np.argmax(_masked(x, allowed, 0)))
        dst[:] = 0.0
        dst[best] = 1.0
        return
    e = _kept_weights(x, rp, 0, allowed)
    dst[:] = e / _lane_sum(e)


# --------------------------------------------------------------------------------------------
# KV block copy (twin of _core.copy_blocks)
# --------------------------------------------------------------------------------------------


def _pairs(pairs: object) -> np.ndarray:
    try:
        arr = np.asarray(pairs)
    except Exception:  # noqa: BLE001
        raise TypeError("pairs: expected (src, dst) pairs of block ids") from None
    if arr.size == 0:
        return np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.dtype.kind not in "iu":
        raise TypeError(f"pairs: expected (src, dst) pairs of integer block ids, got {arr.dtype}{list(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _I64_MAX:
        raise ValueError("pairs: block id out of range")
    return arr.astype(np.int64)


def copy_blocks(pools: Sequence[np.ndarray], pairs: object) -> None:
    """For each (src, dst) in order, pool[dst] = pool[src] in every pool (all layers' K and V).

    pools: 4-D [num_blocks, block_size, kv_heads, head_dim] writable C-contiguous buffers;
    pairs: int array [P, 2] or a sequence of (src, dst). Everything is validated first.
    """
    try:
        pools = list(pools)
    except TypeError:
        raise TypeError(f"pools: expected a sequence of pool buffers, got {type(pools).__name__}") from None
    p = _pairs(pairs)
    arrays = []
    for i, pool in enumerate(pools):
        a = _as_array(pool, f"pools[{i}]")
        if a.ndim != 4:
            raise ValueError(f"pools[{i}]: expected 4 dimensions [num_blocks, block_size, kv_heads, head_dim], "
                             f"got {a.ndim}")
        if a.dtype.kind not in _KINDS or not a.dtype.isnative:
            raise TypeError(f"pools[{i}]: unsupported element type {a.dtype}")
        if not a.flags.c_contiguous:
            raise ValueError(f"pools[{i}]: must be C-contiguous")
        if not a.flags.writeable:
            raise ValueError(f"pools[{i}]: buffer is read-only")
        bad = np.flatnonzero((p < 0) | (p >= a.shape[0]))
        if bad.size:
            raise ValueError(f"pairs: block id {int(p.reshape(-1)[bad[0]])} (pair {int(bad[0]) // 2}) outside "
                             f"pools[{i}]'s [0, {a.shape[0]})")
        arrays.append(a)
    for a in arrays:
        for src, dst in p.tolist():
            if src != dst:
                a[dst] = a[src]


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
