"""ONNX translations of the attention custom ops (compiler/models/attention_ops.py): the contrib ops.

`translation_table(variant)` is what lower_onnx hands to `torch.onnx.export(custom_translation_table=)`.
The functions are traced by onnxscript into plain nodes of the model graph (no ONNX functions).

gqa (`com.microsoft.GroupQueryAttention`, ONNX Runtime CPU and CUDA): GQA keeps a BNSH cache per
sequence, not a paged pool. In the graph, each sequence's past K/V is gathered from the pool through
its block table as [B, kv_heads, Lp, head_dim] (Lp = block_table columns * block_size; one Gather of
rows on the pool viewed as [-1, head_dim], the read the decomposed path and the KV-cache
quantization rewrite use), the packed tokens are scattered into right-padded [B, S, hidden] q/k/v
(S = the longest chunk of the step), and GQA runs with seqlens_k = past_lens + new_lens - 1,
query_seqlens = new_lens, total_sequence_length = Lp + S (an upper bound, which ONNX Runtime
1.32 accepts with query_seqlens and needs as the present capacity: P + S <= C) and, for a sliding
window W, local_window_size = W (ONNX Runtime counts the query's own position in the window, as
Hugging Face's sliding_window does). The valid rows of the output are gathered back to [T, hidden].
The present K/V outputs (required by the CPU kernel with query_seqlens) are left unused: the graph's
new K/V outputs stay this step's K/V, which the runtime scatters into its pool.

paged_cpu (`optimize.PagedAttention`, ONNX Runtime CPU with this package's custom-op library registered):
the same inputs and attributes as PagedAttention below (float32), the schema ours (`optimize_schema()`);
the op writes the step's K/V into the pools itself (runtime/kernels/op_paged_attention.c). The graph's
new K/V outputs stay (the ForwardBatch graph's interface), and the runtime does not scatter them.

paged_attention (`com.microsoft.PagedAttention`, ONNX Runtime CUDA only, float16/bfloat16): packed
q/k/v [T, hidden], the pools in our layout (num_blocks, block_size, kv_heads, head_dim) with
kv_cache_layout SEPARATE (the default), cumulative_sequence_length = cu_seqlens, past_seqlens =
past_lens, block_table. No slot_mapping: the op derives the write slots from past_seqlens,
cu_seqlens and block_table (so the CUDA backend must pass the whole block table, not the trimmed
past one; see compiler/attention/__init__.py).
"""

from __future__ import annotations

import functools
from typing import Any

from onnxscript import opset21 as op
from onnxscript.values import Op, Opset

from compiler.attention.schema import onnx_schema
from runtime.kernels.paged_attention_cpu import DOMAIN, OP_TYPE

_MSFT = Opset("com.microsoft", 1)


@functools.cache
def contrib_op(name: str) -> Any:
    """The com.microsoft op for onnxscript: ONNX itself has no schema for the contrib ops, so ONNX Runtime's
    registered one (schema.py) stands in. Looked up when a variant lowers to it (an older ONNX Runtime lacks
    some: candidates() says which)."""
    return Op(_MSFT, name, onnx_schema(name))


def optimize_schema() -> Any:
    """onnx.defs.OpSchema of optimize.PagedAttention (runtime/kernels/op_paged_attention.c)."""
    from onnx import defs

    def param(name: str, type_str: str) -> Any:
        return defs.OpSchema.FormalParameter(name, type_str, "")

    attr = defs.OpSchema.AttrType
    return defs.OpSchema(
        OP_TYPE, DOMAIN, 1, "paged attention over packed tokens; writes the step's K/V into the pools in place",
        inputs=[param("query", "T"), param("key", "T"), param("value", "T"), param("key_cache", "T"),
                param("value_cache", "T"), param("cumulative_sequence_length", "S"), param("past_seqlens", "S"),
                param("block_table", "S")],
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)"], ""), ("S", ["tensor(int32)"], "")],
        attributes=[defs.OpSchema.Attribute("num_heads", attr.INT, "", required=True),
                    defs.OpSchema.Attribute("kv_num_heads", attr.INT, "", required=True),
                    defs.OpSchema.Attribute("scale", attr.FLOAT, "", required=True),
                    defs.OpSchema.Attribute("local_window_size", attr.INT, "", required=True)],
    )


OptimizePagedAttention = Op(Opset("optimize", 1), "PagedAttention", optimize_schema())
_INT32, _INT64 = 6, 7


def _c(value: int) -> Any:
    return op.Constant(value_int=value)


def _c1(*values: int) -> Any:
    return op.Constant(value_ints=list(values))


def pool_rows(block_table: Any, kv_heads: int, block_size: int) -> Any:
    """Rows [B, kv_heads, Lp] of the pool viewed as [num_blocks * block_size * kv_heads, head_dim]."""
    bt = op.Max(op.Cast(block_table, to=_INT64), _c(0))  # -1 (unused) -> block 0, never read
    lp = op.Mul(op.Shape(block_table, start=1, end=2), _c1(block_size))  # [1]
    j = op.Range(_c(0), op.Squeeze(lp, _c1(0)), _c(1))  # [Lp]
    blk = op.Gather(bt, op.Div(j, _c(block_size)), axis=1)  # [B, Lp]
    slots = op.Add(op.Mul(blk, _c(block_size)), op.Mod(j, _c(block_size)))
    heads = op.Reshape(op.Range(_c(0), _c(kv_heads), _c(1)), _c1(1, kv_heads, 1))
    return op.Add(op.Mul(op.Unsqueeze(slots, _c1(1)), _c(kv_heads)), heads), lp


def gqa_translation(q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, cu_seqlens: Any, past_lens: Any,
                    block_table: Any, num_heads: int, kv_heads: int, head_dim: int, block_size: int,
                    window: int, scale: float) -> Any:
    cu = op.Cast(cu_seqlens, to=_INT64)
    starts = op.Slice(cu, _c1(0), _c1(-1))
    ends = op.Slice(cu, _c1(1), _c1(1 << 62))
    new_lens = op.Sub(ends, starts)  # [B]
    s_max = op.ReduceMax(new_lens, keepdims=0)  # S
    s = op.Range(_c(0), s_max, _c(1))  # [S]
    tok = op.Add(op.Unsqueeze(starts, _c1(1)), op.Unsqueeze(s, _c1(0)))  # [B, S] token of each padded row
    # T from cu_seqlens (not from q's shape), so that every layer's index arithmetic is the same
    # expression of the graph inputs and the optimizer keeps one copy of it
    num_tokens = op.Gather(cu, _c(-1), axis=0)
    tok = op.Min(tok, op.Sub(num_tokens, _c(1)))  # padding rows read the last token
    qp, kp, vp = op.Gather(q, tok, axis=0), op.Gather(k, tok, axis=0), op.Gather(v, tok, axis=0)
    rows, lp = pool_rows(block_table, kv_heads, block_size)
    # one Gather of a flat row list per pool, as the decomposed path reads it (the KV-cache quantization
    # rewrite dequantizes exactly that pattern per row), then the BNSH view [B, kvh, Lp, d]
    flat = op.Reshape(rows, _c1(-1))
    bnsh = op.Concat(_c1(-1, kv_heads), lp, _c1(head_dim), axis=0)
    row_shape = _c1(-1, head_dim)
    past_k = op.Reshape(op.Gather(op.Reshape(k_cache, row_shape), flat, axis=0), bnsh)
    past_v = op.Reshape(op.Gather(op.Reshape(v_cache, row_shape), flat, axis=0), bnsh)
    seqlens_k = op.Cast(op.Sub(op.Add(op.Cast(past_lens, to=_INT64), new_lens), _c(1)), to=_INT32)
    total = op.Cast(op.Add(op.Squeeze(lp, _c1(0)), s_max), to=_INT32)
    query_seqlens = op.Cast(new_lens, to=_INT32)
    results = contrib_op("GroupQueryAttention")(
        qp, kp, vp, past_k, past_v, seqlens_k, total,
        None, None, None, None, None, None, None, None, None,  # cos, sin, position_ids, bias, sink, scales, q/k norm
        query_seqlens,
        num_heads=num_heads, kv_num_heads=kv_heads, local_window_size=window if window > 0 else -1,
        scale=scale, _outputs=3,
    )
    out = results[0]
    # packed token t of sequence b is padded row b * S + (t - starts[b])
    t_idx = op.Range(_c(0), num_tokens, _c(1))
    seq = op.ReduceSum(op.Cast(op.GreaterOrEqual(op.Unsqueeze(t_idx, _c1(1)), op.Unsqueeze(ends, _c1(0))),
                               to=_INT64), _c1(1), keepdims=0)  # [T]
    row = op.Add(op.Mul(seq, s_max), op.Sub(t_idx, op.Gather(starts, seq, axis=0)))
    return op.Gather(op.Reshape(out, _c1(-1, num_heads * head_dim)), row, axis=0)


def paged_attention_translation(q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, cu_seqlens: Any,
                                past_lens: Any, block_table: Any, num_heads: int, kv_heads: int, head_dim: int,
                                block_size: int, window: int, scale: float) -> Any:
    results = contrib_op("PagedAttention")(
        q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table,
        num_heads=num_heads, kv_num_heads=kv_heads, local_window_size=window if window > 0 else -1,
        scale=scale, _outputs=1,
    )
    return results[0] if isinstance(results, (tuple, list)) else results


def paged_cpu_translation(q: Any, k: Any, v: Any, k_cache: Any, v_cache: Any, cu_seqlens: Any, past_lens: Any,
                          block_table: Any, num_heads: int, kv_heads: int, head_dim: int, block_size: int,
                          window: int, scale: float) -> Any:
    return OptimizePagedAttention(
        q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table,
        num_heads=num_heads, kv_num_heads=kv_heads, scale=scale, local_window_size=window if window > 0 else -1,
    )


def translation_table(variant: str) -> dict[Any, Any] | None:
    """custom_translation_table for torch.onnx.export; None for the decomposed path (standard ops)."""
    from compiler.models.attention_ops import paged_attention, paged_cpu, paged_gqa

    if variant == "paged_cpu":
        return {paged_cpu._opoverload: paged_cpu_translation}
    if variant == "gqa":
        return {paged_gqa._opoverload: gqa_translation}
    if variant == "paged_attention":
        return {paged_attention._opoverload: paged_attention_translation}
    return None


def drop_unused_outputs(model: Any) -> int:
    """Trim the contrib-op nodes' trailing outputs that nothing reads (onnxscript emits every declared
    output; GroupQueryAttention refuses an output_qk without qk_output, PagedAttention's cache outputs
    are optional). The present K/V of GroupQueryAttention stay: the CPU kernel needs them with
    query_seqlens. Returns the number of outputs dropped."""
    used = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
    keep = {"GroupQueryAttention": 3, "PagedAttention": 1}
    dropped = 0
    for node in model.graph.node:
        if node.domain != "com.microsoft" or node.op_type not in keep:
            continue
        while len(node.output) > keep[node.op_type] and node.output[-1] not in used:
            node.output.pop()
            dropped += 1
    names = {o for n in model.graph.node for o in n.output}
    vi = [v for v in model.graph.value_info if v.name in names or v.name in used]
    del model.graph.value_info[:]
    model.graph.value_info.extend(vi)
    return dropped
