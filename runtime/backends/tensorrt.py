"""TensorRT backend: runs an artifact's engine (model.plan) on one ForwardBatch and owns the KV pools.

Needs an NVIDIA GPU and three packages (`pip install '.[gpu]'`): `tensorrt`; `pycuda` for device
memory, the stream, host<->device copies and kernel launches; and `cuda-python`, whose NVRTC compiles
the KV-cache scatter kernel at load (so no CUDA toolkit / nvcc is needed at runtime) and whose driver
bindings capture the CUDA graphs.

A TensorRT engine runs only on the TensorRT version and the GPU model it was built with. Before
anything is imported, `engine_compatibility` compares the manifest's engine record (TensorRT version,
GPU name, compute capability) with this machine and the constructor refuses a mismatch with a message
naming both sides.

Per step:

- the ForwardBatch arrays are packed into one pinned host staging area and copied to the device in
  one transfer (each array at a 256-byte aligned offset; the engine reads them in place);
- a pure decode step (one token per sequence) runs the `decode` profile, a prefill or mixed step the
  `mixed` one (profiles: compiler/trt/profiles.py); each profile has its own execution context, and all
  contexts share one activation buffer (steps never overlap: one stream);
- the engine returns each layer's new K/V; a small CUDA kernel writes them into the device pools at
  `slot_mapping` (slot -1: not written), then the logits rows come back to a pinned host buffer;
- a decode step of up to the largest CUDA-graph bucket (the build's plan_cuda_graphs buckets, one
  engine profile each) is padded to the smallest bucket >= its size (padded rows: token 0 at position 0,
  no past, block-table row -1, slot -1: nothing written, logits dropped) and replays the bucket's CUDA
  graph, captured at load after one warm-up run with every shape and address fixed: engine + scatter
  kernel in one launch (`graphs="auto"`). `graphs="padded"` runs the same padded bucket step without a
  graph; `graphs="off"` (or OPTIMIZE_CUDA_GRAPHS=0) runs decode through the `decode` profile.

`copy_blocks` copies blocks on the device (copy-on-write of the prefix cache).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime import gpu
from runtime.backends import read_geometry
from runtime.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

ENGINE_KEY = "engine"  # manifest key of the engine record (also the build_engine pass's stats)
_ALIGN = 256  # device address alignment of every staged array

# The KV scatter: token t of this step goes to row slot_mapping[t] of each of the 2 * num_layers pools
# (blockIdx.y picks the pool, one block per token); rows are copied as 32-bit words.
SCATTER_KERNEL = r"""
extern "C" __global__ void scatter_kv(const unsigned long long* __restrict__ src,
                                      const unsigned long long* __restrict__ dst,
                                      const long long* __restrict__ slots, int row_words) {
    const long long slot = slots[blockIdx.x];
    if (slot < 0) return;
    const unsigned int* s = reinterpret_cast<const unsigned int*>(src[blockIdx.y])
                            + (long long)blockIdx.x * row_words;
    unsigned int* d = reinterpret_cast<unsigned int*>(dst[blockIdx.y]) + slot * (long long)row_words;
    for (int i = threadIdx.x; i < row_words; i += blockDim.x) d[i] = s[i];
}
"""

# ---------------------------------------------------------------------------------------------------
# compatibility (no GPU package imported)


def engine_record(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's engine record: manifest["engine"], else the build_engine pass's stats."""
    record = manifest.get(ENGINE_KEY)
    if isinstance(record, dict):
        return record
    for entry in manifest.get("passes") or []:
        if isinstance(entry, dict) and entry.get("name") == "build_engine" and isinstance(entry.get("stats"), dict):
            return entry["stats"]
    return None


def present_machine() -> dict[str, str | None]:
    """This machine's TensorRT version, first GPU's name and compute capability (None when absent)."""
    env = gpu.probe(("tensorrt",))
    dev = env.devices[0] if env.devices else None
    return {"tensorrt_version": env.packages.get("tensorrt"), "gpu": dev.name if dev else None,
            "compute_capability": dev.compute_capability if dev else None}


def engine_compatibility(recorded: dict[str, Any], present: dict[str, Any]) -> str | None:
    """None when the engine was built with this TensorRT version for this GPU; else the refusal."""
    keys = ("tensorrt_version", "gpu", "compute_capability")
    want = [recorded.get(k) for k in keys]
    have = [present.get(k) for k in keys]
    if None not in want and want == have:
        return None
    built = (f"engine built with TensorRT {want[0] or 'unknown'} for {want[1] or 'an unknown GPU'} "
             f"(compute capability {want[2] or 'unknown'})")
    trt_side = f"TensorRT {have[0]}" if have[0] else "no TensorRT"
    gpu_side = f"{have[1]} ({have[2]})" if have[1] else "no NVIDIA GPU"
    if have[0] and have[1]:
        fix = "rebuild the artifact on this machine's GPU and TensorRT"
    else:
        fix = (f"serve it on a machine with TensorRT {want[0]} and {want[1]}, or rebuild the artifact on the "
               "machine that serves it (pip install '.[gpu]')")
    return f"{built}; this machine has {trt_side} and {gpu_side}: {fix}"


# ---------------------------------------------------------------------------------------------------
# helpers shared with the build_engine pass (tensorrt is passed in: imported by the caller)


def trt_logger(trt: Any) -> Any:
    """A TensorRT ILogger that forwards to Python logging and keeps the error messages."""

    class _Logger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                self.errors.append(msg)
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.WARNING:
                log.warning("TensorRT: %s", msg)
            else:
                log.debug("TensorRT: %s", msg)

    return _Logger()


_DTYPE_BYTES = {"FLOAT": 4, "HALF": 2, "BF16": 2, "INT32": 4, "INT64": 8, "INT8": 1, "UINT8": 1, "BOOL": 1,
                "FP8": 1}


def dtype_name(dtype: Any) -> str:
    """'HALF' for trt.DataType.HALF."""
    return str(getattr(dtype, "name", dtype)).rsplit(".", 1)[-1]


def _cuda_python() -> tuple[Any, Any]:
    """(driver, nvrtc) of cuda-python (cuda.bindings since 12.6; cuda.cuda / cuda.nvrtc before)."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        from cuda import cuda as driver  # type: ignore[no-redef]
        from cuda import nvrtc  # type: ignore[no-redef]
    return driver, nvrtc


def compile_scatter_kernel(nvrtc: Any, compute_capability: tuple[int, int]) -> bytes:
    """PTX of SCATTER_KERNEL for the newest virtual architecture NVRTC knows that the GPU runs."""

    def check(result: Any, what: str, prog: Any = None) -> Any:
        """The value of an NVRTC call (each returns (status, *values)); RuntimeError with the log otherwise."""
        err = result[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            detail = ""
            if prog is not None:
                _, size = nvrtc.nvrtcGetProgramLogSize(prog)
                buf = b" " * size
                nvrtc.nvrtcGetProgramLog(prog, buf)
                detail = ": " + buf.decode(errors="replace").strip(" \x00\n")
            raise RuntimeError(f"NVRTC {what} failed ({err}){detail}")
        return result[1] if len(result) > 1 else None

    want = compute_capability[0] * 10 + compute_capability[1]
    try:
        archs = list(check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))
    except (AttributeError, RuntimeError):
        archs = [want]
    arch = max((a for a in archs if a <= want), default=min(archs))
    prog = check(nvrtc.nvrtcCreateProgram(SCATTER_KERNEL.encode(), b"scatter_kv.cu", 0, [], []),
                 "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture=compute_{arch}".encode()]
        check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "compile", prog)
        size = check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * size
        check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx


@dataclass(frozen=True)
class StagingLayout:
    """Offsets (bytes, 256-aligned) of the ForwardBatch arrays in the staging area, for given sizes."""

    num_tokens: int
    num_seqs: int
    width: int  # block-table columns
    num_logits: int
    offsets: dict[str, int]
    total: int

    FIELDS = (("input_ids", np.int64), ("positions", np.int64), ("cu_seqlens", np.int32), ("past_lens", np.int32),
              ("block_table", np.int32), ("logits_index", np.int64), ("slot_mapping", np.int64))

    @classmethod
    def of(cls, t: int, b: int, w: int, n_logits: int) -> StagingLayout:
        offsets: dict[str, int] = {}
        pos = 0
        for name, dtype in cls.FIELDS:
            offsets[name] = pos
            pos += -(-(cls._count(name, t, b, w, n_logits) * np.dtype(dtype).itemsize) // _ALIGN) * _ALIGN
        return cls(t, b, w, n_logits, offsets, pos)

    @staticmethod
    def _count(name: str, t: int, b: int, w: int, n_logits: int) -> int:
        return {"input_ids": t, "positions": t, "cu_seqlens": b + 1, "past_lens": b, "block_table": b * w,
                "logits_index": n_logits, "slot_mapping": t}[name]

    def shape(self, name: str) -> tuple[int, ...]:
        t, b = self.num_tokens, self.num_seqs
        return {"input_ids": (t,), "positions": (t,), "cu_seqlens": (b + 1,), "past_lens": (b,),
                "block_table": (b, self.width), "logits_index": (self.num_logits,), "slot_mapping": (t,)}[name]

    def views(self, host: np.ndarray) -> dict[str, np.ndarray]:
        """Numpy views of each array inside the (uint8) host staging buffer."""
        out = {}
        for name, dtype in self.FIELDS:
            shape = self.shape(name)
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out[name] = host[self.offsets[name]:self.offsets[name] + n].view(dtype).reshape(shape)
        return out


GRAPH_MODES = ("auto", "padded", "off")  # as the other CUDA backends; OPTIMIZE_CUDA_GRAPHS=0 means off
GRAPH_INPUTS = ("input_ids", "positions", "cu_seqlens", "past_lens", "block_table", "logits_index")


# ---------------------------------------------------------------------------------------------------


class TensorRTBackend:
    """ForwardBatch -> logits with the artifact's TensorRT engine, KV pools on the GPU (device 0)."""

    def __init__(self, model_path: Path, config: dict[str, Any], manifest: dict[str, Any],
                 num_blocks: int | None = None, graphs: str | None = None) -> None:
        model_path = Path(model_path)
        record = engine_record(manifest)
        if record is None:
            raise RuntimeError(f"{model_path.parent}: the manifest holds no TensorRT engine record "
                               f"(manifest['{ENGINE_KEY}']): rebuild the artifact with the build_engine pass")
        problem = engine_compatibility(record, present_machine())
        if problem is not None:
            raise RuntimeError(problem)
        missing = gpu.missing_for("tensorrt")
        if missing is not None:
            raise RuntimeError(missing)
        import pycuda.driver as cuda
        import tensorrt as trt

        self._cuda = cuda
        self._trt = trt
        self._driver, nvrtc = _cuda_python()
        kv_name = read_geometry(self, config, num_blocks)
        self.record = record
        graphs = graphs or ("off" if os.environ.get("OPTIMIZE_CUDA_GRAPHS", "1") == "0" else "auto")
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
        self._buckets: dict[int, tuple[Any, StagingLayout, Any]] = {}  # bucket -> (graph or None, layout, context)
        self.buckets: list[int] = []
        self.graph_mode = "off"  # "cuda": buckets replay CUDA graphs; "padded": bucket contexts run eagerly
        self.graph_replays = 0
        self._closed = False
        cuda.init()
        self._device = cuda.Device(0)
        self._cu_ctx = self._device.retain_primary_context()
        with self._current():
            self._stream = cuda.Stream(flags=1)  # CU_STREAM_NON_BLOCKING: capturable, no legacy-stream sync
            self._logger = trt_logger(trt)
            self._runtime = trt.Runtime(self._logger)
            self.engine = self._runtime.deserialize_cuda_engine(model_path.read_bytes())
            if self.engine is None:
                raise RuntimeError(f"{model_path}: TensorRT could not deserialize the engine: "
                                   + ("; ".join(self._logger.errors[-3:]) or "no reason given"))
            self._check_io(config, kv_name)
            self._allocate()
            self._make_contexts()
            ptx = compile_scatter_kernel(nvrtc, self._device.compute_capability())
            self._kernel = cuda.module_from_buffer(ptx).get_function("scatter_kv")
            self._kernel.prepare("PPPi")
            self._prepare_buckets(graphs)
        log.info("TensorRT %s engine on %s: KV pool %s x %d layers, profiles %s, graphs %s (buckets %s)",
                 record.get("tensorrt_version"), record.get("gpu"),
                 (self.num_blocks, self.block_size, self.kv_heads, self.head_dim), self.num_layers,
                 [p.get("name") for p in self._profiles], self.graph_mode, self.buckets)

    # -- setup ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """Make the GPU's primary context current on this thread (the engine may step on another thread)."""
        self._cu_ctx.push()
        try:
            yield
        finally:
            self._cuda.Context.pop()

    def _check_io(self, config: dict[str, Any], kv_name: str) -> None:
        trt, eng = self._trt, self.engine
        names = [eng.get_tensor_name(i) for i in range(eng.num_io_tensors)]
        self.input_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if eng.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        graph = config.get("graph", {})
        for kind, got, want in (("inputs", self.input_names, graph.get("inputs")),
                                ("outputs", self.output_names, graph.get("outputs"))):
            if want is not None and sorted(got) != sorted(want):
                raise RuntimeError(f"engine {kind} {got} differ from runtime.json {want}")
        shape_io = [n for n in self.input_names if eng.is_shape_inference_io(n)]
        if shape_io:
            raise RuntimeError(f"engine inputs {shape_io} are shape tensors (read on the host); this backend "
                               "stages every input on the device")
        self._dtypes = {n: dtype_name(eng.get_tensor_dtype(n)) for n in names}
        pool = self._dtypes["key_cache.0"]
        if pool not in ("FLOAT", "HALF", "BF16"):
            raise RuntimeError(f"KV pool element type {pool} is not supported by the TensorRT backend "
                               "(float32/float16/bfloat16)")
        expect = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16"}[pool]
        if kv_name != expect:
            raise RuntimeError(f"runtime.json kv_cache.dtype {kv_name!r} differs from the engine's pools ({expect})")
        if self._dtypes["logits"] != "FLOAT":
            raise RuntimeError(f"engine logits are {self._dtypes['logits']}, expected FLOAT")
        odd = {n: t for n, t in self._dtypes.items() if n.startswith(("new_", "key_cache.", "value_cache.")) and t != pool}
        if odd:  # the scatter copies the engine's K/V rows into the pools byte for byte
            raise RuntimeError(f"engine K/V tensors {odd} differ from the pools' element type {pool}")
        self.kv_elem_bytes = _DTYPE_BYTES[pool]
        # profiles: names from the record, limits from the engine itself
        self._profiles = list(self.record.get("profiles") or [])
        if len(self._profiles) != eng.num_optimization_profiles:
            raise RuntimeError(f"the engine has {eng.num_optimization_profiles} optimization profiles, its manifest "
                               f"record names {len(self._profiles)}")
        index = {p["name"]: i for i, p in enumerate(self._profiles)}
        if "mixed" not in index or "decode" not in index:
            raise RuntimeError(f"engine profiles {sorted(index)} lack 'mixed' or 'decode'")
        self._mixed, self._decode = index["mixed"], index["decode"]

        def max_of(name: str, profile: int, dim: int) -> int:
            return int(eng.get_tensor_profile_shape(name, profile)[2][dim])

        self.max_num_tokens = max_of("input_ids", self._mixed, 0)
        self.max_num_seqs = max_of("past_lens", self._mixed, 0)
        self.max_num_logits = max_of("logits_index", self._mixed, 0)
        self.max_blocks_per_seq = max_of("block_table", self._mixed, 1)
        self.max_decode_seqs = max_of("past_lens", self._decode, 0)
        max_blocks = max_of("key_cache.0", self._mixed, 0)
        if self.num_blocks > max_blocks:
            raise RuntimeError(f"{self.num_blocks} KV blocks requested; the engine's profiles take at most "
                               f"{max_blocks} (the build's runtime.num_kv_blocks): rebuild with a larger pool")

    def _allocate(self) -> None:
        cuda = self._cuda
        row = self.kv_heads * self.head_dim * self.kv_elem_bytes
        if row % 4:
            raise RuntimeError(f"a KV row of {row} bytes is not a multiple of 4 (the scatter copies 32-bit words)")
        self._row_words = row // 4
        self._threads = max(32, min(256, -(-self._row_words // 32) * 32))
        self.block_bytes = self.block_size * row
        pool_bytes = self.num_blocks * self.block_bytes
        self._pools: list[Any] = []  # k_0, v_0, k_1, v_1, ... (the graph's input order)
        for _ in range(2 * self.num_layers):
            mem = cuda.mem_alloc(pool_bytes)
            cuda.memset_d8(mem, 0, pool_bytes)
            self._pools.append(mem)
        self._new_kv = [cuda.mem_alloc(max(1, self.max_num_tokens * row)) for _ in range(2 * self.num_layers)]
        self._src_table = cuda.mem_alloc(16 * self.num_layers)
        self._dst_table = cuda.mem_alloc(16 * self.num_layers)
        cuda.memcpy_htod(self._src_table, np.array([int(m) for m in self._new_kv], np.uint64))
        cuda.memcpy_htod(self._dst_table, np.array([int(m) for m in self._pools], np.uint64))
        vocab = self.vocab_size
        self._decode_logits = cuda.mem_alloc(self.max_decode_seqs * vocab * 4)
        self._mixed_logits: Any = None
        self._mixed_logits_rows = 0
        self._host_logits = cuda.pagelocked_empty((self.max_decode_seqs, vocab), np.float32)
        biggest = StagingLayout.of(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq,
                                   self.max_num_logits)
        self._host_staging = cuda.pagelocked_empty(biggest.total, np.uint8)
        self._dev_staging = cuda.mem_alloc(biggest.total)

    def _new_context(self, profile: int) -> Any:
        trt, eng = self._trt, self.engine
        ctx = eng.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if ctx is None:
            raise RuntimeError(f"TensorRT could not create an execution context: {'; '.join(self._logger.errors[-3:])}")
        if hasattr(ctx, "set_device_memory"):
            ctx.set_device_memory(int(self._activations), self._activation_bytes)
        else:  # TensorRT 10.0
            ctx.device_memory = int(self._activations)
        ctx.set_optimization_profile_async(profile, self._stream.handle)
        self._stream.synchronize()
        pool_shape = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        for i, mem in enumerate(self._pools):
            name = f"{'key' if i % 2 == 0 else 'value'}_cache.{i // 2}"
            self._set_shape(ctx, name, pool_shape)
            ctx.set_tensor_address(name, int(mem))
        for i, mem in enumerate(self._new_kv):
            ctx.set_tensor_address(f"new_{'key' if i % 2 == 0 else 'value'}.{i // 2}", int(mem))
        return ctx

    def _make_contexts(self) -> None:
        eng = self.engine
        sizes = []
        for i in range(eng.num_optimization_profiles):
            if hasattr(eng, "get_device_memory_size_for_profile_v2"):
                sizes.append(int(eng.get_device_memory_size_for_profile_v2(i)))
            else:  # TensorRT 10.0
                sizes.append(int(eng.get_device_memory_size_for_profile(i)))
        self._activation_bytes = max(max(sizes, default=0), 256)
        self._activations = self._cuda.mem_alloc(self._activation_bytes)
        self._ctx_mixed = self._new_context(self._mixed)
        self._ctx_decode = self._new_context(self._decode)
        self._ctx_decode.set_tensor_address("logits", int(self._decode_logits))

    @staticmethod
    def _set_shape(ctx: Any, name: str, shape: tuple[int, ...]) -> None:
        if not ctx.set_input_shape(name, shape):
            raise ValueError(f"TensorRT refused shape {list(shape)} for input {name!r} (outside the engine's "
                             "optimization profile)")

    def _prepare_buckets(self, mode: str) -> None:
        """One execution context per decode-bucket profile with every shape and address fixed; with
        mode 'auto' each bucket's step (engine + scatter) is captured as a CUDA graph after a warm-up run."""
        bucket_profiles = [(i, int(p["bucket"])) for i, p in enumerate(self._profiles) if p.get("bucket")]
        self.buckets = sorted(b for _, b in bucket_profiles)
        if mode == "off" or not bucket_profiles:
            return
        driver = self._driver
        stream = driver.CUstream(self._stream.handle)
        for index, b in bucket_profiles:
            layout = StagingLayout.of(b, b, self.max_blocks_per_seq, b)
            try:
                ctx = self._new_context(index)
                ctx.set_tensor_address("logits", int(self._decode_logits))
                for name in GRAPH_INPUTS:
                    self._set_shape(ctx, name, layout.shape(name))
                    ctx.set_tensor_address(name, int(self._dev_staging) + layout.offsets[name])
                self._stage_padding(layout, 0)  # a valid step of b padding rows: nothing is written
                self._cuda.memcpy_htod_async(self._dev_staging, self._host_staging[:layout.total], self._stream)
                if not ctx.execute_async_v3(self._stream.handle):  # warm-up, as TensorRT asks before a capture
                    raise RuntimeError("execute_async_v3 failed: " + ("; ".join(self._logger.errors[-3:]) or "?"))
                self._stream.synchronize()
            except Exception as e:  # the decode profile still serves these batch sizes
                log.warning("decode bucket %d: its profile does not run (%s); decode uses the decode profile", b, e)
                continue
            graph_exec = None
            if mode == "auto":
                try:
                    graph_exec = self._capture(ctx, stream, b, layout)
                except Exception as e:  # a bucket that cannot be captured runs its padded step eagerly
                    log.warning("decode bucket %d: no CUDA graph (%s); its padded step runs eagerly", b, e)
                    self._stream.synchronize()
            self._buckets[b] = (graph_exec, layout, ctx)
        self.graph_mode = "cuda" if any(g is not None for g, _, _ in self._buckets.values()) else "padded"

    def _capture(self, ctx: Any, stream: Any, b: int, layout: StagingLayout) -> Any:
        driver = self._driver
        _drv(driver, driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
             "cuStreamBeginCapture")
        ok = False
        try:
            ok = bool(ctx.execute_async_v3(self._stream.handle))
            self._scatter(b, int(self._dev_staging) + layout.offsets["slot_mapping"])
        finally:
            graph = _drv(driver, driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        if not ok:
            raise RuntimeError("execute_async_v3 failed during capture: " + "; ".join(self._logger.errors[-3:]))
        instantiate = getattr(driver, "cuGraphInstantiateWithFlags", None) or driver.cuGraphInstantiate
        graph_exec = _drv(driver, instantiate(graph, 0), "cuGraphInstantiate")
        driver.cuGraphDestroy(graph)
        return graph_exec

    # -- per step ------------------------------------------------------------------------------------

    def _stage_padding(self, layout: StagingLayout, n_real: int) -> dict[str, np.ndarray]:
        """Fill rows n_real.. of a bucket layout with padding rows; returns the views."""
        v = layout.views(self._host_staging)
        b = layout.num_seqs
        v["input_ids"][n_real:] = 0
        v["positions"][n_real:] = 0
        v["cu_seqlens"][n_real + 1:] = np.arange(n_real + 1, b + 1, dtype=np.int32)
        if n_real == 0:
            v["cu_seqlens"][0] = 0
        v["past_lens"][n_real:] = 0
        v["block_table"][n_real:] = -1
        v["logits_index"][:] = np.arange(b, dtype=np.int64)
        v["slot_mapping"][n_real:] = -1
        return v

    def _scatter(self, num_tokens: int, slots_address: int) -> None:
        if num_tokens:
            self._kernel.prepared_async_call((num_tokens, 2 * self.num_layers), (self._threads, 1, 1), self._stream,
                                             int(self._src_table), int(self._dst_table), slots_address,
                                             self._row_words)

    def _check(self, batch: ForwardBatch) -> int:
        """Validate what the GPU would otherwise read or write out of bounds; returns the block-table width
        the step needs (blocks holding past tokens)."""
        t, b = batch.num_tokens, batch.num_seqs
        if t > self.max_num_tokens or b > self.max_num_seqs or len(batch.logits_index) > self.max_num_logits:
            raise ValueError(f"step of {t} tokens, {b} sequences, {len(batch.logits_index)} logits exceeds the "
                             f"engine's profiles (at most {self.max_num_tokens} tokens, {self.max_num_seqs} "
                             f"sequences, {self.max_num_logits} logits: the build's runtime limits)")
        if t and (int(batch.slot_mapping.min()) < 0 or int(batch.slot_mapping.max()) >= self.num_blocks * self.block_size):
            raise ValueError("ForwardBatch.slot_mapping out of the KV pool's range")
        if t and (int(batch.input_ids.min()) < 0 or int(batch.input_ids.max()) >= self.vocab_size):
            raise ValueError("ForwardBatch.input_ids out of the vocabulary's range")
        if batch.logits_index.size and (int(batch.logits_index.min()) < 0 or int(batch.logits_index.max()) >= t):
            raise ValueError("ForwardBatch.logits_index out of range")
        need = max(1, -(-int(batch.past_lens.max(initial=0)) // self.block_size))
        if need > self.max_blocks_per_seq:
            raise ValueError(f"a sequence with {int(batch.past_lens.max())} cached tokens exceeds the engine's "
                             f"{self.max_blocks_per_seq} blocks per sequence (the build's max_model_len)")
        if batch.block_table.shape[1] < need and int(batch.past_lens.max(initial=0)) > 0:
            raise ValueError(f"ForwardBatch.block_table has {batch.block_table.shape[1]} columns; the past needs {need}")
        used = batch.block_table[:, :need]
        if used.size and int(used.max()) >= self.num_blocks:
            raise ValueError("ForwardBatch.block_table names a block outside the pool")
        return need

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run one step: returns logits [len(logits_index), vocab] float32 and writes the step's K/V."""
        if self._closed:
            raise RuntimeError("the TensorRT backend is closed")
        t, b = batch.num_tokens, batch.num_seqs
        if t == 0:
            return np.zeros((len(batch.logits_index), self.vocab_size), np.float32)
        need = self._check(batch)
        decode = t == b and np.array_equal(batch.cu_seqlens, np.arange(b + 1, dtype=batch.cu_seqlens.dtype))
        with self._current():
            if decode:
                bucket = next((k for k in self.buckets if k >= b and k in self._buckets), None)
                if bucket is not None:
                    return self._run_bucket(batch, bucket, need)
            return self._run(batch, need, decode)

    def _fill(self, v: dict[str, np.ndarray], batch: ForwardBatch, need: int) -> None:
        t, b = batch.num_tokens, batch.num_seqs
        v["input_ids"][:t] = batch.input_ids
        v["positions"][:t] = batch.positions
        v["cu_seqlens"][:b + 1] = batch.cu_seqlens
        v["past_lens"][:b] = batch.past_lens
        cols = min(need, batch.block_table.shape[1])
        v["block_table"][:b, :cols] = batch.block_table[:, :cols]
        v["block_table"][:b, cols:] = -1
        v["slot_mapping"][:t] = batch.slot_mapping

    def _run_bucket(self, batch: ForwardBatch, bucket: int, need: int) -> np.ndarray:
        """A decode step padded to `bucket` rows: the bucket's CUDA graph, or its context run eagerly."""
        cuda = self._cuda
        graph_exec, layout, ctx = self._buckets[bucket]
        b = batch.num_seqs
        v = self._stage_padding(layout, b)
        self._fill(v, batch, need)
        cuda.memcpy_htod_async(self._dev_staging, self._host_staging[:layout.total], self._stream)
        if graph_exec is not None:
            _drv(self._driver, self._driver.cuGraphLaunch(graph_exec, self._driver.CUstream(self._stream.handle)),
                 "cuGraphLaunch")
            self.graph_replays += 1
        else:
            if not ctx.execute_async_v3(self._stream.handle):
                raise RuntimeError("TensorRT execute_async_v3 failed: " + ("; ".join(self._logger.errors[-3:]) or "?"))
            self._scatter(bucket, int(self._dev_staging) + layout.offsets["slot_mapping"])
        host = self._host_logits[:b]
        cuda.memcpy_dtoh_async(host, self._decode_logits, self._stream)
        self._stream.synchronize()
        return host[batch.logits_index]

    def _run(self, batch: ForwardBatch, need: int, decode: bool) -> np.ndarray:
        cuda = self._cuda
        t, b, n_logits = batch.num_tokens, batch.num_seqs, len(batch.logits_index)
        layout = StagingLayout.of(t, b, need, n_logits)
        v = layout.views(self._host_staging)
        self._fill(v, batch, need)
        v["logits_index"][:] = batch.logits_index
        decode = decode and b <= self.max_decode_seqs and n_logits <= self.max_decode_seqs
        ctx = self._ctx_decode if decode else self._ctx_mixed
        if decode:
            logits = self._decode_logits
        else:
            logits = self._mixed_logits_buffer(n_logits)
            ctx.set_tensor_address("logits", int(logits))
        for name in GRAPH_INPUTS:
            self._set_shape(ctx, name, layout.shape(name))
            ctx.set_tensor_address(name, int(self._dev_staging) + layout.offsets[name])
        cuda.memcpy_htod_async(self._dev_staging, self._host_staging[:layout.total], self._stream)
        if not ctx.execute_async_v3(self._stream.handle):
            raise RuntimeError("TensorRT execute_async_v3 failed: " + ("; ".join(self._logger.errors[-3:]) or "?"))
        self._scatter(t, int(self._dev_staging) + layout.offsets["slot_mapping"])
        host = self._host_logits_rows(n_logits)
        cuda.memcpy_dtoh_async(host, logits, self._stream)
        self._stream.synchronize()
        return host.copy()

    def _mixed_logits_buffer(self, rows: int) -> Any:
        if rows > self._mixed_logits_rows:
            cap = min(self.max_num_logits, max(rows, 2 * self._mixed_logits_rows, self.max_decode_seqs))
            self._mixed_logits = None
            self._mixed_logits = self._cuda.mem_alloc(cap * self.vocab_size * 4)
            self._mixed_logits_rows = cap
        return self._mixed_logits

    def _host_logits_rows(self, rows: int) -> np.ndarray:
        if rows > self._host_logits.shape[0]:
            cap = min(self.max_num_logits, max(rows, 2 * self._host_logits.shape[0]))
            self._host_logits = self._cuda.pagelocked_empty((cap, self.vocab_size), np.float32)
        return self._host_logits[:rows]

    # -- KV cache ------------------------------------------------------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.num_layers * self.num_blocks * self.block_bytes

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst in every layer's pools, pair after pair (copy-on-write), on the GPU."""
        for src, dst in pairs:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
                raise ValueError(f"copy_blocks: block pair ({src}, {dst}) outside the pool of {self.num_blocks}")
        if not len(pairs):
            return
        bb = self.block_bytes
        with self._current():
            for src, dst in pairs:
                for pool in self._pools:
                    self._cuda.memcpy_dtod_async(int(pool) + dst * bb, int(pool) + src * bb, bb, self._stream)
            self._stream.synchronize()

    def pool_contents(self, layer: int, kind: str) -> np.ndarray:
        """A host copy of one pool [num_blocks, block_size, kv_heads, head_dim] (bfloat16 as raw uint16)."""
        np_dtype = {4: np.float32, 2: np.float16 if self._dtypes["key_cache.0"] == "HALF" else np.uint16}
        out = np.empty((self.num_blocks, self.block_size, self.kv_heads, self.head_dim),
                       np_dtype[self.kv_elem_bytes])
        with self._current():
            self._cuda.memcpy_dtoh(out, self._pools[2 * layer + (0 if kind == "key" else 1)])
        return out

    def close(self) -> None:
        """Release the CUDA graphs, contexts and device memory (also on garbage collection)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            with self._current():
                self._stream.synchronize()
                for graph_exec, *_ in self._buckets.values():
                    if graph_exec is not None:
                        self._driver.cuGraphExecDestroy(graph_exec)
                self._buckets.clear()
                self._ctx_mixed = self._ctx_decode = None
                self.engine = None
                self._pools = self._new_kv = []
                self._activations = self._decode_logits = self._mixed_logits = None
                self._dev_staging = self._src_table = self._dst_table = None
        except Exception as e:  # pragma: no cover - teardown at interpreter exit
            log.debug("TensorRT backend teardown: %s", e)

    def __del__(self) -> None:
        self.close()


def _drv(driver: Any, result: Any, what: str) -> Any:
    """The value of a cuda-python driver call, or RuntimeError naming the CUDA error."""
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return result[1] if len(result) > 1 else None


__all__ = ["ENGINE_KEY", "SCATTER_KERNEL", "StagingLayout", "TensorRTBackend", "compile_scatter_kernel",
           "engine_compatibility", "engine_record", "present_machine", "trt_logger"]
