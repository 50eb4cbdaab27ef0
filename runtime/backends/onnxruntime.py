"""ONNX Runtime backend: runs an artifact's model.onnx on one ForwardBatch and owns the KV pools.

The graph reads the per-layer pools [num_blocks, block_size, kv_heads, head_dim] and returns the
step's new K/V; this backend scatters them into the pools at `slot_mapping` (C core) after the
run. Numpy arrays are handed to ONNX Runtime without copies. A graph whose attention node writes the
pools itself (runtime.json graph.kv_write "graph": the paged_cpu variant, optimize.PagedAttention)
gets the block table up to the last block any of the step's tokens lands in, and no scatter; only its
logits are fetched. The package's custom-op library is registered with the session for such graphs and
for any other whose runtime.json lists the `optimize` domain (graph.custom_op_domains: MatMulBf16).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from runtime import ort_releases
from runtime.backends import read_geometry
from runtime.core import copy_blocks, scatter_kv_layers
from runtime.forward_batch import ForwardBatch
from runtime.kernels.paged_attention_cpu import register

log = logging.getLogger(__name__)

# KV pool element types by runtime.json kv_cache.dtype. A quantized cache (quantize_kv_cache) is
# stored as int8, or as uint8 holding E4M3 bit patterns (the graph reads uint8 and decodes; its new
# K/V outputs are float8e4m3fn, which ONNX Runtime hands back as uint8).
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "float8_e4m3fn": np.uint8}


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def fix_mmap_threshold() -> int | None:
    """Give glibc malloc a fixed mmap threshold (OPTIMIZE_MMAP_THRESHOLD bytes, default 1 MiB; 0 leaves
    glibc's default); returns the threshold set, None where nothing was set.

    By default glibc raises the threshold (up to 32 MiB) each time a large mmapped block is freed, after
    which a long prefill's activation buffers (without ONNX Runtime's CPU arena: OPTIMIZE_ORT_ARENA=0) come
    from the heap and stay resident: peak RSS of llama-110m int8 at W3 was 604-612 MB or 738 MB from run to run.
    A fixed threshold keeps them mmapped, so they go back to the system when freed (604-606 MB in three
    runs; W2 TTFT and W3 throughput within the machine's noise). Process-wide, glibc only."""
    threshold = int(os.environ.get("OPTIMIZE_MMAP_THRESHOLD", str(1 << 20)))
    if threshold <= 0 or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        ok = ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):  # pragma: no cover - not glibc after all
        return None
    return threshold if ok == 1 else None


def _resident_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zero-filled array whose pages are all written (resident), unlike np.zeros' lazily mapped ones."""
    a = np.empty(shape, dtype=dtype)
    a.fill(0)
    return a


class OnnxRuntimeBackend:
    """ForwardBatch -> logits on ONNX Runtime (CPU execution provider by default)."""

    def __init__(
        self,
        model_path: Path,
        config: dict[str, Any],
        num_blocks: int | None = None,
        providers: list[str] | None = None,
        intra_op_threads: int | None = None,
        cpu_isa: str | None = None,
    ) -> None:
        try:
            import onnxruntime as ort
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError("onnxruntime is not installed: pip install onnxruntime") from e
        self._scatter = scatter_kv_layers
        self._copy_blocks = copy_blocks
        kv_name = read_geometry(self, config, num_blocks)
        dtype = _NP_DTYPES.get(kv_name)
        if dtype is None:
            raise RuntimeError(f"KV cache dtype {kv_name!r} is not supported by the ONNX Runtime backend")
        if kv_name == "float8_e4m3fn":  # a release that cannot return the step's float8 K/V: said now
            why = ort_releases.missing(ort_releases.FP8_KV_CACHE, ort.__version__)
            if why is not None:
                raise RuntimeError(f"{model_path.name}: {why}")
        self.kv_dtype = dtype
        so = ort.SessionOptions()
        threads = intra_op_threads or int(os.environ.get("OPTIMIZE_ORT_THREADS", "0"))
        if threads:
            so.intra_op_num_threads = threads
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ONNX Runtime's CPU arena, without memory patterns: every step's activation buffers are carved
        # from memory the process keeps, so a step does not first-touch (page-fault through) fresh
        # mmapped buffers. bench/arena.py, llama-110m int8kv, AVX2 path: 3.1k against 11.8k minor faults
        # per 1,024-token prefill, 6.2k against 366k per W3 run; W3 1179 against 942 tok/s (paired
        # rounds), W2 TTFT -1.8 %, W1 unchanged; peak RSS at W3 400 against 382 MB. Memory patterns (one
        # planned block per input shape, ONNX Runtime's default with the arena) are off: with them the
        # arena kept every shape's block (peak RSS at W3 491 MB). OPTIMIZE_ORT_ARENA=0 runs without the
        # arena (memory patterns on, glibc's mmap threshold fixed: a long prefill's buffers go back to
        # the system after the step).
        arena = os.environ.get("OPTIMIZE_ORT_ARENA", "1") != "0"
        so.enable_cpu_mem_arena = arena
        so.enable_mem_pattern = not arena
        if not arena and "CPUExecutionProvider" in (providers or ["CPUExecutionProvider"]):
            fix_mmap_threshold()
        # ONNX Runtime's profiler (every node's kernel time; bench/profile_nodes.py reads it):
        # OPTIMIZE_ORT_PROFILE=<file prefix>; the trace is written by end_profiling()
        profile = os.environ.get("OPTIMIZE_ORT_PROFILE")
        if profile:
            so.enable_profiling = True
            so.profile_file_prefix = profile
        self.kv_in_graph = config["graph"].get("kv_write", "runtime") == "graph"
        self.kernel_paths: dict[str, Any] | None = None  # the package's C ops and their code paths, when used
        # the package's C library serves the `optimize` domain (attention, QuantizeRows, MatMulBf16); an
        # artifact built before runtime.json listed the domains has it exactly when its kernel writes the K/V
        if self.kv_in_graph or "optimize" in config["graph"].get("custom_op_domains", []):
            # the ops' code path: `cpu_isa` (avx512 / avx2 / baseline), else OPTIMIZE_CPU_ISA, else the CPU's widest
            self.kernel_paths = register(so, isa=cpu_isa)
        providers = providers or ["CPUExecutionProvider"]
        available = ort.get_available_providers()
        missing = [p for p in providers if p not in available]
        if missing:
            raise RuntimeError(
                f"ONNX Runtime execution provider(s) {missing} not available (have {available}); "
                "install onnxruntime-gpu for CUDA, or build a CPU target"
            )
        try:
            self.session = ort.InferenceSession(str(model_path), so, providers=providers)
        except Exception as e:  # ONNX Runtime raises its own exception types (InvalidGraph, Fail)
            why = ort_releases.missing(ort_releases.FP8_ACTIVATIONS_CPU, ort.__version__)
            if why is not None and "float8" in str(e) and "CPUExecutionProvider" in providers:
                raise RuntimeError(f"{model_path.name}: {why}") from e
            raise
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._logits_only = self.output_names[:1]
        expected = config["graph"]["inputs"]
        if self.input_names != expected:
            raise RuntimeError(f"{model_path.name}: graph inputs {self.input_names} differ from runtime.json {expected}")
        shape = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        # The pools are written through once here, so that their memory is resident from the start: the
        # deploy commits to it at load (a machine without it fails now, not under load), and no step pays
        # the page faults of first touching its blocks (np.zeros maps zero pages lazily: the first requests
        # of a fresh process took a fault per 4 KiB / 2 MiB of every new block).
        self.k_pools = [_resident_zeros(shape, self.kv_dtype) for _ in range(self.num_layers)]
        self.v_pools = [_resident_zeros(shape, self.kv_dtype) for _ in range(self.num_layers)]
        self._kv_feeds: dict[str, np.ndarray] = {}
        for i in range(self.num_layers):
            self._kv_feeds[f"key_cache.{i}"] = self.k_pools[i]
            self._kv_feeds[f"value_cache.{i}"] = self.v_pools[i]
        log.info("ONNX Runtime session on %s, KV pool %s x %d layers", providers, shape, self.num_layers)

    def end_profiling(self) -> str | None:
        """Write ONNX Runtime's profile (when OPTIMIZE_ORT_PROFILE enabled it) and return its path."""
        path = self.session.end_profiling()
        return path or None

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * sum(p.nbytes for p in self.k_pools)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst, pair after pair, in every layer's K and V pool (copy-on-write:
        `ScheduledBatch.block_copies`, applied before the step's forward). Validates all first."""
        if len(pairs):
            self._copy_blocks(self.k_pools + self.v_pools, pairs)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run one step: returns logits [len(logits_index), vocab] float32 and writes the step's K/V."""
        # The table is trimmed to the blocks the graph reads: the past (cached) tokens' when the step's own
        # K/V come from the step itself, up to each sequence's last token when the attention node writes
        # them through the table (kv_in_graph).
        ends = batch.past_lens + np.diff(batch.cu_seqlens) if self.kv_in_graph else batch.past_lens
        past_blocks = max(1, -(-int(ends.max(initial=0)) // self.block_size))
        feeds = {
            "input_ids": batch.input_ids,
            "positions": batch.positions,
            "cu_seqlens": batch.cu_seqlens,
            "past_lens": batch.past_lens,
            "block_table": np.ascontiguousarray(batch.block_table[:, :past_blocks]),
            "logits_index": batch.logits_index,
            **self._kv_feeds,
        }
        if self.kv_in_graph:
            return self.session.run(self._logits_only, feeds)[0]
        outs = self.session.run(None, feeds)
        new_k = outs[1::2]
        new_v = outs[2::2]
        self._scatter(self.k_pools + self.v_pools, list(new_k) + list(new_v), batch.slot_mapping)
        return outs[0]
