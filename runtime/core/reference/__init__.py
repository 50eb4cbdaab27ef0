"""The pure-Python engine core: block pool, prefix cache, scheduler step, ForwardBatch packing,
KV scatter/copy, and sampling.

This is the reference "twin" of the C extension runtime.core._core, one module per C file:

    block_pool.py    _block_pool.c    the KV block pool: reference counts, fresh and cached (LRU) free queues
    prefix_cache.py  _prefix_cache.c  chained block hashes, the cache map, lookup, registration, KV events
    scheduler.py     _scheduler.c     sequences, queues, schedule / pack / update; the shared data types
    sampler.py       _sampler.c       the random stream and sampling
    kv.py            _core.c          KV scatter and block copy
    common.py        _core.h          what they share

Plain, slow, obviously correct, and the oracle the C code is tested against. Both make the same
decisions (same block ids, same eviction order, same hash function, same random numbers,
bit-identical sampling arithmetic). The engine can run on it directly (`OPTIMIZE_CORE=python`).
Every name other code uses is importable from here.
"""

from __future__ import annotations

from runtime.core.reference.block_pool import Block, BlockPool
from runtime.core.reference.kv import copy_blocks, scatter_kv, scatter_kv_layers
from runtime.core.reference.prefix_cache import (
    BlockManager,
    KVEvent,
    PrefixCache,
    block_hash,
    decode_kv_events,
    hash_key,
    set_hash_bits_for_tests,
)
from runtime.core.reference.sampler import (
    RNG,
    _lane_sum,
    exp_neg,
    make_rng,
    sample,
    sample_probs,
    unpack_mask,
)
from runtime.core.reference.scheduler import (
    BatchEntry,
    PrefixCacheStats,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
)

__all__ = [
    "Block",
    "BlockManager",
    "BlockPool",
    "BatchEntry",
    "PrefixCache",
    "PrefixCacheStats",
    "RNG",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "KVEvent",
    "_lane_sum",
    "block_hash",
    "copy_blocks",
    "decode_kv_events",
    "exp_neg",
    "hash_key",
    "make_rng",
    "sample",
    "sample_probs",
    "scatter_kv",
    "scatter_kv_layers",
    "set_hash_bits_for_tests",
    "unpack_mask",
]
