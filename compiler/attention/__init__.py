"""Attention variants: which implementations can run a model's attention on a target, and their facts.

Variants (the model definition's `attention=`, compiler/models/llama.py):

- `decomposed`: paged attention in standard ONNX ops (per-token gather of the past through the
  block table, masked softmax). Any ONNX Runtime target, the torch targets, and TensorRT (its ONNX
  parser reads these standard ops; the contrib-op variants below are ONNX Runtime's alone).
- `gqa`: ONNX Runtime's com.microsoft.GroupQueryAttention fed per-sequence past K/V gathered from
  the pool and right-padded chunks (`query_seqlens`, ONNX Runtime >= 1.32), see lowering.py.
- `paged_cpu`: ONNX Runtime CPU: optimize.PagedAttention, this package's C kernel registered into ONNX
  Runtime as a custom-op library (runtime/kernels/op_paged_attention.c): writes the step's K/V into the
  pools in place and attends per sequence reading the pools through the block table (no gather of the
  past, no scores across sequences), on ONNX Runtime's intra-op threads; float32 pools.
- `paged_attention`: ONNX Runtime's com.microsoft.PagedAttention (CUDA kernel only, float16/bfloat16),
  reading and writing our pools directly. Built and schema-validated here; never run on CPU.
- `triton`: the torch targets on CUDA: the program calls optimize::paged_attention_triton, a Triton
  kernel reading the pools through the block table (runtime/kernels/); on CPU the same op runs the
  per-sequence PyTorch reference (and the Triton kernel in Triton's interpreter under TRITON_INTERPRET=1).
- `flashinfer`: the torch targets on CUDA: the program calls optimize::paged_attention_flashinfer,
  FlashInfer's paged kernels over the past and ragged kernels over the step's own K/V, merged by
  log-sum-exp, planned by the torch backend once per step (runtime/kernels/flashinfer_attention.py);
  float16/bfloat16, head_dim 64/128/256, no sliding window; flashinfer-python where it is loaded.

`candidates()` says for a model config and target which are valid and, when not, why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compiler.attention.schema import missing_input
from runtime.kernels import FLASHINFER_HEAD_DIMS
from runtime.kernels.paged_attention_cpu import KernelLibraryError, library_path

VARIANTS = ("decomposed", "gqa", "paged_cpu", "paged_attention", "triton", "flashinfer")

KERNELS: dict[str, dict[str, str]] = {
    "decomposed": {
        "implementation": "paged_attention_standard_ops",
        "description": "per-token gather of past K/V through block_table + this step's K/V, masked softmax; "
                       "plain ONNX ops (Gather, MatMul, Softmax)",
    },
    "gqa": {
        "implementation": "com.microsoft.GroupQueryAttention",
        "description": "per-sequence gather of past K/V through block_table into BNSH, right-padded chunks "
                       "(query_seqlens), GroupQueryAttention, valid rows gathered back to packed tokens",
    },
    "paged_cpu": {
        "implementation": "optimize.PagedAttention",
        "description": "C kernel (custom-op library): the step's K/V written into the pools in place, then per "
                       "(sequence, KV head, query tile) an online softmax over the pools read through block_table; "
                       "ONNX Runtime CPU, float32",
    },
    "paged_attention": {
        "implementation": "com.microsoft.PagedAttention",
        "description": "packed tokens over the paged KV pools (cumulative_sequence_length, past_seqlens, "
                       "block_table); ONNX Runtime CUDA only",
    },
    "triton": {
        "implementation": "optimize::paged_attention_triton",
        "description": "Triton kernel, one program per (token, KV head): the group's query heads over the past read "
                       "through block_table, then the step's own K/V, online softmax; torch targets on CUDA",
    },
    "flashinfer": {
        "implementation": "optimize::paged_attention_flashinfer",
        "description": "FlashInfer: the past through the paged (decode) kernels, the step's own K/V through the ragged "
                       "causal kernel, merged by log-sum-exp; planned once per step on the host; torch targets on CUDA",
    },
}

# Why the contrib-op variants are invalid for TensorRT: its ONNX parser reads the standard domain only.
_NOT_FOR_TENSORRT = ("com.microsoft.{op} is an ONNX Runtime contrib op; TensorRT's ONNX parser reads standard "
                     "ONNX ops only (no plugin for it)")

_CUDA_POOLS = ("the ONNX Runtime CUDA backend keeps the KV pools on the GPU and needs PagedAttention's in-place "
               "cache write (this variant returns K/V for a host-side scatter)")

# ONNX Runtime element types of each contrib op's T (query/key/value/output)
_OP_DTYPES = {"gqa": ("float32", "float16", "bfloat16"), "paged_attention": ("float16", "bfloat16")}


@dataclass(frozen=True)
class Candidate:
    variant: str
    valid: bool
    reason: str

    def record(self) -> dict[str, Any]:
        return {"variant": self.variant, "valid": self.valid, "reason": self.reason}


def attention_kind(cfg: Any) -> dict[str, Any]:
    """The model's attention facts: MHA / GQA / MQA, sliding windows, q/k norm, QKV bias."""
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    heads = "MHA" if h == kvh else "MQA" if kvh == 1 else "GQA"
    windows = sorted({w for w in cfg.sliding_windows if w is not None})
    return {
        "heads": heads,
        "num_heads": h,
        "num_kv_heads": kvh,
        "head_dim": cfg.head_dim,
        "sliding_window": windows[0] if len(windows) == 1 else (windows or None),
        "sliding_window_layers": sum(w is not None for w in cfg.sliding_windows),
        "qk_norm": bool(cfg.qk_norm),
        "qkv_bias": bool(cfg.qkv_bias),
        "logit_softcapping": getattr(cfg, "attn_logit_softcapping", None),
    }


def candidates(cfg: Any, backend: str, device: str, dtype: str, pass_names: list[str] | tuple[str, ...] = (),
               kv_cache_dtype: str | None = None) -> list[Candidate]:
    """Each variant, valid or not for this model and target, with the reason (kv_cache_dtype: the
    quantize_kv_cache pass's dtype, "int8" when only its name is known)."""
    if backend == "onnxruntime":
        out = [Candidate("decomposed", True, "standard ONNX ops")]
    elif backend == "torch":
        out = [Candidate("decomposed", True, "standard torch ops (the torch.export program)")]
    elif backend == "tensorrt":
        out = [Candidate("decomposed", True, "standard ONNX ops, which TensorRT's ONNX parser reads")]
    else:
        out = [Candidate("decomposed", False, f"no lowering of the decomposed path to {backend} yet")]
    quant_kv = "quantize_kv_cache" in pass_names
    if quant_kv and kv_cache_dtype is None:
        kv_cache_dtype = "int8"
    if cfg.num_heads % cfg.num_kv_heads:
        why = f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}"
        return out + [Candidate(v, False, why) for v in ("gqa", "paged_cpu", "paged_attention", "triton", "flashinfer")]
    if getattr(cfg, "attn_logit_softcapping", None):
        why = (f"attention logit soft-capping ({cfg.attn_logit_softcapping} * tanh(s / "
               f"{cfg.attn_logit_softcapping})): only the decomposed path applies it")
        return out + [Candidate(v, False, why) for v in ("gqa", "paged_cpu", "paged_attention", "triton", "flashinfer")]
    if backend == "tensorrt":
        out.append(Candidate("gqa", False, _NOT_FOR_TENSORRT.format(op="GroupQueryAttention")))
    elif backend != "onnxruntime":
        why = f"ONNX Runtime contrib op, not available on the {backend} backend"
        out.append(Candidate("gqa", False, why))
    elif dtype not in _OP_DTYPES["gqa"]:
        out.append(Candidate("gqa", False, f"GroupQueryAttention takes no {dtype}"))
    elif device != "cuda" and (why := missing_input("GroupQueryAttention", "query_seqlens")) is not None:
        # (on cuda the variant is invalid for the pools' sake, below)
        out.append(Candidate("gqa", False, f"{why} (the right-padded chunks need it: onnxruntime >= 1.32)"))
    elif quant_kv:
        out.append(Candidate("gqa", True, f"GroupQueryAttention, {dtype}, over the past dequantized after the "
                             "pool gather (quantize_kv_cache rewrites the same flat row Gather as the decomposed path)"))
    else:
        out.append(Candidate("gqa", True, f"GroupQueryAttention CPU/CUDA kernel, {dtype}, query_seqlens "
                             "(right-padded chunks) over per-sequence past gathered from the pool"))
    out.append(_paged_cpu(backend, device, dtype, kv_cache_dtype if quant_kv else None))
    if backend == "tensorrt":
        out.append(Candidate("paged_attention", False, _NOT_FOR_TENSORRT.format(op="PagedAttention")))
    elif backend != "onnxruntime" or device != "cuda":
        out.append(Candidate("paged_attention", False, "CUDA only (ONNX Runtime has no CPU kernel for PagedAttention)"))
    elif dtype not in _OP_DTYPES["paged_attention"]:
        out.append(Candidate("paged_attention", False, f"PagedAttention takes float16/bfloat16, not {dtype}"))
    elif (why := missing_input("PagedAttention", "block_table")) is not None:
        out.append(Candidate("paged_attention", False, why))
    elif quant_kv:
        out.append(Candidate("paged_attention", False, "quantized KV cache: per-head scales are not expressible as "
                             "PagedAttention's k_scale/v_scale without a new lowering"))
    else:
        out.append(Candidate("paged_attention", True, "PagedAttention CUDA kernel over the pools"))
    if backend != "torch":
        out.append(Candidate("triton", False, "a torch custom op (Triton kernel): torch targets only"))
    elif device != "cuda":
        out.append(Candidate("triton", False, "a CUDA kernel: on CPU the op runs a per-sequence PyTorch loop, "
                             "slower than the decomposed path"))
    elif dtype not in ("float32", "float16", "bfloat16"):
        out.append(Candidate("triton", False, f"the kernel takes float32/float16/bfloat16, not {dtype}"))
    else:
        out.append(Candidate("triton", True, f"Triton kernel over the pools through the block table, {dtype}; "
                             "CUDA-graph safe"))
    out.append(_flashinfer(cfg, backend, device, dtype))
    if backend == "onnxruntime" and device == "cuda":
        # runtime/backends/onnxruntime_cuda.py keeps the pools on the GPU and has PagedAttention write
        # this step's K/V into them in place; the other variants return K/V for a host-side scatter
        out = [c if c.variant == "paged_attention" or not c.valid else Candidate(c.variant, False, _CUDA_POOLS)
               for c in out]
    return out


def _paged_cpu(backend: str, device: str, dtype: str, kv_cache_dtype: str | None) -> Candidate:
    if backend != "onnxruntime" or device != "cpu":
        return Candidate("paged_cpu", False, "optimize.PagedAttention is a C kernel for ONNX Runtime's CPU execution "
                         "provider only")
    if dtype != "float32":
        return Candidate("paged_cpu", False, f"the kernel takes float32, not {dtype}")
    if kv_cache_dtype not in (None, "int8"):
        return Candidate("paged_cpu", False, f"KV cache {kv_cache_dtype}: the kernel reads and writes float32 or int8 "
                         "pools (FP8 pools are the decomposed and gqa paths' rewrite)")
    try:
        library_path()
    except KernelLibraryError as e:
        return Candidate("paged_cpu", False, str(e))
    pools = "int8 pools with per-head scales" if kv_cache_dtype == "int8" else "float32"
    return Candidate("paged_cpu", True, f"C kernel over the pools in place (custom-op library), {pools}")


def _flashinfer(cfg: Any, backend: str, device: str, dtype: str) -> Candidate:
    if backend != "torch":
        return Candidate("flashinfer", False, "a torch custom op (FlashInfer kernels): torch targets only")
    if device != "cuda":
        return Candidate("flashinfer", False, "CUDA kernels: on CPU the op runs the per-sequence PyTorch reference, "
                         "slower than the decomposed path")
    if dtype not in ("float16", "bfloat16"):
        return Candidate("flashinfer", False, f"FlashInfer's kernels take float16/bfloat16, not {dtype}")
    if cfg.head_dim not in FLASHINFER_HEAD_DIMS:
        dims = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
        return Candidate("flashinfer", False, f"FlashInfer's kernels are built for head_dim {dims}, not {cfg.head_dim}")
    if any(w is not None for w in cfg.sliding_windows):
        return Candidate("flashinfer", False, "sliding-window layers: the past and the step's own keys are two "
                         "segments here and a window would span both (the triton variant takes windows)")
    return Candidate("flashinfer", True, f"FlashInfer over the pools (paged) and the step's K/V (ragged), {dtype}; "
                     "decode buckets CUDA-graph safe; needs flashinfer-python where the artifact is loaded")


def kv_write(attention: dict[str, Any] | None) -> str:
    """Who writes a step's K/V into the pools for the chosen attention variant: "graph" or "runtime"."""
    return "graph" if (attention or {}).get("variant") in ("paged_cpu", "paged_attention") else "runtime"


__all__ = ["KERNELS", "VARIANTS", "Candidate", "attention_kind", "candidates", "kv_write"]
