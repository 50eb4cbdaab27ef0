"""Measure the valid attention variants on this machine (like TensorRT's tactic selection).

Each candidate is a one-decoder-layer model with the checkpoint's real attention dimensions (hidden
size, heads, KV heads, head dim, q/k norm, QKV bias, layer 0's sliding window) and random weights
(seeded; the vocabulary is cut to 512 rows, which only the embedding and lm_head see), captured and
lowered by the same functions as the capture and lower_onnx passes, and run by the runtime's own
ONNX Runtime backend (same session options, the step's block-table trim and the KV scatter).

Shapes (`shapes()`): decode of 1, 8 and 32 sequences with a context of min(1024, max_model_len)
tokens each, and one prefill of min(512, max_model_len) tokens without past. Per shape: one warm-up
run each, then the candidates take turns, one run each, until every one has `min_runs` runs and
about `budget_s` seconds each have passed (so load from other processes on a shared machine falls on
all candidates alike); the median is kept. Score: the time to serve one request of the prefill's
length plus `DECODE_TOKENS` (128) output tokens, with its decode steps shared by the batch, averaged
over the decode batch sizes: prefill_ms + 128 * mean_b(decode_ms(b) / b). (A plain sum of the
step times would let the one 512-token prefill outweigh every decode shape, though a server runs
far more decode steps than prefills.) Before timing, every candidate runs one mixed batch (prefill chunks with and
without past, decode tokens, blocks out of order) and its logits are compared with the first
candidate's: a candidate more than `tolerance` off is invalid (the reason is recorded). The result names
the CPU code path the package's C ops ran on (`cpu_paths`: isa and per-op paths, from the library's
`optimize_kernel_paths()`), which select_attention records in the manifest as `measured_on`.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from compiler.attention import kv_write
from compiler.export import export_forward_batch, lower_exported
from runtime.backends.onnxruntime import OnnxRuntimeBackend
from runtime.forward_batch import ForwardBatch
from runtime.kernels.paged_attention_cpu import KernelLibraryError, kernel_paths

TOLERANCE = 1e-3
DECODE_TOKENS = 128  # output tokens per request in the score


def score(median_ms: dict[str, float], specs: list[dict[str, Any]]) -> float:
    """Milliseconds to serve one request: its prefill + DECODE_TOKENS decode steps shared by the batch,
    averaged over the decode batch sizes measured."""
    decode = [median_ms[s["name"]] / s["batch"] for s in specs if s["new"] == 1]
    prefill = sum(median_ms[s["name"]] for s in specs if s["new"] > 1)
    return prefill + DECODE_TOKENS * (sum(decode) / len(decode) if decode else 0.0)


def shapes(max_model_len: int) -> list[dict[str, Any]]:
    ctx = min(1024, max_model_len)
    prefill = min(512, max_model_len)
    out = [{"name": f"decode_b{b}_ctx{ctx}", "batch": b, "past": ctx - 1, "new": 1} for b in (1, 8, 32)]
    out.append({"name": f"prefill_{prefill}", "batch": 1, "past": 0, "new": prefill})
    return out


def tuning_config(cfg: Any) -> Any:
    """The checkpoint's config cut to one decoder layer (layer 0's window) and a 512-token vocabulary."""
    return dataclasses.replace(cfg, num_layers=1, vocab_size=min(cfg.vocab_size, 512),
                               sliding_windows=tuple(cfg.sliding_windows[:1]), tie_word_embeddings=False)


def _batch(spec: dict[str, Any], block_size: int, vocab: int, rng: np.random.Generator, first_block: int) -> Any:
    b, past, new = spec["batch"], spec["past"], spec["new"]
    per_seq = -(-(past + new) // block_size)
    table = (first_block + np.arange(b * per_seq, dtype=np.int32)).reshape(b, per_seq)
    pos = np.concatenate([np.arange(past, past + new, dtype=np.int64) for _ in range(b)])
    slots = np.concatenate([table[i, np.arange(past, past + new) // block_size].astype(np.int64) * block_size
                            + np.arange(past, past + new) % block_size for i in range(b)])
    cu = (np.arange(b + 1) * new).astype(np.int32)
    return ForwardBatch(input_ids=rng.integers(0, vocab, b * new).astype(np.int64), positions=pos, cu_seqlens=cu,
                        past_lens=np.full(b, past, np.int32), block_table=table, slot_mapping=slots,
                        logits_index=(cu[1:] - 1).astype(np.int64))


def _mixed_batch(block_size: int, vocab: int, rng: np.random.Generator) -> Any:
    """Prefill without past, chunks with past, decode tokens; blocks out of order."""
    past, new = [0, 37, 70, 5, 16], [20, 13, 1, 1, 16]
    need = [-(-(p + n) // block_size) for p, n in zip(past, new, strict=True)]
    perm = rng.permutation(sum(need)).astype(np.int32)
    table = np.full((len(past), max(need)), -1, np.int32)
    k = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[k:k + n]
        k += n
    pos = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(past, new, strict=True)])
    seq = np.repeat(np.arange(len(past)), new)
    slots = table[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    cu = np.cumsum([0] + new).astype(np.int32)
    return ForwardBatch(input_ids=rng.integers(0, vocab, len(pos)).astype(np.int64), positions=pos, cu_seqlens=cu,
                        past_lens=np.array(past, np.int32), block_table=table, slot_mapping=slots,
                        logits_index=np.arange(len(pos), dtype=np.int64))


def build_candidate(cfg: Any, block_size: int, variant: str, opset: int = 21) -> Any:
    """One-layer ModelProto of `variant` (seeded random weights: the same for every variant)."""
    import torch

    from compiler.models.llama import LlamaForwardBatchModel

    torch.manual_seed(0)
    model = LlamaForwardBatchModel(cfg, block_size, attention=variant)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.05)
    model.eval()
    exported, _ = export_forward_batch(model, cfg, block_size, torch.float32)
    return lower_exported(exported, cfg.num_layers, opset, True, variant)


def autotune(cfg: Any, block_size: int, max_model_len: int, variants: list[str], budget_s: float = 1.0,
             min_runs: int = 5, tolerance: float = TOLERANCE, progress: Any = None) -> dict[str, Any]:
    """Time each variant on the shapes; returns {"shapes", "results": {variant: {...}}, "fastest"}."""
    import onnx

    tcfg = tuning_config(cfg)
    specs = shapes(max_model_len)
    blocks_needed = sum(s["batch"] * -(-(s["past"] + s["new"]) // block_size) for s in specs) + 16
    results: dict[str, Any] = {}
    backends: dict[str, Any] = {}
    reference: np.ndarray | None = None
    with tempfile.TemporaryDirectory(prefix="optimize-autotune-") as tmp:
        for variant in variants:
            rec: dict[str, Any] = {}
            results[variant] = rec
            t0 = time.perf_counter()
            proto = build_candidate(tcfg, block_size, variant)
            rec["build_s"] = round(time.perf_counter() - t0, 3)
            path = Path(tmp) / f"{variant}.onnx"
            onnx.save_model(proto, str(path))
            config = {
                "kv_cache": {"block_size": block_size, "num_blocks": blocks_needed, "dtype": "float32"},
                "model": {"num_layers": 1, "num_kv_heads": tcfg.num_kv_heads, "head_dim": tcfg.head_dim,
                          "vocab_size": tcfg.vocab_size},
                "graph": {"inputs": [i.name for i in proto.graph.input], "kv_write": kv_write({"variant": variant})},
            }
            backend = OnnxRuntimeBackend(path, config)
            rng = np.random.default_rng(0)
            for pool in backend.k_pools + backend.v_pools:
                pool[...] = rng.standard_normal(pool.shape, dtype=np.float32)
            logits = backend.forward(_mixed_batch(block_size, tcfg.vocab_size, np.random.default_rng(1)))
            if reference is None:
                reference = logits
            rec["max_abs_diff"] = float(np.abs(logits - reference).max())
            rec["valid"] = bool(rec["max_abs_diff"] <= tolerance)
            if rec["valid"]:
                backends[variant] = backend
            else:
                rec["reason"] = (f"logits differ from {variants[0]} by {rec['max_abs_diff']:.3g} > {tolerance:g} "
                                 "on a mixed batch")
        # Candidates take turns run by run, so a load change on a shared machine hits all of them alike.
        times: dict[str, dict[str, float]] = {v: {} for v in backends}
        first_block = 0
        for spec in specs:
            fb = _batch(spec, block_size, tcfg.vocab_size, np.random.default_rng(2), first_block)
            for backend in backends.values():
                backend.forward(fb)  # warm-up
            runs: dict[str, list[float]] = {v: [] for v in backends}
            start = time.perf_counter()
            while (len(runs[next(iter(runs))]) < min_runs
                   or (time.perf_counter() - start < budget_s * len(backends) and len(runs[next(iter(runs))]) < 200)):
                for v, backend in backends.items():
                    t = time.perf_counter()
                    backend.forward(fb)
                    runs[v].append(time.perf_counter() - t)
            for v in backends:
                times[v][spec["name"]] = round(1000 * statistics.median(runs[v]), 4)
            if progress is not None:
                progress(spec["name"])
        for v in backends:
            results[v]["median_ms"] = times[v]
            results[v]["runs"] = len(runs[v])
            results[v]["score_ms"] = round(score(times[v], specs), 4)
        backends.clear()
    cpu_paths = None
    try:  # the code path the package's C ops ran on (the paged_cpu candidate's kernel), when it is built
        cpu_paths = kernel_paths()
    except (KernelLibraryError, OSError):
        pass
    timed = {v: r["score_ms"] for v, r in results.items() if r.get("valid")}
    fastest = min(timed, key=lambda v: (timed[v], variants.index(v))) if timed else None
    return {"shapes": specs, "score": f"ms per request: prefill + {DECODE_TOKENS} x mean over decode batch sizes of "
                                      "(step ms / batch)", "results": results,
            "fastest": fastest, "tuning_model": {"num_layers": 1, "vocab_size": tcfg.vocab_size},
            "cpu_paths": cpu_paths}
