"""A CPU stand-in for tensorrt, pycuda and cuda-python, to run the TensorRT build pass and backend here.

It implements the slice of each API that compiler/passes/build_engine.py and runtime/backends/tensorrt.py
call, with the semantics that matter for their logic:

- device memory is a flat fake address space of numpy byte blocks (`mem_alloc` returns an address;
  copies and memsets read and write the bytes);
- the "engine" is the parsed ONNX graph plus its optimization profiles; an execution context checks
  every input shape against its profile, reads the inputs from the addresses set on it, runs the graph
  on ONNX Runtime CPU and writes the outputs to their addresses;
- the scatter kernel is emulated from its launch arguments (pointer tables, slots, row words);
- stream capture records launches (engine runs, kernels) with the addresses and shapes bound at capture
  time, and a graph launch replays them, reading the memory as it is at replay.

Install with `install(monkeypatch)`: it puts the modules in sys.modules and makes runtime.gpu.probe()
report one GPU and the packages.
"""

from __future__ import annotations

import base64
import bisect
import enum
import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

GPU_NAME = "NVIDIA H100 80GB HBM3"
COMPUTE_CAPABILITY = "9.0"
TRT_VERSION = "10.3.0"

# --------------------------------------------------------------------------------------------- memory


class Memory:
    """A fake device address space."""

    def __init__(self) -> None:
        self.bases: list[int] = []
        self.blocks: dict[int, np.ndarray] = {}
        self.next = 1 << 20

    def alloc(self, n: int) -> int:
        base = self.next
        self.next += -(-max(n, 1) // 256) * 256 + 256
        self.blocks[base] = np.zeros(max(n, 1), np.uint8)
        bisect.insort(self.bases, base)
        return base

    def view(self, addr: int, n: int) -> np.ndarray:
        i = bisect.bisect_right(self.bases, addr) - 1
        if i < 0:
            raise ValueError(f"address {addr:#x} is not allocated")
        base = self.bases[i]
        block = self.blocks[base]
        off = addr - base
        if off + n > block.size:
            raise ValueError(f"access of {n} bytes at {addr:#x} overruns its allocation of {block.size} bytes")
        return block[off:off + n]


MEM = Memory()


class DeviceAllocation:
    def __init__(self, n: int) -> None:
        self.addr = MEM.alloc(n)
        self.size = n

    def __int__(self) -> int:
        return self.addr

    __index__ = __int__


def _addr(x: Any) -> int:
    return int(x)


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


# --------------------------------------------------------------------------------------------- streams

STREAMS: dict[int, Stream] = {}


class Stream:
    _next = 1000

    def __init__(self, flags: int = 0) -> None:
        Stream._next += 1
        self.handle = Stream._next
        self.capture: list[Any] | None = None
        STREAMS[self.handle] = self

    def synchronize(self) -> None:
        if self.capture is not None:
            raise RuntimeError("synchronize during stream capture")


def _submit(stream_handle: int, op: Any) -> None:
    """Run `op` now, or record it when the stream is capturing."""
    stream = STREAMS[stream_handle]
    if stream.capture is not None:
        stream.capture.append(op)
    else:
        op()


# --------------------------------------------------------------------------------------------- pycuda


def _pycuda() -> tuple[types.ModuleType, types.ModuleType]:
    pkg = _module("pycuda")
    drv = _module("pycuda.driver")
    pkg.driver = drv

    class Context:
        @staticmethod
        def pop() -> None:
            pass

    class _Primary:
        def push(self) -> None:
            pass

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def compute_capability(self) -> tuple[int, int]:
            major, minor = COMPUTE_CAPABILITY.split(".")
            return int(major), int(minor)

        def retain_primary_context(self) -> _Primary:
            return _Primary()

    def memcpy_htod(dest: Any, src: np.ndarray) -> None:
        b = _bytes_of(src)
        MEM.view(_addr(dest), b.size)[:] = b

    def memcpy_dtoh(dest: np.ndarray, src: Any) -> None:
        flat = dest.reshape(-1).view(np.uint8)
        flat[:] = MEM.view(_addr(src), flat.size)

    def memcpy_htod_async(dest: Any, src: np.ndarray, stream: Stream) -> None:
        if stream.capture is not None:
            raise RuntimeError("host copies are not captured by this backend")
        memcpy_htod(dest, src)

    def memcpy_dtoh_async(dest: np.ndarray, src: Any, stream: Stream) -> None:
        if stream.capture is not None:
            raise RuntimeError("host copies are not captured by this backend")
        memcpy_dtoh(dest, src)

    def memcpy_dtod_async(dest: Any, src: Any, size: int, stream: Stream) -> None:
        def op() -> None:
            MEM.view(_addr(dest), size)[:] = MEM.view(_addr(src), size).copy()
        _submit(stream.handle, op)

    def memset_d8(dest: Any, value: int, count: int) -> None:
        MEM.view(_addr(dest), count)[:] = value

    class Function:
        def __init__(self, name: str) -> None:
            self.name = name
            self.launches = 0

        def prepare(self, fmt: str) -> None:
            assert fmt == "PPPi", fmt

        def prepared_async_call(self, grid: tuple[int, ...], block: tuple[int, ...], stream: Stream,
                                src: int, dst: int, slots: int, row_words: int) -> None:
            tokens, pools = grid[0], grid[1]

            def op() -> None:
                self.launches += 1
                src_tab = MEM.view(src, 8 * pools).view(np.uint64)
                dst_tab = MEM.view(dst, 8 * pools).view(np.uint64)
                slot = MEM.view(slots, 8 * tokens).view(np.int64)
                row = 4 * row_words
                for p in range(pools):
                    for t in range(tokens):
                        if slot[t] >= 0:
                            MEM.view(int(dst_tab[p]) + int(slot[t]) * row, row)[:] = \
                                MEM.view(int(src_tab[p]) + t * row, row)
            _submit(stream.handle, op)

    class Module:
        def get_function(self, name: str) -> Function:
            assert name == "scatter_kv"
            return Function(name)

    def module_from_buffer(buffer: bytes) -> Module:
        return Module()

    for name, value in dict(init=lambda: None, Device=Device, Context=Context, Stream=Stream,
                            mem_alloc=DeviceAllocation, memcpy_htod=memcpy_htod, memcpy_dtoh=memcpy_dtoh,
                            memcpy_htod_async=memcpy_htod_async, memcpy_dtoh_async=memcpy_dtoh_async,
                            memcpy_dtod_async=memcpy_dtod_async, memset_d8=memset_d8,
                            pagelocked_empty=lambda shape, dtype: np.empty(shape, dtype),
                            module_from_buffer=module_from_buffer).items():
        setattr(drv, name, value)
    return pkg, drv


# --------------------------------------------------------------------------------------------- cuda-python


def _cuda_python() -> list[types.ModuleType]:
    cuda = _module("cuda")
    bindings = _module("cuda.bindings")
    driver = _module("cuda.bindings.driver")
    nvrtc = _module("cuda.bindings.nvrtc")
    cuda.bindings = bindings
    bindings.driver, bindings.nvrtc = driver, nvrtc

    class nvrtcResult(enum.Enum):  # noqa: N801 - cuda-python's name
        NVRTC_SUCCESS = 0
        NVRTC_ERROR_COMPILATION = 6

    ok = nvrtcResult.NVRTC_SUCCESS
    programs: dict[int, bytes] = {}

    def create(src: bytes, name: bytes, n: int, headers: list[Any], names: list[Any]) -> tuple[Any, int]:
        programs[len(programs) + 1] = src
        return ok, len(programs)

    def compile_(prog: int, n: int, opts: list[bytes]) -> tuple[Any]:
        assert opts and opts[0].startswith(b"--gpu-architecture=compute_"), opts
        return (ok if b"__global__ void scatter_kv" in programs[prog] else nvrtcResult.NVRTC_ERROR_COMPILATION,)

    for name, value in dict(nvrtcResult=nvrtcResult, nvrtcGetSupportedArchs=lambda: (ok, [75, 80, 86, 89, 90]),
                            nvrtcCreateProgram=create, nvrtcCompileProgram=compile_,
                            nvrtcGetPTXSize=lambda prog: (ok, 64), nvrtcGetPTX=lambda prog, buf: (ok,),
                            nvrtcGetProgramLogSize=lambda prog: (ok, 1), nvrtcGetProgramLog=lambda prog, buf: (ok,),
                            nvrtcDestroyProgram=lambda prog: (ok,)).items():
        setattr(nvrtc, name, value)

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901

    class CUstreamCaptureMode(enum.Enum):
        CU_STREAM_CAPTURE_MODE_GLOBAL = 0
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1

    class CUstream:
        def __init__(self, init_value: int = 0) -> None:
            self.handle = int(init_value)

    class Graph:
        def __init__(self, ops: list[Any]) -> None:
            self.ops = ops
            self.launches = 0

    success = CUresult.CUDA_SUCCESS

    def begin(stream: CUstream, mode: Any) -> tuple[Any]:
        s = STREAMS[stream.handle]
        assert s.capture is None
        s.capture = []
        return (success,)

    def end(stream: CUstream) -> tuple[Any, Graph]:
        s = STREAMS[stream.handle]
        ops, s.capture = s.capture, None
        return success, Graph(ops or [])

    def launch(graph: Graph, stream: CUstream) -> tuple[Any]:
        graph.launches += 1
        for op in graph.ops:
            _submit(stream.handle, op)
        return (success,)

    for name, value in dict(CUresult=CUresult, CUstreamCaptureMode=CUstreamCaptureMode, CUstream=CUstream,
                            cuStreamBeginCapture=begin, cuStreamEndCapture=end,
                            cuGraphInstantiateWithFlags=lambda graph, flags: (success, graph),
                            cuGraphLaunch=launch, cuGraphDestroy=lambda graph: (success,),
                            cuGraphExecDestroy=lambda graph: (success,),
                            cuGetErrorString=lambda err: (success, str(err).encode())).items():
        setattr(driver, name, value)
    return [cuda, bindings, driver, nvrtc]


# --------------------------------------------------------------------------------------------- tensorrt

ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 16: "BF16", 6: "INT32", 7: "INT64", 9: "BOOL"}
TRT_TO_NP = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_}


class FakeEngineState:
    """What the fake builder records, for tests to inspect."""

    last_build: dict[str, Any] = {}


def _tensorrt() -> types.ModuleType:
    trt = _module("tensorrt")
    trt.__version__ = TRT_VERSION

    class DataType(enum.Enum):
        FLOAT = 0
        HALF = 1
        INT8 = 2
        INT32 = 3
        BOOL = 4
        BF16 = 7
        INT64 = 8

    class TensorIOMode(enum.Enum):
        NONE = 0
        INPUT = 1
        OUTPUT = 2

    class ILogger:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        def __init__(self) -> None:
            pass

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    class NetworkDefinitionCreationFlag(enum.IntEnum):
        EXPLICIT_BATCH = 0
        STRONGLY_TYPED = 1

    class BuilderFlag(enum.Enum):
        FP16 = 0
        BF16 = 1
        TF32 = 7

    class MemoryPoolType(enum.Enum):
        WORKSPACE = 0

    class ExecutionContextAllocationStrategy(enum.Enum):
        STATIC = 0
        ON_PROFILE_CHANGE = 1
        USER_MANAGED = 2

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags = flags
            self.model: Any = None

    class OnnxParser:
        def __init__(self, network: Network, logger: Any) -> None:
            self.network = network
            self.num_errors = 0

        def parse_from_file(self, path: str) -> bool:
            import onnx

            model = onnx.load(path)  # external data next to it
            onnx.checker.check_model(model, full_check=True)
            self.network.model = model
            return True

        def get_error(self, i: int) -> str:
            return ""

    class TimingCache:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def serialize(self) -> bytes:
            return self.data + b"+timings"

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, list[list[int]]] = {}

        def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)), (name, lo, opt, hi)
            self.shapes[name] = [list(lo), list(opt), list(hi)]

    class Config:
        def __init__(self) -> None:
            self.flags: set[str] = {"TF32"}
            self.profiles: list[Profile] = []
            self.pool_limits: dict[str, int] = {}
            self.builder_optimization_level = 3
            self.progress_monitor: Any = None
            self.cache: TimingCache | None = None

        def set_memory_pool_limit(self, pool: Any, size: int) -> None:
            self.pool_limits[pool.name] = size

        def set_flag(self, flag: Any) -> None:
            self.flags.add(flag.name)

        def clear_flag(self, flag: Any) -> None:
            self.flags.discard(flag.name)

        def create_timing_cache(self, data: bytes) -> TimingCache:
            return TimingCache(bytes(data))

        def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
            self.cache = cache
            return True

        def get_timing_cache(self) -> TimingCache:
            assert self.cache is not None
            return self.cache

        def add_optimization_profile(self, profile: Profile) -> int:
            self.profiles.append(profile)
            return len(self.profiles) - 1

    class Builder:
        def __init__(self, logger: Any) -> None:
            self.logger = logger

        def create_network(self, flags: int = 0) -> Network:
            return Network(flags)

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            names = [i.name for i in network.model.graph.input]
            for p in config.profiles:
                assert sorted(p.shapes) == sorted(names), (sorted(p.shapes), names)
            if config.progress_monitor is not None:
                m = config.progress_monitor
                m.phase_start("Building engine", None, 2)
                m.step_complete("Building engine", 0)
                m.step_complete("Building engine", 1)
                m.phase_finish("Building engine")
            FakeEngineState.last_build = {
                "flags": sorted(config.flags), "strongly_typed": bool(network.flags & (1 << 1)),
                "optimization_level": config.builder_optimization_level, "pool_limits": config.pool_limits,
                "timing_cache_in": config.cache.data if config.cache else None,
            }
            return json.dumps({"profiles": [p.shapes for p in config.profiles],
                               "onnx": base64.b64encode(network.model.SerializeToString()).decode()}).encode()

    class Engine:
        def __init__(self, data: dict[str, Any]) -> None:
            import onnx
            import onnxruntime as ort

            self.profiles = data["profiles"]
            self.model = onnx.load_from_string(base64.b64decode(data["onnx"]))
            so = ort.SessionOptions()
            so.log_severity_level = 3
            self.session = ort.InferenceSession(self.model.SerializeToString(), so,
                                                providers=["CPUExecutionProvider"])
            g = self.model.graph
            self.io = [(i.name, TensorIOMode.INPUT, i.type.tensor_type.elem_type) for i in g.input] + \
                      [(o.name, TensorIOMode.OUTPUT, o.type.tensor_type.elem_type) for o in g.output]
            self.num_io_tensors = len(self.io)
            self.num_optimization_profiles = len(self.profiles)
            self.num_layers = len(g.node)
            self.contexts: list[Context] = []

        def get_tensor_name(self, i: int) -> str:
            return self.io[i][0]

        def get_tensor_mode(self, name: str) -> Any:
            return next(m for n, m, _ in self.io if n == name)

        def get_tensor_dtype(self, name: str) -> Any:
            return DataType[ONNX_TO_TRT[next(t for n, _, t in self.io if n == name)]]

        def is_shape_inference_io(self, name: str) -> bool:
            return False

        def get_tensor_profile_shape(self, name: str, profile: int) -> list[list[int]]:
            return self.profiles[profile][name]

        def get_device_memory_size_for_profile_v2(self, profile: int) -> int:
            return 4096

        def create_execution_context(self, strategy: Any) -> Context:
            ctx = Context(self, strategy)
            self.contexts.append(ctx)
            return ctx

    class Context:
        def __init__(self, engine: Engine, strategy: Any) -> None:
            self.engine = engine
            self.strategy = strategy
            self.profile: int | None = None
            self.shapes: dict[str, tuple[int, ...]] = {}
            self.addresses: dict[str, int] = {}
            self.device_memory: int | None = None
            self.runs = 0

        def set_device_memory(self, ptr: int, size: int) -> None:
            self.device_memory = ptr

        def set_optimization_profile_async(self, index: int, stream: int) -> bool:
            self.profile = index
            return True

        def set_input_shape(self, name: str, shape: Any) -> bool:
            lo, _, hi = self.engine.profiles[self.profile][name]
            if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi, strict=True)):
                return False
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name: str, address: int) -> bool:
            self.addresses[name] = int(address)
            return True

        def execute_async_v3(self, stream: int) -> bool:
            assert self.strategy == ExecutionContextAllocationStrategy.USER_MANAGED and self.device_memory
            shapes, addresses = dict(self.shapes), dict(self.addresses)  # bound now, as a captured graph would be

            def op() -> None:
                self.runs += 1
                eng = self.engine
                feeds = {}
                for name, mode, t in eng.io:
                    if mode != TensorIOMode.INPUT:
                        continue
                    dtype = np.dtype(TRT_TO_NP[ONNX_TO_TRT[t]])
                    n = int(np.prod(shapes[name])) * dtype.itemsize
                    feeds[name] = MEM.view(addresses[name], n).view(dtype).reshape(shapes[name]).copy()
                outs = eng.session.run(None, feeds)
                for (name, _mode, _), value in zip([x for x in eng.io if x[1] == TensorIOMode.OUTPUT], outs,
                                                  strict=True):
                    b = _bytes_of(value)
                    MEM.view(addresses[name], b.size)[:] = b
            _submit(stream, op)
            return True

    class Runtime:
        def __init__(self, logger: Any) -> None:
            self.logger = logger

        def deserialize_cuda_engine(self, data: bytes) -> Engine | None:
            try:
                return Engine(json.loads(bytes(data)))
            except (ValueError, KeyError):
                return None

    for name, value in dict(DataType=DataType, TensorIOMode=TensorIOMode, ILogger=ILogger, Logger=ILogger,
                            IProgressMonitor=IProgressMonitor,
                            NetworkDefinitionCreationFlag=NetworkDefinitionCreationFlag, BuilderFlag=BuilderFlag,
                            MemoryPoolType=MemoryPoolType,
                            ExecutionContextAllocationStrategy=ExecutionContextAllocationStrategy,
                            Builder=Builder, OnnxParser=OnnxParser, Runtime=Runtime).items():
        setattr(trt, name, value)
    return trt


# --------------------------------------------------------------------------------------------- install


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__file__ = str(Path(__file__))
    return mod


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the fakes in sys.modules and make runtime.gpu report one GPU with the packages; returns tensorrt."""
    import runtime.gpu as gpu

    trt = _tensorrt()
    pycuda, driver = _pycuda()
    mods = [trt, pycuda, driver, *_cuda_python()]
    for m in mods:
        monkeypatch.setitem(sys.modules, m.__name__, m)
    env = gpu.GpuEnvironment(None, (gpu.Device(0, GPU_NAME, COMPUTE_CAPABILITY, 80 << 30),),
                             {"torch": None, "torch.cuda": None, "onnxruntime": None, "onnxruntime.cuda": None,
                              "tensorrt": TRT_VERSION, "pycuda": "2024.1", "cuda-python": "12.6.0"})
    monkeypatch.setattr(gpu, "probe", lambda packages=(): env)
    return trt


__all__ = ["COMPUTE_CAPABILITY", "GPU_NAME", "MEM", "TRT_VERSION", "FakeEngineState", "install"]
