"""The ForwardBatch contract: one engine step, any mix of prefill chunks and decode tokens.

Every backend takes a ForwardBatch and returns logits [len(logits_index), vocab] (float32).
Tokens are packed without padding, sequence after sequence. The KV cache is a per-layer pool
[num_blocks, block_size, kv_heads, head_dim] owned by the runtime; `slot_mapping` says where
each token's K/V goes (block_id * block_size + offset in block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class ForwardBatch:
    input_ids: np.ndarray  # int64 [T]   all tokens of this step, sequence after sequence
    positions: np.ndarray  # int64 [T]   absolute position of each token in its sequence
    cu_seqlens: np.ndarray  # int32 [B+1] cumulative query lengths; sequence b owns tokens cu[b]:cu[b+1]
    past_lens: np.ndarray  # int32 [B]   tokens of sequence b already in the KV cache
    block_table: np.ndarray  # int32 [B, max_blocks] cache blocks of each sequence, -1 = unused
    slot_mapping: np.ndarray  # int64 [T]  block_id * block_size + offset where token t's K/V goes
    logits_index: np.ndarray  # int64 [B'] which of the T tokens need logits (sampling positions)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.past_lens.shape[0])

    def validate(self, num_blocks: int, block_size: int, vocab_size: int | None = None) -> None:
        """Raise ValueError when the arrays break the contract (shapes, dtypes, ranges)."""
        t, b = self.num_tokens, self.num_seqs
        checks = [
            ("input_ids", self.input_ids, np.int64, (t,)),
            ("positions", self.positions, np.int64, (t,)),
            ("cu_seqlens", self.cu_seqlens, np.int32, (b + 1,)),
            ("past_lens", self.past_lens, np.int32, (b,)),
            ("slot_mapping", self.slot_mapping, np.int64, (t,)),
        ]
        for name, arr, dtype, shape in checks:
            if arr.dtype != dtype or arr.shape != shape:
                raise ValueError(f"ForwardBatch.{name}: expected {np.dtype(dtype).name}{list(shape)}, "
                                 f"got {arr.dtype.name}{list(arr.shape)}")
        if self.block_table.dtype != np.int32 or self.block_table.ndim != 2 or self.block_table.shape[0] != b:
            raise ValueError(f"ForwardBatch.block_table: expected int32[{b}, max_blocks], "
                             f"got {self.block_table.dtype.name}{list(self.block_table.shape)}")
        if self.logits_index.dtype != np.int64 or self.logits_index.ndim != 1:
            raise ValueError("ForwardBatch.logits_index: expected int64[B']")
        if int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != t or np.any(np.diff(self.cu_seqlens) < 0):
            raise ValueError("ForwardBatch.cu_seqlens must start at 0, be non-decreasing and end at T")
        if t and (self.slot_mapping.min() < 0 or self.slot_mapping.max() >= num_blocks * block_size):
            raise ValueError("ForwardBatch.slot_mapping out of the KV pool's range")
        if self.block_table.size and self.block_table.max() >= num_blocks:
            raise ValueError("ForwardBatch.block_table names a block outside the pool")
        if self.logits_index.size and (self.logits_index.min() < 0 or self.logits_index.max() >= t):
            raise ValueError("ForwardBatch.logits_index out of range")
        if vocab_size is not None and t and (self.input_ids.min() < 0 or self.input_ids.max() >= vocab_size):
            raise ValueError("ForwardBatch.input_ids out of the vocabulary's range")
