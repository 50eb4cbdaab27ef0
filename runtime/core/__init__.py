"""The engine core: block manager with prefix caching, scheduler step, ForwardBatch packing,
KV scatter/copy, and sampling.

Two implementations with one contract: the C extension `runtime.core._core` (default) and the
pure-Python twin `runtime.core.reference` (the test oracle). Set `OPTIMIZE_CORE=python` to run
everything on the twin; `CORE_IMPL` says which one was chosen ("c" or "python"). The plain data
types (SchedulerConfig, BatchEntry, ScheduledBatch, PrefixCacheStats, RNG) are shared.
"""

from __future__ import annotations

import os

from runtime.core.reference import (
    RNG,
    BatchEntry,
    KVEvent,
    PrefixCacheStats,
    ScheduledBatch,
    SchedulerConfig,
    decode_kv_events,
    make_rng,
)

__all__ = [
    "CORE_IMPL",
    "RNG",
    "BatchEntry",
    "KVEvent",
    "PrefixCacheStats",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "copy_blocks",
    "decode_kv_events",
    "make_rng",
    "scatter_kv",
    "scatter_kv_layers",
]

_choice = os.environ.get("OPTIMIZE_CORE", "c").strip().lower() or "c"
if _choice not in ("c", "python"):
    raise ValueError(f"OPTIMIZE_CORE must be 'c' or 'python', got {os.environ.get('OPTIMIZE_CORE')!r}")

CORE_IMPL: str = _choice

if CORE_IMPL == "python":
    from runtime.core.reference import Scheduler, copy_blocks, scatter_kv, scatter_kv_layers
else:
    try:
        from runtime.core._core import copy_blocks, scatter_kv, scatter_kv_layers
    except ImportError as exc:
        raise ImportError(
            "the C extension runtime.core._core is not built: run `pip install -e .` (or "
            "`python setup.py build_ext --inplace`) in the project root, or set OPTIMIZE_CORE=python "
            f"to use the pure-Python core ({exc})"
        ) from exc
    from runtime.core._cwrap import Scheduler
