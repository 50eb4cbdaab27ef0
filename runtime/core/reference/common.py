"""What the twin's modules share: 64-bit constants, the integer check, splitmix64's finalizer and the
buffer-protocol check of array arguments (the Python side of runtime/core/_core.h)."""

from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "I64_MAX", "M64", "as_array", "is_int", "mix64"]

M64 = (1 << 64) - 1
I64_MAX = (1 << 63) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: splitmix64's increment (CORE_GOLDEN)


def is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers with full avalanche (core_mix64)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def as_array(obj: object, name: str) -> np.ndarray:
    """obj as an ndarray (itself when it is one); TypeError naming `name` without the buffer protocol."""
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected an object with the buffer protocol, got {type(obj).__name__}") from None
    return obj if isinstance(obj, np.ndarray) else np.asarray(obj)
