"""Sibling projections that read the same input become one wider projection and a Split.

- `qkv`:     q_proj, k_proj, v_proj of a layer (same normalised input) -> one node of N = Nq + Nk + Nv
- `gate_up`: gate_proj, up_proj of an MLP -> one node of N = 2 * intermediate

A torch Linear lowers to Gemm(x, W[N, K], transB=1[, bias C]) in our graphs (torch.onnx dynamo,
2-D packed activations); MatMul(x, W^T [K, N]) is handled as well (concatenation along axis 1),
and com.microsoft.MatMulNBits (INT4 artifacts, from lower_quant): its packed B [N, k_blocks,
block/2], scales and zero points are laid out per output row, so they concatenate along N; a bias
(input 5) concatenates too. com.microsoft.MatMulIntegerToFloat (INT8 W8A8 artifacts, quantize_int8):
the members share the quantized input (codes, scale and zero point), their int8 B [K, N] and per-column
scales concatenate along N, and the per-token row-scale Mul and bias Add after each (the same row
scales for all) become one Mul and one Add on the fused output. The Split after the fused node (after
its Mul/Add for INT8) writes the original output names, so every consumer is unchanged.

Not fused (recorded with the reason): weights that are DequantizeLinear outputs (FP8 / QDQ
artifacts: the fusion would have to concatenate quantized codes and per-channel scales, and FP8
activation Q/DQ pairs sit on the shared input — left to the QDQ consumer, e.g. TensorRT), groups
with a member missing or of a different kind / attributes, and non-constant weights.

The projections' role comes from the weight initializer's name (`...self_attn.q_proj.weight`,
`..._nbits` after lower_quant), which lower_onnx takes from the torch parameter names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from compiler import streamed
from compiler.fusion.graph import MS_DOMAIN, FusionGraph, RuleReport, attr, const_value, tensor

ROLES: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
FUSED_NAME = {"qkv": "qkv_proj", "gate_up": "gate_up_proj"}
_ROLE_RE = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


@dataclass
class _Member:
    role: str
    node: onnx.NodeProto
    weight: str  # initializer (or DequantizeLinear input) name that named the role


_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)  # numpy concatenates both exactly


def _weight_name(g: FusionGraph, node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> str:
    if len(node.input) < 2:
        return ""
    b = node.input[1]
    p = producers.get(b)
    if p is not None and p.op_type == "DequantizeLinear":
        return p.input[0]
    return b


def _kind(g: FusionGraph, node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> tuple[str, str | None]:
    """(kind, reason it cannot be fused or None)."""
    b = node.input[1]
    p = producers.get(b)
    if p is not None and p.op_type == "DequantizeLinear":
        return "qdq", "weights are DequantizeLinear outputs (QDQ / FP8 artifact): not fused"
    if node.op_type == "Gemm" and node.domain in ("", "ai.onnx"):
        if attr(node, "transA", 0) != 0 or attr(node, "transB", 0) != 1:
            return "gemm", "Gemm is not A x B^T"
        if attr(node, "alpha", 1.0) != 1.0 or attr(node, "beta", 1.0) != 1.0:
            return "gemm", "Gemm has alpha or beta != 1"
        w = g.inits.get(b)
        if w is None or len(w.dims) != 2 or w.data_type not in _FLOATS:
            return "gemm", "B is not a 2-D float initializer"
        if len(node.input) > 2 and node.input[2]:
            c = g.inits.get(node.input[2])
            if c is None or list(c.dims) != [w.dims[0]]:
                return "gemm", "bias is not a constant [N] vector"
        return "gemm", None
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        w = g.inits.get(b)
        if w is None or len(w.dims) != 2 or w.data_type not in _FLOATS:
            return "matmul", "B is not a 2-D float initializer"
        return "matmul", None
    if node.op_type == "MatMulIntegerToFloat" and node.domain == MS_DOMAIN:
        ins = list(node.input) + [""] * (7 - len(node.input))
        w, scale = g.inits.get(ins[1]), g.inits.get(ins[3])
        if w is None or len(w.dims) != 2 or w.data_type != TensorProto.INT8:
            return "int8", "B is not a 2-D int8 initializer"
        if scale is None or list(scale.dims) not in ([w.dims[1]], [1, w.dims[1]]):
            return "int8", "b_scale is not a constant per-column vector"
        if ins[5]:
            return "int8", "has a B zero point (int8 weights here are symmetric)"
        if ins[6] and (ins[6] not in g.inits or list(g.inits[ins[6]].dims) != [w.dims[1]]):
            return "int8", "bias is not a constant [N] vector"
        tail = _int8_tail(g, node)
        if isinstance(tail, str):
            return "int8", tail
        return "int8", None
    if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
        ins = list(node.input) + [""] * (6 - len(node.input))
        if any(x and x not in g.inits for x in ins[1:4] + ins[5:6]):
            return "nbits", "B, scales, zero points or bias is not an initializer"
        if ins[4]:
            return "nbits", "has g_idx (act-order): rows are not independent blocks"
        return "nbits", None
    return node.op_type, f"{node.op_type} is not a fusable projection"


def _int8_tail(g: FusionGraph, node: onnx.NodeProto) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None] | str:
    """(row-scale Mul or None, bias Add or None) after a MatMulIntegerToFloat, or why they do not fit."""
    y = node.output[0]
    users = [n for n in g.nodes if y in n.input]
    if y in g.graph_outputs or len(users) != 1:
        return (None, None) if not users and y not in g.graph_outputs else "the output has several uses"
    mul = users[0] if users[0].op_type == "Mul" and users[0].domain in ("", "ai.onnx") and users[0].input[0] == y \
        else None
    last = mul.output[0] if mul is not None else y
    after = [n for n in g.nodes if last in n.input]
    add = None
    if mul is not None and len(after) == 1 and after[0].op_type == "Add" and after[0].input[0] == last \
            and after[0].input[1] in g.inits and last not in g.graph_outputs:
        add = after[0]
    if mul is None and users[0].op_type == "Add":
        return "a bias Add without the row-scale Mul"
    return mul, add


def _signature(g: FusionGraph, node: onnx.NodeProto) -> tuple:
    """What must agree between the members of one group (besides the kind)."""
    if node.op_type == "MatMulIntegerToFloat":
        ins = list(node.input) + [""] * (7 - len(node.input))
        mul, add = _int8_tail(g, node)  # type: ignore[misc]
        return (g.inits[ins[1]].dims[0], ins[2], ins[4], bool(ins[6]), mul.input[1] if mul is not None else None,
                add is not None)
    if node.op_type == "Gemm":
        return (g.inits[node.input[1]].dims[1], len(node.input) > 2 and bool(node.input[2]))
    if node.op_type == "MatMul":
        return (g.inits[node.input[1]].dims[0],)
    ins = list(node.input) + [""] * (6 - len(node.input))
    return (attr(node, "K"), attr(node, "bits", 4), attr(node, "block_size"), attr(node, "accuracy_level", 0),
            bool(ins[3]), bool(ins[5]), g.inits[ins[3]].data_type if ins[3] else None)


def fuse_projections(g: FusionGraph, rule: str) -> RuleReport:
    roles = ROLES[rule]
    report = RuleReport()
    producers = g.producer_map()
    groups: dict[str, list[_Member]] = {}
    for n in g.nodes:
        if n.op_type not in ("Gemm", "MatMul", "MatMulNBits", "MatMulIntegerToFloat") or len(n.input) < 2:
            continue
        w = _weight_name(g, n, producers)
        m = _ROLE_RE.search(w)
        if m is None or m.group(1) not in roles:
            continue
        groups.setdefault(n.input[0], []).append(_Member(m.group(1), n, w))
    for members in groups.values():
        where = members[0].weight.split(f".{members[0].role}.")[0]
        got = sorted(m.role for m in members)
        if got != sorted(roles):
            report.miss(where, f"projections {got} read this input; need exactly {list(roles)}")
            continue
        members.sort(key=lambda m: roles.index(m.role))
        kinds = [_kind(g, m.node, producers) for m in members]
        bad = next((why for _, why in kinds if why), None)
        if bad:
            report.miss(where, bad)
            continue
        if len({k for k, _ in kinds}) != 1:
            report.miss(where, f"mixed kinds {[m.node.op_type for m in members]}")
            continue
        sigs = {_signature(g, m.node) for m in members}
        if len(sigs) != 1:
            report.miss(where, "the projections differ in K, bias or quantization attributes")
            continue
        _rewrite(g, rule, kinds[0][0], members)
        report.fired += 1
    return report


def _concat_inits(g: FusionGraph, names: list[str], axis: int, out: str) -> str:
    arrays = [const_value(g, n) for n in names]
    if any(isinstance(a, streamed.Deferred) for a in arrays):  # weights not in memory: joined when written
        return g.add_init(tensor(streamed.concatenate(arrays, axis), g.unique(out)))
    return g.add_init(tensor(np.concatenate(arrays, axis=axis), g.unique(out)))  # type: ignore[arg-type]


def _rewrite(g: FusionGraph, rule: str, kind: str, members: list[_Member]) -> None:
    first = members[0]
    base = first.node.input[1] if kind != "nbits" else first.node.input[1].removesuffix("_nbits")
    fused_base = base.replace(first.role, FUSED_NAME[rule], 1) if first.role in base else f"{base}.{rule}"
    x = first.node.input[0]
    nodes = [m.node for m in members]
    fused_out = g.unique(fused_base.removesuffix(".weight"))
    if kind == "gemm":
        sizes = [int(g.inits[n.input[1]].dims[0]) for n in nodes]
        ins = [x, _concat_inits(g, [n.input[1] for n in nodes], 0, fused_base)]
        if len(nodes[0].input) > 2 and nodes[0].input[2]:
            ins.append(_concat_inits(g, [n.input[2] for n in nodes], 0, f"{fused_base.removesuffix('.weight')}.bias"))
        fused = helper.make_node("Gemm", ins, [fused_out], name=g.unique(f"{fused_base}_Gemm"), transB=1)
    elif kind == "matmul":
        sizes = [int(g.inits[n.input[1]].dims[1]) for n in nodes]
        ins = [x, _concat_inits(g, [n.input[1] for n in nodes], 1, fused_base)]
        fused = helper.make_node("MatMul", ins, [fused_out], name=g.unique(f"{fused_base}_MatMul"))
    elif kind == "int8":  # B [K, N] int8 and its column scales (and a kernel bias) concatenate along N
        sizes = [int(g.inits[n.input[1]].dims[1]) for n in nodes]
        padded = [list(n.input) + [""] * (7 - len(n.input)) for n in nodes]
        ins = [x, _concat_inits(g, [p[1] for p in padded], 1, fused_base), padded[0][2],
               _concat_inits(g, [p[3] for p in padded], -1, f"{fused_base}_scale"), padded[0][4]]
        if padded[0][6]:
            ins += ["", _concat_inits(g, [p[6] for p in padded], 0, f"{fused_base}_bias")]
        fused = helper.make_node("MatMulIntegerToFloat", ins, [fused_out], name=g.unique(f"{fused_base}_int8"),
                                 domain=MS_DOMAIN)
        tails = [_int8_tail(g, n) for n in nodes]
        mul, add = tails[0]  # type: ignore[misc]
        extra: list[onnx.NodeProto] = []
        if mul is not None:
            scaled = g.unique(f"{fused_out}_rows")
            extra.append(helper.make_node("Mul", [fused_out, mul.input[1]], [scaled], name=g.unique(f"{fused_base}_RowScale")))
            fused_out = scaled
        if add is not None:
            biased = g.unique(f"{fused_out}_bias")
            bias = _concat_inits(g, [t[1].input[1] for t in tails], 0, f"{fused_base}_bias")  # type: ignore[union-attr]
            extra.append(helper.make_node("Add", [fused_out, bias], [biased], name=g.unique(f"{fused_base}_Bias")))
            fused_out = biased
        outs = [(t[1] or t[0] or n).output[0] for t, n in zip(tails, nodes, strict=True)]  # type: ignore[union-attr]
        for t in tails:
            for extra_node in t:  # type: ignore[union-attr]
                if extra_node is not None:
                    g.nodes.remove(extra_node)
        split_sizes = g.add_init(tensor(np.array(sizes, np.int64), g.unique(f"{fused_base}_split_sizes")))
        split = helper.make_node("Split", [fused_out, split_sizes], outs, name=g.unique(f"{fused_base}_Split"), axis=-1)
        i = min(g.index(n) for n in nodes)
        for n in nodes:
            g.nodes.remove(n)
        g.nodes[i:i] = [fused, *extra, split]
        return
    else:  # MatMulNBits: every tensor is laid out per output row -> concatenate along N (axis 0)
        sizes = [int(attr(n, "N")) for n in nodes]
        padded = [list(n.input) + [""] * (6 - len(n.input)) for n in nodes]
        suffix = ["", "_nbits", "_nbits_scales", "_nbits_zero_points", "", "_nbits_bias"]
        ins = [x]
        for i in range(1, 6):
            if i == 4 or not padded[0][i]:
                ins.append("")
                continue
            ins.append(_concat_inits(g, [p[i] for p in padded], 0, f"{fused_base}{suffix[i]}"))
        while ins and not ins[-1]:
            ins.pop()
        n0 = nodes[0]
        fused = helper.make_node("MatMulNBits", ins, [fused_out], name=g.unique(f"{fused_base}_MatMulNBits"),
                                 domain=MS_DOMAIN, K=attr(n0, "K"), N=sum(sizes), bits=attr(n0, "bits", 4),
                                 block_size=attr(n0, "block_size"), accuracy_level=attr(n0, "accuracy_level", 0))
    split_sizes = g.add_init(tensor(np.array(sizes, np.int64), g.unique(f"{fused_base}_split_sizes")))
    split = helper.make_node("Split", [fused_out, split_sizes], [n.output[0] for n in nodes],
                             name=g.unique(f"{fused_base}_Split"), axis=-1)
    i = min(g.index(n) for n in nodes)
    for n in nodes:
        g.nodes.remove(n)
    g.nodes[i:i] = [fused, split]
