"""The CPU paged-attention kernel's custom-op library for ONNX Runtime: where it is and how to register it.

`paged_attention_cpu.c` (built by the package build as `runtime/kernels/_paged_attention_cpu*.so`, next to
this file) implements `optimize.PagedAttention`, the `paged_cpu` attention variant's node: it writes the
step's K/V into the pools in place and attends per sequence through the block table. A graph that has
such a node (domain `optimize`) loads only in a session whose options registered the library:
`register(so)` does that, after checking that the installed ONNX Runtime is new enough for the C API
version the library declares (the library checks the same again when ONNX Runtime calls it).

Imports neither torch nor onnx (the runtime's deploy image has neither).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

DOMAIN = "optimize"
OP_TYPE = "PagedAttention"
ROPE_OP_TYPE = "RotaryPagedAttention"  # the same kernel on the packed QKV, rotating q and k itself
# The C library asks ONNX Runtime for this version of its API table (ORT_API_VERSION_USED in ort_api.h).
ORT_API_VERSION = 20
MODULE = "runtime.kernels._paged_attention_cpu"


class KernelLibraryError(RuntimeError):
    """The custom-op library is missing or cannot be registered with this ONNX Runtime."""


@functools.cache
def library_path() -> Path:
    """The built library's path (raises KernelLibraryError when the package was installed without it)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        raise KernelLibraryError(
            "the CPU paged-attention kernel library (runtime/kernels/_paged_attention_cpu) is not built: "
            "reinstall the package with a C compiler present (pip install -e .), or rebuild the artifact with "
            "another attention variant (select_attention kernel: decomposed)")
    return Path(spec.origin)


def check_onnxruntime_version(version: str) -> None:
    """Refuse an ONNX Runtime older than the C API version the library declares."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as e:
        raise KernelLibraryError(f"cannot read ONNX Runtime's version {version!r}") from e
    if (major, minor) < (1, ORT_API_VERSION):
        raise KernelLibraryError(
            f"the CPU paged-attention kernel needs ONNX Runtime >= 1.{ORT_API_VERSION} (C API version "
            f"{ORT_API_VERSION}); this is onnxruntime {version}")


def register(so: Any) -> None:
    """Register the library with ONNX Runtime SessionOptions `so` (a clear error when it cannot)."""
    import onnxruntime as ort

    check_onnxruntime_version(ort.__version__)
    path = library_path()
    try:
        so.register_custom_ops_library(str(path))
    except Exception as e:  # ONNX Runtime raises its own exception types (Fail, RuntimeException)
        raise KernelLibraryError(f"ONNX Runtime {ort.__version__} could not register {path.name}: {e}") from e


def uses_kernel(model: Any) -> bool:
    """Whether an onnx ModelProto imports the `optimize` domain (it needs `register`)."""
    return any(o.domain == DOMAIN for o in model.opset_import)


__all__ = ["DOMAIN", "OP_TYPE", "ROPE_OP_TYPE", "KernelLibraryError", "check_onnxruntime_version", "library_path", "register",
           "uses_kernel"]
