"""The KV block pool of the Python twin (twin of runtime/core/_block_pool.c): a fixed pool of blocks
with reference counts and two free queues.

Free blocks live in two queues: never-cached ("fresh") ones are allocated first, FIFO; free blocks that
are still in the prefix cache are evicted only when no fresh block is left, least recently used first (a
sequence's blocks are freed last-block-first, so its tail is evicted before its head). The prefix cache
(prefix_cache.BlockManager) builds on this pool: it puts blocks in the cache and forgets the ones the
pool evicts (`_uncache`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

__all__ = ["Block", "BlockPool"]


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is in the prefix cache
    parent: int = 0  # the previous block's hash (checked on a hit)
    tokens: tuple[int, ...] = ()  # its token ids (checked on a hit)


class BlockPool:
    """A fixed pool of KV blocks with reference counts.

    `free_ids`: free blocks that are not cached, allocated first (FIFO). `cached_free`: free
    blocks that are still cached, least recently used first; evicted only when `free_ids` is
    empty.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()

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

    def _uncache(self, block_id: int) -> None:
        """A cached block is evicted: it forgets its hash (the prefix cache also drops its entry)."""
        block = self.blocks[block_id]
        block.hash, block.parent, block.tokens = None, 0, ()
