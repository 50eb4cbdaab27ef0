"""KV block copy and KV scatter of the Python twin (twins of copy_blocks, scatter_kv and
scatter_kv_layers in runtime/core/_core.c): the same checks, in the same order, with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.core.reference.common import I64_MAX, as_array

__all__ = ["copy_blocks", "scatter_kv", "scatter_kv_layers"]


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
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > I64_MAX:
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
        a = as_array(pool, f"pools[{i}]")
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
    s = as_array(slot_mapping, "slot_mapping")
    _check_slots(s)
    p, n = as_array(pool, "pool"), as_array(new, "new")
    _check_layer(p, n, s)
    p.reshape(-1, *p.shape[2:])[s] = n


def scatter_kv_layers(pools: list[np.ndarray], news: list[np.ndarray], slot_mapping: np.ndarray) -> None:
    """scatter_kv for every layer; validates all layers before writing any."""
    pools, news = list(pools), list(news)
    if len(pools) != len(news):
        raise ValueError(f"pools and news: {len(pools)} pools but {len(news)} new tensors")
    s = as_array(slot_mapping, "slot_mapping")
    _check_slots(s)
    arrays = []
    for i, (pool, new) in enumerate(zip(pools, news, strict=True)):
        try:
            p, n = as_array(pool, "pool"), as_array(new, "new")
            _check_layer(p, n, s)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"layer {i}: {exc}") from None
        arrays.append((p, n))
    for p, n in arrays:
        p.reshape(-1, *p.shape[2:])[s] = n
