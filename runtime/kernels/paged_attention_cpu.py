"""The CPU paged-attention kernel's custom-op library for ONNX Runtime: where it is and how to register it.

The library (built by the package build as `runtime/kernels/_paged_attention_cpu*.so`, next to this file,
from `ort_ops.c` and one `op_*.c` file per op) implements `optimize.PagedAttention`, the `paged_cpu`
attention variant's node (`op_paged_attention.c`): it writes the step's K/V into the pools in place and
attends per sequence through the block table; its other ops (RotaryPagedAttention, QuantizeRows, MatMulBf16,
SiluMul, SkipNormQuantize) come with it. A graph that has such a node (domain `optimize`) loads only in a session whose options
registered the library: `register(so)` does that, after checking that the installed ONNX Runtime is new
enough for the C API version the library declares (the library checks the same again when ONNX Runtime
calls it).

The library runs each op on one of its per-CPU code paths (avx512: 16 float lanes, AVX-512; avx2: 8 lanes,
AVX2 + FMA; baseline: 4 lanes, SSE2), the widest the CPU has unless `OPTIMIZE_CPU_ISA=avx512|avx2|baseline`
pins one (a pinned path the CPU lacks is an error naming the missing features, never a silent downgrade).
`register` makes that choice before each registration (`isa` overrides the environment) and logs it once;
`kernel_paths()` returns it (op -> path), read from the library's `optimize_kernel_paths()`.

Imports neither torch nor onnx (the runtime's deploy image has neither).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

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


ISA_PATHS = ("avx512", "avx2", "baseline")  # widest first (x86-64; elsewhere baseline only)
_logged: set[str] = set()


@functools.cache
def _library() -> ctypes.CDLL:
    """The library as ctypes loads it: the same loaded object ONNX Runtime registers (one dlopen per path)."""
    lib = ctypes.CDLL(str(library_path()))
    lib.optimize_select_kernel_paths.argtypes = [ctypes.c_char_p]
    lib.optimize_select_kernel_paths.restype = ctypes.c_int
    lib.optimize_kernel_paths.restype = ctypes.c_char_p
    lib.optimize_kernel_error.restype = ctypes.c_char_p
    return lib


def select_paths(isa: str | None = None) -> dict[str, Any]:
    """Choose the code path of every op (`isa`, else OPTIMIZE_CPU_ISA, else the CPU's widest) and return the
    choice as `kernel_paths()` does; KernelLibraryError when the path is unknown or this CPU cannot run it.
    Sessions created afterwards take it; a session keeps the path it was created with."""
    lib = _library()
    if lib.optimize_select_kernel_paths(isa.encode() if isa else None) != 0:
        raise KernelLibraryError(f"CPU kernels: {lib.optimize_kernel_error().decode()}")
    return kernel_paths()


def kernel_paths() -> dict[str, Any]:
    """The current choice: {"isa", "source" (cpu | OPTIMIZE_CPU_ISA | call), "available" (the paths this CPU
    runs, widest first), "cpu_features", "ops": {op type: path}} ("avx512_bf16" for MatMulBf16 on vdpbf16ps)."""
    report = json.loads(_library().optimize_kernel_paths().decode())
    if "error" in report:
        raise KernelLibraryError(f"CPU kernels: {report['error']}")
    return report


def describe(paths: dict[str, Any]) -> str:
    """One line: the ISA, why, and each op's path."""
    ops = ", ".join(f"{op} {path}" for op, path in paths["ops"].items())
    why = {"cpu": "the widest this CPU runs", "OPTIMIZE_CPU_ISA": "pinned by OPTIMIZE_CPU_ISA"}.get(
        paths["source"], "chosen by the caller")
    return f"CPU kernel path {paths['isa']} ({why}; this CPU runs {', '.join(paths['available'])}): {ops}"


def register(so: Any, isa: str | None = None) -> dict[str, Any]:
    """Register the library with ONNX Runtime SessionOptions `so` (a clear error when it cannot), its ops on
    the code paths `select_paths(isa)` chooses; returns that choice (logged once per distinct choice)."""
    import onnxruntime as ort

    check_onnxruntime_version(ort.__version__)
    path = library_path()
    paths = select_paths(isa)
    line = describe(paths)
    if line not in _logged:
        _logged.add(line)
        log.info("%s", line)
    try:
        so.register_custom_ops_library(str(path))
    except Exception as e:  # ONNX Runtime raises its own exception types (Fail, RuntimeException)
        raise KernelLibraryError(f"ONNX Runtime {ort.__version__} could not register {path.name}: {e}") from e
    return paths


def uses_kernel(model: Any) -> bool:
    """Whether an onnx ModelProto imports the `optimize` domain (it needs `register`)."""
    return any(o.domain == DOMAIN for o in model.opset_import)


__all__ = ["DOMAIN", "ISA_PATHS", "OP_TYPE", "ROPE_OP_TYPE", "KernelLibraryError", "check_onnxruntime_version",
           "describe", "kernel_paths", "library_path", "register", "select_paths", "uses_kernel"]
