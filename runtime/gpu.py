"""What GPU this machine has, and the early, specific errors for GPU targets that cannot run here.

`probe()` asks the NVIDIA driver (libcuda through ctypes: no Python package needed) for the
devices, their names and compute capabilities, and reports which GPU packages import (torch with
CUDA, onnxruntime's CUDA provider, tensorrt, pycuda, cuda-python). Nothing here imports a GPU
package at module import, and `missing_for(backend)` imports only that backend's packages (an ONNX
Runtime artifact never imports torch): it says what the target needs that this machine lacks, in
one message that names the package to install (`pip install .[gpu]`) or the GPU needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install '.[gpu]' (CUDA builds of the GPU packages) on a machine with an NVIDIA GPU and driver"
_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{MAJOR,MINOR}


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    compute_capability: str  # "9.0"
    memory_bytes: int

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "compute_capability": self.compute_capability, "memory_bytes": self.memory_bytes}


@dataclass(frozen=True)
class GpuEnvironment:
    driver: str | None  # why there is no usable driver, or None when libcuda answered
    devices: tuple[Device, ...] = ()
    packages: dict[str, str | None] = field(default_factory=dict)  # name -> version, None when absent

    @property
    def has_gpu(self) -> bool:
        return bool(self.devices)


def _driver_devices() -> tuple[str | None, tuple[Device, ...]]:
    """(problem, devices) from libcuda; problem is None when the driver answered."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return "no NVIDIA driver (libcuda) on this machine", ()
    if lib.cuInit(0) != 0:
        return "the NVIDIA driver did not initialise (cuInit failed: no GPU visible?)", ()
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "the NVIDIA driver sees no GPU", ()
    devices = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        lib.cuDeviceGet(ctypes.byref(dev), i)
        buf = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(buf, 256, dev)
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        lib.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)
        mem = ctypes.c_size_t(0)
        total = getattr(lib, "cuDeviceTotalMem_v2", None) or lib.cuDeviceTotalMem
        total(ctypes.byref(mem), dev)
        devices.append(Device(i, buf.value.decode(errors="replace"), f"{major.value}.{minor.value}", int(mem.value)))
    return None, tuple(devices)


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # a broken install counts as absent, with the reason in the log
        log.info("importing %s failed: %s", module, e)
        return None
    return str(getattr(mod, "__version__", "unknown"))


def _cuda_python_version() -> str | None:
    """cuda-python's version when its NVRTC binding is importable (cuda.bindings, or cuda.nvrtc before 12.6)."""
    for name in ("cuda.bindings.nvrtc", "cuda.nvrtc"):
        try:
            if importlib.util.find_spec(name) is not None:
                return _version(name.rsplit(".", 1)[0]) or "unknown"
        except (ImportError, ValueError):
            continue
    return None


def _torch_cuda() -> str | None:
    if _version("torch") is None:
        return None
    import torch

    return torch.version.cuda or None


def _onnxruntime_cuda() -> str | None:
    version = _version("onnxruntime")
    if version is None:
        return None
    import onnxruntime

    return version if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else None


# package key -> how to read its version (None: absent); each imports only its own package
_PACKAGES = {
    "torch": lambda: _version("torch"),
    "torch.cuda": _torch_cuda,
    "triton": lambda: _version("triton"),  # the torch/cuda Triton attention kernel (checked by that backend)
    "flashinfer": lambda: _version("flashinfer"),  # the torch/cuda `flashinfer` attention variant (optional)
    "onnxruntime": lambda: _version("onnxruntime"),
    "onnxruntime.cuda": _onnxruntime_cuda,
    "tensorrt": lambda: _version("tensorrt"),
    "pycuda": lambda: _version("pycuda"),
    "cuda-python": _cuda_python_version,
}


@functools.cache
def _package(key: str) -> str | None:
    return _PACKAGES[key]()


@functools.lru_cache(maxsize=1)
def _driver_state() -> tuple[str | None, tuple[Device, ...]]:
    return _driver_devices()


def probe(packages: tuple[str, ...] = tuple(_PACKAGES)) -> GpuEnvironment:
    """The driver's devices and the versions of `packages` (importing each: only a GPU target's own
    packages are imported when it is built or loaded)."""
    problem, devices = _driver_state()
    return GpuEnvironment(problem, devices, {key: _package(key) for key in packages})


# What each GPU backend needs besides a GPU: (package key in probe().packages, what to install)
_NEEDS = {
    "torch": [("torch.cuda", "a CUDA build of torch (this torch has no CUDA)")],
    "onnxruntime": [("onnxruntime.cuda", "onnxruntime-gpu (this onnxruntime has no CUDAExecutionProvider)")],
    "tensorrt": [("tensorrt", "tensorrt (the TensorRT Python package)"),
                 ("pycuda", "pycuda (device buffers and streams for the TensorRT runtime)"),
                 ("cuda-python", "cuda-python (NVRTC compiles the KV-cache scatter kernel at load; no nvcc needed)")],
}


def missing_for(backend: str, env: GpuEnvironment | None = None) -> str | None:
    """None when `backend` can run on CUDA here; else one message naming everything that is missing."""
    env = env or probe(tuple(key for key, _ in _NEEDS.get(backend, [])))
    problems = [f"{what}" for key, what in _NEEDS.get(backend, []) if env.packages.get(key) is None]
    if env.driver is not None:
        problems.append(f"an NVIDIA GPU: {env.driver}")
    if not problems:
        return None
    return (f"target {backend}/cuda cannot run on this machine; missing: {'; '.join(problems)}. "
            f"Install with {INSTALL_HINT}")


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    if lib.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    return lib


def device_copy(dst: int, src: int, nbytes: int, device: int = 0) -> None:
    """Copy nbytes between two device addresses (cuMemcpyDtoD on the device's primary context, which is
    the one the CUDA runtime of ONNX Runtime and torch use); synchronous."""
    lib = _driver()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), device) != 0 or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            raise RuntimeError(f"no CUDA context for device {device}")
        lib.cuCtxSetCurrent(ctx)
    copy = getattr(lib, "cuMemcpyDtoD_v2", None) or lib.cuMemcpyDtoD
    copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]
    status = copy(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes))
    if status != 0:
        raise RuntimeError(f"cuMemcpyDtoD failed with CUresult {status}")


def describe() -> dict[str, Any]:
    """The probe as a JSON-able dict (build.json, `optimize env`)."""
    env = probe()
    return {"driver": env.driver or "ok", "devices": [d.record() for d in env.devices], "packages": env.packages}
