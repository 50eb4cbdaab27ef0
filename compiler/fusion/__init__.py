"""ONNX fusion rules for the ONNX Runtime target (the `fuse` pass, compiler/passes/fuse.py).

Rules, in the order they run (each can be turned off):

| rule            | rewrites                                                    | implementation                 |
|-----------------|-------------------------------------------------------------|--------------------------------|
| `rms_norm`      | RMSNorm subgraph -> SimplifiedLayerNormalization            | onnxscript ort_fusions (as is) |
| `skip_rms_norm` | residual Add + SimplifiedLayerNormalization                 | onnxscript SkipRmsNorm pattern,|
|                 |   -> com.microsoft.SkipSimplifiedLayerNormalization         |   shape check for [T, D]       |
| `qkv`           | q/k/v projections of one input -> one Gemm/MatMul/MatMulNBits + Split | fusion/projections.py |
| `gate_up`       | gate/up projections -> one node + Split                     | fusion/projections.py          |
| `rotary`        | rotate-half RoPE -> com.microsoft.RotaryEmbedding + cos/sin caches | fusion/rotary.py        |
| `rotary_attention` | Split + RotaryEmbedding + optimize.PagedAttention          | fusion/attention.py            |
|                 |   -> optimize.RotaryPagedAttention on the packed QKV (paged_cpu graphs; drops the graph's |  |
|                 |   new_key/new_value outputs, which the kernel writes into the pools itself) |                |
| `quick_gelu`    | x * Sigmoid(x) -> com.microsoft.QuickGelu(alpha=1)          | fusion/activation.py           |
| `swiglu`        | Split + QuickGelu(alpha 1) + Mul of the MLP                 | fusion/swiglu.py               |
|                 |   -> optimize.SiluMul (graphs that use the C library)       |                                |
| `quantize_rows` | per-token INT8 activation quantization (6 nodes)            | fusion/quantize_rows.py        |
|                 |   -> optimize.QuantizeRows (graphs that use the C library)  |                                |
| `row_scale`     | per-token INT8 GEMM's row-scale Mul feeding SiluMul         | fusion/row_scale.py            |
|                 |   -> SiluMul(x, s) (graphs that use the C library)          |                                |
| `skip_norm_quantize` | row-scale Mul + SkipSimplifiedLayerNormalization + QuantizeRows | fusion/skip_norm_quantize.py |
|                 |   -> optimize.SkipNormQuantize (graphs that use the C library) |                             |
| `matmul_bf16`   | float MatMul / Gemm with a constant weight                  | fusion/matmul_bf16.py          |
|                 |   -> optimize.MatMulBf16, bf16 weights (opt-in: the recipe's target.matmul: bfloat16; not in RULES) | |

`fuse_model` applies them and returns the new model with statistics. Everything is deterministic:
rules visit nodes in graph order, new names derive from existing ones (`Graph.unique`), caches are
computed, not sampled, and initializers are written sorted by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import onnx

RULES: tuple[str, ...] = ("rms_norm", "skip_rms_norm", "qkv", "gate_up", "rotary", "rotary_attention", "quick_gelu",
                          "swiglu", "quantize_rows", "row_scale", "skip_norm_quantize")


def fuse_model(model: onnx.ModelProto, rules: Any, rope_cache_rows: int, matmul_bf16: bool = False
               ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Apply `rules` (names from RULES, run in RULES order), then `matmul_bf16` where asked; returns
    (model, stats). The returned model may be a new ModelProto (the onnxscript rules go through onnx_ir).
    (compiler/fusion/pipeline.py)"""
    from compiler.fusion.pipeline import fuse_model as run

    return run(model, rules, rope_cache_rows, matmul_bf16)


def check_model(model: onnx.ModelProto, onnxruntime_session: bool = True) -> dict[str, Any]:
    """onnx.checker (full) on the standard part, then an ONNX Runtime session; raises on failure."""
    from compiler.fusion.pipeline import check_model as run

    return run(model, onnxruntime_session)


__all__ = ["RULES", "check_model", "fuse_model"]
