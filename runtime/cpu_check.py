"""What the runtime says at load about the package's C ops on this CPU, and `--retune`.

- `measured_on(manifest)`: the CPU code path (and features) the build's attention autotune measured on
  (select_attention's stats `measured_on`, recorded only when the build timed its candidates);
  `isa_warning` compares it with the path this machine runs: the variant was chosen by timings on another
  instruction set, so the choice may not be the fastest here.
- `bf16_line`: for artifacts with bfloat16 products, one line at load naming MatMulBf16's path, a warning
  where that path is slower than float32 for prompt processing (every path without AVX-512 BF16).
- `int8_warning`: for artifacts whose int8 weights use the full range (quantize_int8 `weight_range: full`),
  one line at load on a CPU without an int8 dot product (VNNI / AMX, read from /proc/cpuinfo): ONNX Runtime's
  uint8 x int8 GEMM then sums pairs of products in saturating 16-bit lanes, so the served numbers differ from
  the ones the build's quality gate measured on a CPU that has it.
- `retune`: the attention variant is part of the graph (capture writes it), so it cannot change at load;
  what can is the C ops' code path. `retune` times a decode step and a prefill of the artifact itself on
  each path this CPU runs (avx512 / avx2 / baseline) and returns the fastest, which the engine then loads.

Imports neither torch nor onnx.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from runtime.backends.onnxruntime import OnnxRuntimeBackend
from runtime.forward_batch import ForwardBatch
from runtime.kernels import paged_attention_cpu as pk

log = logging.getLogger(__name__)

DECODE_TOKENS = 128
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # where MLAS's uint8 x int8 GEMM sums in int32  # decode steps per prefill in the retune score (as the build's autotune weighs them)


def measured_on(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """select_attention's `measured_on` record ({"isa", "ops", "cpu_features"}) or None."""
    for p in manifest.get("passes", []):
        if p.get("name") == "select_attention" and isinstance(p.get("stats"), dict):
            rec = p["stats"].get("measured_on")
            return rec if isinstance(rec, dict) else None
    return None


def isa_warning(manifest: dict[str, Any], paths: dict[str, Any]) -> str | None:
    """One line when the build's autotune measured on another code path than this machine runs, else None."""
    rec = measured_on(manifest)
    if rec is None or rec.get("isa") == paths["isa"]:
        return None
    choice = next((p.get("stats", {}).get("choice") for p in manifest.get("passes", [])
                   if p.get("name") == "select_attention"), None)
    return (f"the attention variant ({choice}) was chosen by timings on the {rec.get('isa')} code path; this CPU "
            f"runs {paths['isa']} (available: {', '.join(paths['available'])}): the choice may not be the fastest "
            "here (rebuild on this machine to re-measure it, or serve with --retune to re-measure the code path)")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags as Linux lists them, or None where they cannot be read."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def int8_warning(manifest: dict[str, Any]) -> str | None:
    """One line when the artifact's int8 weights use the full range [-127, 127] and this CPU has no int8 dot
    product (its flags read only then); None otherwise (reduced-range codes are exact on every x86 CPU)."""
    stats = next((p.get("stats") for p in manifest.get("passes", []) if p.get("name") == "quantize_int8"), None)
    if not isinstance(stats, dict) or stats.get("weight_range") != "full":
        return None
    flags = cpu_flags()
    if flags is not None and set(INT8_DOT_FLAGS) & flags:
        return None
    cpu = "this CPU has no VNNI or AMX" if flags is not None else "this CPU's features cannot be read"
    return (f"int8 weights in the full range (quantize_int8 weight_range: full) and {cpu}: ONNX Runtime's uint8 x "
            "int8 GEMM sums pairs of products in saturating 16-bit lanes here, so outputs can differ from the exact "
            "products the quality gate measured; rebuild with weight_range: reduced (exact on every x86 CPU)")


def bf16_line(paths: dict[str, Any]) -> tuple[int, str]:
    """(log level, one line) for an artifact with bfloat16 products (target.matmul: bfloat16) on this CPU's
    MatMulBf16 path. Without AVX-512 BF16 the bf16 weights are widened to float32 in registers: a decode
    step (one row per product) reads half the bytes of float32 and measured faster than float32 (bench/isa.py),
    but products of many rows (prompt processing) are compute-bound and measured slower than ONNX Runtime's
    float32 GEMM: a warning says so."""
    path = paths["ops"].get("MatMulBf16", paths["isa"])
    if path == "avx512_bf16":
        return logging.INFO, "bfloat16 products on AVX-512 BF16 (vdpbf16ps)"
    return logging.WARNING, (f"bfloat16 products on the {path} path (this CPU has no AVX-512 BF16): weights are "
                             "widened to float32 in registers; decode reads half the bytes of float32, but prompt "
                             "processing can be slower than float32 (bench/isa.py measures both on this machine)")


def retune(model_path: Path, config: dict[str, Any], threads: int | None) -> tuple[str, dict[str, float]]:
    """The fastest code path for this artifact here: per path this CPU runs, one batch-1 decode step at a
    past of min(255, max_model_len - 1) and one prefill of min(128, max_model_len) tokens through the
    runtime's backend (median of 5 each, paths alternating); score = prefill + DECODE_TOKENS x decode (ms).
    Returns (path, {path: score})."""
    paths = pk.kernel_paths()["available"]
    bs = int(config["kv_cache"]["block_size"])
    max_len = int(config["scheduler"]["max_model_len"])
    past, prompt = min(255, max_len - 1), min(128, max_len)
    blocks = -(-(past + 1) // bs)

    def batch(p: int, new: int) -> ForwardBatch:
        table = np.arange(blocks, dtype=np.int32)[None, :]
        pos = np.arange(p, p + new, dtype=np.int64)
        return ForwardBatch(input_ids=(pos % 100 + 3).astype(np.int64), positions=pos,
                            cu_seqlens=np.array([0, new], np.int32), past_lens=np.array([p], np.int32),
                            block_table=table, slot_mapping=table[0, pos // bs].astype(np.int64) * bs + pos % bs,
                            logits_index=np.array([new - 1], np.int64))

    decode, prefill = batch(past, 1), batch(0, prompt)
    backends = {p: OnnxRuntimeBackend(model_path, config, num_blocks=blocks + 1, intra_op_threads=threads, cpu_isa=p)
                for p in paths}
    samples: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(5):
        for p, b in backends.items():
            b.forward(prefill)
            t = time.perf_counter()
            b.forward(prefill)
            pre = time.perf_counter() - t
            b.forward(decode)
            t = time.perf_counter()
            b.forward(decode)
            samples[p].append(1000 * (pre + DECODE_TOKENS * (time.perf_counter() - t)))
    scores = {p: round(statistics.median(v), 3) for p, v in samples.items()}
    best = min(paths, key=lambda p: (scores[p], paths.index(p)))
    return best, scores
