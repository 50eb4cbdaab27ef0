"""The prefix cache of the Python twin (twin of runtime/core/_prefix_cache.c): chained block hashes,
the hash -> block map on top of the block pool, the longest cached prefix of a waiting sequence,
registration of computed full blocks, and the KV-cache event log.

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

Block tables stay append-only: shared blocks are full and never written again. A cached block that
nobody holds waits in the pool's cached free queue until the pool evicts it (block_pool.py).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from runtime.core.reference.block_pool import BlockPool
from runtime.core.reference.common import GOLDEN, M64, is_int, mix64

__all__ = [
    "BlockManager",
    "CachedSequence",
    "KVEvent",
    "PrefixCache",
    "block_hash",
    "decode_kv_events",
    "hash_key",
    "set_hash_bits_for_tests",
]

# --------------------------------------------------------------------------------------------
# Block hash (twin of core_mix64 / block_hash in _core.h and _prefix_cache.c)
# --------------------------------------------------------------------------------------------


def hash_key(seed: int) -> int:
    """The per-scheduler key mixed into every block hash."""
    return mix64((seed + GOLDEN) & M64)


_hash_bits = 64  # block-hash width of schedulers created from now on (set_hash_bits_for_tests)


def set_hash_bits_for_tests(bits: int) -> int:
    """Narrow the block hashes of schedulers created from now on to their low `bits` bits (64: the
    production width) so that distinct blocks collide and the collision path runs; returns the
    previous width. Twin of `_core.set_hash_bits_for_tests` (every chained hash, parents included,
    is masked). Tests only."""
    global _hash_bits
    if not is_int(bits) or not 1 <= bits <= 64:
        raise ValueError(f"hash bits must be in [1, 64], got {bits!r}")
    previous, _hash_bits = _hash_bits, int(bits)
    return previous


def block_hash(parent: int, tokens: Sequence[int], key: int) -> int:
    """Chained hash of one full block: parent is the previous block's hash (0 for the first)."""
    h = parent ^ key
    for t in tokens:
        h = mix64(((h ^ (t & M64)) + GOLDEN) & M64)
    return h


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


# --------------------------------------------------------------------------------------------
# The cache map on the pool
# --------------------------------------------------------------------------------------------


class BlockManager(BlockPool):
    """A fixed pool of KV blocks with reference counts and a prefix cache.

    The pool (`free_ids`, `cached_free`: see BlockPool) plus `hash_to_block`: the cache, one block
    per hash, and `events`: the KV-cache event log while it is on.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.hash_to_block: dict[int, int] = {}
        self.events: list[int] | None = None  # the KV-cache event log (Scheduler.enable_kv_events), uint64 words

    def lookup(self, h: int, parent: int, tokens: Sequence[int]) -> int | None:
        """The cached block with hash `h`, parent hash and tokens, or None."""
        i = self.hash_to_block.get(h)
        if i is None:
            return None
        block = self.blocks[i]
        if block.parent != parent or block.tokens != tuple(tokens):
            return None  # a hash collision: a miss, never somebody else's K/V
        return i

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
        h = self.blocks[block_id].hash
        if self.events is not None:
            self.events += (_EV_REMOVED, h)  # type: ignore[arg-type]
        del self.hash_to_block[h]  # type: ignore[arg-type]
        super()._uncache(block_id)


# --------------------------------------------------------------------------------------------
# A scheduler's sequences in the cache
# --------------------------------------------------------------------------------------------


class CachedSequence(Protocol):
    """What the prefix cache reads and updates of a scheduler's sequence."""

    token_ids: list[int]  # known tokens
    block_table: list[int]
    block_hashes: list[int]  # chained hashes of its first full blocks (memo)
    num_computed: int
    num_registered: int  # leading blocks of block_table already offered to the cache
    root: int  # parent hash of its first block


class PrefixCache:
    """One scheduler's prefix cache: its hash key and width, lookups for the sequences it admits, the
    registration of the blocks they computed, and the event log (on `block_manager`)."""

    def __init__(self, block_manager: BlockManager, seed: int, enabled: bool, copy_on_write: bool) -> None:
        self.block_manager = block_manager
        self.enabled = enabled
        self.copy_on_write = copy_on_write
        self.key = hash_key(seed)
        self.mask = (1 << _hash_bits) - 1

    def lookup(self, seq: CachedSequence) -> tuple[list[int], int | None, int]:
        """(hit blocks, copy-on-write source or None, cached tokens) for a waiting sequence; no effects.

        The longest run of leading full blocks found in the cache. The last known token is never
        served from the cache: when the hits cover every known token, the last hit is dropped; with
        copy-on-write it becomes the source of the copy and only the last token runs (block_size > 1;
        with block_size 1 there is nothing to copy), without, its whole block runs again.
        """
        if not self.enabled:
            return [], None, 0
        bs = self.block_manager.block_size
        tokens = seq.token_ids
        hits: list[int] = []
        parent = seq.root
        for j in range(len(tokens) // bs):
            h = self.block_hash(seq, j)
            b = self.block_manager.lookup(h, parent, tokens[j * bs: (j + 1) * bs])
            if b is None:
                break
            hits.append(b)
            parent = h
        if len(hits) * bs < len(tokens):
            return hits, None, len(hits) * bs
        last = hits.pop()
        if self.copy_on_write and bs > 1:
            return hits, last, len(tokens) - 1
        return hits, None, len(hits) * bs

    def block_hash(self, seq: CachedSequence, j: int) -> int:
        """Hash of the sequence's full block j (its tokens must be known); memoised on the sequence."""
        bs = self.block_manager.block_size
        hashes = seq.block_hashes
        while len(hashes) <= j:
            k = len(hashes)
            hashes.append(block_hash(hashes[k - 1] if k else seq.root, seq.token_ids[k * bs: (k + 1) * bs],
                                     self.key) & self.mask)
        return hashes[j]

    def register_full_blocks(self, seq: CachedSequence) -> None:
        """Offer the sequence's newly full, computed blocks to the prefix cache."""
        bm = self.block_manager
        bs = bm.block_size
        full = seq.num_computed // bs
        for j in range(seq.num_registered, full):
            h = self.block_hash(seq, j)
            parent = seq.block_hashes[j - 1] if j else seq.root
            tokens = seq.token_ids[j * bs: (j + 1) * bs]
            if bm.cache(seq.block_table[j], h, parent, tokens) and bm.events is not None:
                bm.events += (_EV_STORED, h, parent if j else 0, 1 if j else 0, *tokens)
        seq.num_registered = max(seq.num_registered, full)

    def enable_events(self) -> None:
        """Scheduler.enable_kv_events."""
        bm = self.block_manager
        if bm.events is not None:
            return
        if bm.hash_to_block:
            raise RuntimeError("enable_kv_events() needs an empty prefix cache: call it before the first step")
        bm.events = [_EV_CLEARED]

    def take_events(self) -> bytes:
        """Scheduler.kv_events."""
        bm = self.block_manager
        if not bm.events:
            return b""
        out = array.array("Q", bm.events).tobytes()
        bm.events = []
        return out
