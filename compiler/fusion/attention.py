"""QKV split + RoPE + paged attention -> one optimize.RotaryPagedAttention node (the paged_cpu variant).

After the `qkv` and `rotary` rules, a decoder layer of a paged_cpu graph reaches its attention node as

    qkv = Gemm / MatMul / MatMulNBits(x)            [T, (H + 2*KVH)*D]
    q, k, v = Split(qkv, [H*D, KVH*D, KVH*D], axis -1)
    q -> Reshape* -> RotaryEmbedding -> Reshape* ---\\
    k -> Reshape* -> RotaryEmbedding -> Reshape* ----> optimize.PagedAttention(q, k, v, pools, ...)
    v -> Reshape* -----------------------------------/

thirteen nodes that only reinterpret shapes, split and rotate. This rule hands `qkv` itself to
optimize.RotaryPagedAttention (runtime/kernels/op_rotary_paged_attention.c), which rotates K on its way into
the pool and Q on its way into the kernel's scratch: the layer's attention is one node from the QKV
projection to o_proj. Reshapes are row-major reinterpretations, so the bytes the new node reads are
the ones the chain fed the old one.

A match needs: both rotations share position ids (Unsqueeze(positions, [0]) of the 1-D int64 graph
input), cos and sin caches, `interleaved` and `rotary_embedding_dim`, scale 1, heads as the attention
node's; one Split of a 2-D tensor on its last axis into exactly [H*D, KVH*D, KVH*D]. Anything else
(e.g. Qwen3's per-head q/k norm between the split and the rotation) is left alone, with the reason in
the report.

When every attention node of the graph fused, the graph's `new_key.i` / `new_value.i` outputs go: the
kernel writes the step's K/V into the pools (runtime.json graph.kv_write "graph"), the runtime never
fetches them, and keeping them would keep the rotation chain alive. The package pass records the
outputs the graph has.
"""

from __future__ import annotations

import re

import onnx
from onnx import TensorProto, helper

from compiler.fusion.graph import MS_DOMAIN, FusionGraph, RuleReport, attr, const_array, shape_of

DOMAIN = "optimize"
# ops whose output has the rank of their first input (what stands between a layer's input and its QKV split)
_SAME_RANK = {"MatMul", "MatMulNBits", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "SimplifiedLayerNormalization",
              "SkipSimplifiedLayerNormalization", "Mul", "Add", "Div", "Cast", "QuickGelu", "QuantizeLinear",
              "DequantizeLinear"}
_KV_OUTPUT = re.compile(r"new_(?:key|value)\.\d+")


class _Walk:
    def __init__(self, g: FusionGraph) -> None:
        self.g = g
        self.producers = g.producer_map()
        self.graph_inputs = {i.name: i for i in g.model.graph.input}

    def through_reshapes(self, name: str) -> str:
        while (p := self.producers.get(name)) is not None and p.op_type == "Reshape" and p.domain in ("", "ai.onnx"):
            name = p.input[0]
        return name

    def rank(self, name: str, depth: int = 16) -> int | None:
        """The rank of `name`: its recorded shape, else followed back through rank-preserving ops (a Gemm is
        2-D, the embedding Gather adds the table's rank - 1 to the ids')."""
        shape = shape_of(self.g, name)
        if shape is not None:
            return len(shape)
        p = self.producers.get(name)
        if p is None or depth == 0:
            return None
        if p.op_type == "Gemm":
            return 2
        if p.op_type == "Gather" and int(attr(p, "axis", 0)) == 0:
            data, ids = self.rank(p.input[0], depth - 1), self.rank(p.input[1], depth - 1)
            return None if data is None or ids is None else data + ids - 1
        return self.rank(p.input[0], depth - 1) if p.op_type in _SAME_RANK else None

    def rotary(self, name: str) -> onnx.NodeProto | None:
        p = self.producers.get(self.through_reshapes(name))
        return p if p is not None and p.op_type == "RotaryEmbedding" and p.domain == MS_DOMAIN else None

    def positions(self, position_ids: str) -> str | None:
        """The 1-D int64 graph input behind Unsqueeze(positions, [0])."""
        u = self.producers.get(position_ids)
        if u is None or u.op_type != "Unsqueeze" or len(u.input) != 2:
            return None
        axes = const_array(self.g, u.input[1])
        pos = self.graph_inputs.get(u.input[0])
        if axes is None or axes.reshape(-1).tolist() != [0] or pos is None:
            return None
        t = pos.type.tensor_type
        return u.input[0] if t.elem_type == TensorProto.INT64 and len(t.shape.dim) == 1 else None


def _match(w: _Walk, node: onnx.NodeProto) -> tuple[list[str], dict[str, int]] | str:
    """(inputs of the new node, its rotary attributes) or the reason the node is left alone."""
    g = w.g
    heads, kv_heads = int(attr(node, "num_heads")), int(attr(node, "kv_num_heads"))
    rq, rk = w.rotary(node.input[0]), w.rotary(node.input[1])
    if rq is None or rk is None:
        return "q or k does not come from a RotaryEmbedding through reshapes"
    if list(rq.input[1:4]) != list(rk.input[1:4]):
        return "q and k are rotated with different positions or caches"
    rot = {}
    for key, default in (("interleaved", 0), ("rotary_embedding_dim", 0), ("is_packed_batching", 0)):
        values = {int(attr(r, key, default)) for r in (rq, rk)}
        if len(values) != 1:
            return f"q and k rotations differ in {key}"
        rot[key] = values.pop()
    if rot.pop("is_packed_batching"):
        return "packed-batching rotations are not matched"
    if any(float(attr(r, "scale", 1.0)) != 1.0 for r in (rq, rk)):
        return "a rotation has a scale other than 1"
    for r, n in ((rq, heads), (rk, kv_heads)):
        if int(attr(r, "num_heads", 0)) not in (0, n):
            return f"a rotation's num_heads {attr(r, 'num_heads')} differs from the attention's {n}"
    positions = w.positions(rq.input[1])
    if positions is None:
        return "the position ids are not Unsqueeze(positions, [0]) of the 1-D int64 graph input"
    cos, sin = (g.inits.get(x) for x in rq.input[2:4])
    if cos is None or sin is None or list(cos.dims) != list(sin.dims) or len(cos.dims) != 2 \
            or cos.data_type != TensorProto.FLOAT or sin.data_type != TensorProto.FLOAT:
        return "the cos/sin caches are not float32 [rows, R/2] initializers"
    xq, xk, xv = (w.through_reshapes(x) for x in (rq.input[0], rk.input[0], node.input[2]))
    sp = w.producers.get(xq)
    if sp is None or sp.op_type != "Split" or sp.domain not in ("", "ai.onnx") or list(sp.output) != [xq, xk, xv]:
        return "q, k and v are not the three outputs of one Split"
    rank = w.rank(sp.input[0])
    if rank != 2 or int(attr(sp, "axis", 0)) not in (-1, 1):
        return f"the Split is not of a 2-D tensor on its last axis (rank {rank}, axis {attr(sp, 'axis', 0)})"
    sizes = const_array(g, sp.input[1]) if len(sp.input) > 1 and sp.input[1] else None
    if sizes is None or len(sizes.reshape(-1)) != 3:
        return "the Split's sizes are not a constant of three"
    q_cols, k_cols, v_cols = (int(s) for s in sizes.reshape(-1))
    if q_cols % heads or k_cols != v_cols or k_cols * heads != q_cols * kv_heads:
        return f"split sizes {[q_cols, k_cols, v_cols]} do not fit {heads} query and {kv_heads} KV heads"
    head_dim = q_cols // heads
    r = rot["rotary_embedding_dim"] or head_dim
    if 2 * int(cos.dims[1]) != r or r > head_dim:
        return f"cos/sin caches of width {cos.dims[1]} do not fit rotary dimension {r} of head_dim {head_dim}"
    inputs = [sp.input[0], positions, cos.name, sin.name, *node.input[3:]]  # pools .. block_table, k/v scales
    return inputs, {"rotary_embedding_dim": rot["rotary_embedding_dim"], "interleaved": rot["interleaved"]}


def fuse_rotary_attention(g: FusionGraph) -> tuple[RuleReport, list[str]]:
    """Rewrite each matching optimize.PagedAttention; returns the report and the graph outputs dropped."""
    report = RuleReport()
    walk = _Walk(g)
    nodes = [n for n in g.nodes if n.op_type == "PagedAttention" and n.domain == DOMAIN]
    for node in nodes:
        m = _match(walk, node)
        if isinstance(m, str):
            report.miss(node.output[0], m)
            continue
        inputs, rot = m
        keep = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        new = helper.make_node("RotaryPagedAttention", inputs, list(node.output),
                               name=g.unique(f"{node.name}_rotary"), domain=DOMAIN, **keep, **rot)
        g.nodes[g.index(node)] = new
        report.fired += 1
    dropped: list[str] = []
    if nodes and report.fired == len(nodes):
        outputs = g.model.graph.output
        dropped = [o.name for o in outputs if _KV_OUTPUT.fullmatch(o.name)]
        kept = [o for o in outputs if o.name not in dropped]
        del outputs[:]
        outputs.extend(kept)
        g.graph_outputs.difference_update(dropped)
    return report, dropped
