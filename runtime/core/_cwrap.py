"""The C scheduler (`runtime.core._core.Scheduler`) behind the twin's Python API.

`Scheduler` owns the preallocated ForwardBatch buffers (sized by the config's limits) and turns
the sizes `_pack` returns into views of them, so packing a step allocates nothing and loops over
no token in Python. The arrays of a returned ForwardBatch are views into those buffers: the next
`pack()` overwrites them (the engine consumes each ForwardBatch before the next step).
"""

from __future__ import annotations

import secrets

import numpy as np

from runtime.core import _core
from runtime.core.reference import BatchEntry, PrefixCacheStats, ScheduledBatch, SchedulerConfig
from runtime.forward_batch import ForwardBatch

__all__ = ["Scheduler"]


class Scheduler(_core.Scheduler):
    """Continuous batching with chunked prefill, FCFS admission, prefix caching and preemption by
    recompute, in C; decisions identical to `runtime.core.reference.Scheduler` (see its docs)."""

    __slots__ = ("config", "_bufs")

    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        seed = config.prefix_cache_seed
        t, s = config.max_num_batched_tokens, config.max_num_seqs
        m = -(-config.max_model_len // config.block_size)
        bufs = (
            np.zeros(t, np.int64),  # input_ids
            np.zeros(t, np.int64),  # positions
            np.zeros(t, np.int64),  # slot_mapping
            np.zeros(s + 1, np.int32),  # cu_seqlens
            np.zeros(s, np.int32),  # past_lens
            np.zeros(s * m, np.int32),  # block_table, [B, max_blocks] row-major in the first B*max_blocks
            np.zeros(s, np.int64),  # logits_index
        )
        super().__init__(config.block_size, config.num_blocks, config.max_num_seqs, config.max_num_batched_tokens,
                         config.max_model_len, config.enable_prefix_caching, config.enable_copy_on_write,
                         secrets.randbits(64) if seed is None else int(seed),
                         BatchEntry, ScheduledBatch, PrefixCacheStats, bufs)
        self.config = config
        self._bufs = bufs

    def pack(self, batch: ScheduledBatch) -> ForwardBatch:
        """The ForwardBatch arrays of a step (views into this scheduler's buffers; see the module doc)."""
        t, b, mb, nl = self._pack(batch)
        ids, pos, slots, cu, past, bt, li = self._bufs
        return ForwardBatch(ids[:t], pos[:t], cu[: b + 1], past[:b], bt[: b * mb].reshape(b, mb), slots[:t], li[:nl])
