"""What TensorRT's ONNX parser reads, checked on the lowered graph before a GPU is involved.

`SUPPORT` lists, for every op the compiler can emit, the element types TensorRT 10's ONNX parser
accepts for the op's data input (from onnx-tensorrt's operator support matrix). `unsupported_nodes`
walks a graph with the element type of every tensor (from the graph's value_info, completed by
simple type rules) and reports each node TensorRT would refuse: a non-standard domain (ONNX Runtime
contrib ops), an op missing from the table, an element type the op does not take, or an asymmetric
DequantizeLinear (TensorRT quantization is symmetric: zero points must be 0).

`legalize` rewrites the two patterns torch's exporter emits for our model definition that TensorRT
does not read, into equivalent supported ops:

- `Clip` on integers (`block_table.clamp(min=0)`): `Max(x, min)` / `Min(x, max)` (Clip takes floats only);
- `Equal` on booleans (the sign test of integer floor division): `Not(Xor(a, b))`.

Both rewrites are exact; the build checks the result again and refuses anything left.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# ONNX TensorProto element types
FLOAT, UINT8, INT8, INT32, INT64, BOOL, FLOAT16, DOUBLE, BFLOAT16 = 1, 2, 3, 6, 7, 9, 10, 11, 16
FLOAT8E4M3FN, UINT4, INT4, FLOAT4E2M1 = 17, 21, 22, 23
TYPE_NAMES = {FLOAT: "float32", UINT8: "uint8", INT8: "int8", 4: "uint16", 5: "int16", INT32: "int32",
              INT64: "int64", 8: "string", BOOL: "bool", FLOAT16: "float16", DOUBLE: "float64", 12: "uint32",
              13: "uint64", BFLOAT16: "bfloat16", FLOAT8E4M3FN: "float8e4m3fn", 18: "float8e4m3fnuz",
              19: "float8e5m2", 20: "float8e5m2fnuz", UINT4: "uint4", INT4: "int4", FLOAT4E2M1: "float4e2m1"}

_FP = frozenset({FLOAT, FLOAT16, BFLOAT16, DOUBLE})  # double: the parser casts it down to float
_INT = frozenset({INT32, INT64})
_BOOL = frozenset({BOOL})
_ANY = _FP | _INT | _BOOL
_QUANTIZED = frozenset({INT8, FLOAT8E4M3FN, INT4, FLOAT4E2M1})

# op -> (index of the input whose element type is checked, accepted element types); TensorRT 10.
SUPPORT: dict[str, tuple[int, frozenset[int]]] = {
    **{op: (0, _FP | _INT) for op in (
        "Abs", "Add", "Sub", "Mul", "Div", "Neg", "Sum", "Max", "Min", "Pow", "Mod", "Sign", "Equal", "Greater",
        "GreaterOrEqual", "Less", "LessOrEqual", "Relu", "Range", "ArgMax", "ArgMin", "TopK", "Pad", "IsNaN",
        "ScatterND", "ScatterElements", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")},
    **{op: (0, _FP) for op in (
        "Ceil", "Floor", "Cos", "Sin", "Sqrt", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Reciprocal", "Softmax",
        "LogSoftmax", "Gemm", "MatMul", "Clip", "LayerNormalization", "RMSNormalization", "RotaryEmbedding",
        "CumSum", "Einsum", "IsInf", "QuantizeLinear")},
    **{op: (0, _ANY) for op in (
        "Concat", "Expand", "Flatten", "Gather", "GatherElements", "GatherND", "Identity", "Reshape", "Shape",
        "Size", "Slice", "Split", "Squeeze", "Unsqueeze", "Transpose", "Tile", "Trilu")},
    **{op: (0, _BOOL) for op in ("And", "Or", "Not", "Xor")},
    "Cast": (0, _ANY | {UINT8}),
    "CastLike": (0, _ANY | {UINT8}),
    "Where": (1, _ANY),
    "DequantizeLinear": (0, _QUANTIZED),
    "Constant": (-1, frozenset()),  # any
    "ConstantOfShape": (-1, frozenset()),
}
_BOOL_OUT = {"Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Not", "Xor", "IsNaN", "IsInf"}
_INT64_OUT = {"Shape", "Size", "ArgMax", "ArgMin", "NonZero"}


def _attr(node: Any, name: str) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def element_types(model: Any) -> dict[str, int]:
    """name -> ONNX element type of every tensor of the main graph (value_info first, then type rules)."""
    g = model.graph
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in g.initializer:
        types[t.name] = t.data_type
    for node in g.node:
        ins = [types.get(x) if x else None for x in node.input]
        for k, out in enumerate(node.output):
            if not out or out in types:
                continue
            op = node.op_type
            t: int | None
            if op == "Cast":
                t = _attr(node, "to")
            elif op == "CastLike":
                t = ins[1] if len(ins) > 1 else None
            elif op in _BOOL_OUT:
                t = BOOL
            elif op in _INT64_OUT or (op == "TopK" and k == 1):
                t = INT64
            elif op in ("Constant", "ConstantOfShape"):
                value = _attr(node, "value")
                t = value.data_type if value is not None else (INT64 if _attr(node, "value_int") is not None
                                                               or _attr(node, "value_ints") is not None else FLOAT)
            elif op == "Where":
                t = ins[1] if len(ins) > 1 else None
            elif op == "DequantizeLinear":
                t = ins[1] if len(ins) > 1 else FLOAT
            elif op == "QuantizeLinear":
                t = ins[2] if len(ins) > 2 and ins[2] else (_attr(node, "output_dtype") or UINT8)
            else:
                t = next((x for x in ins if x), None)
            if t:
                types[out] = int(t)
    return types


def _zero_point_is_zero(model: Any, name: str) -> bool | None:
    """True/False for an initializer zero point; None when it is computed in the graph."""
    from onnx import numpy_helper

    for t in model.graph.initializer:
        if t.name == name:
            return not numpy_helper.to_array(t).astype("float64").any()
    return None


def unsupported_nodes(model: Any) -> list[dict[str, str]]:
    """Nodes TensorRT's ONNX parser would refuse, each with the reason (empty: the graph parses)."""
    types = element_types(model)
    found: list[dict[str, str]] = []
    for node in model.graph.node:
        op = node.op_type
        where = {"node": node.name or (node.output[0] if node.output else op), "op": op}
        if node.domain not in ("", "ai.onnx"):
            found.append({**where, "reason": f"{node.domain}.{op} is not a standard ONNX op (an ONNX Runtime "
                                             "contrib op); TensorRT's ONNX parser reads the standard domain only"})
            continue
        rule = SUPPORT.get(op)
        if rule is None:
            found.append({**where, "reason": f"{op} is not in TensorRT's ONNX operator support list"})
            continue
        index, allowed = rule
        if index >= 0 and index < len(node.input) and node.input[index]:
            t = types.get(node.input[index])
            if t is not None and t not in allowed:
                accepted = ", ".join(sorted(TYPE_NAMES[a] for a in allowed))
                found.append({**where, "reason": f"{op} on {TYPE_NAMES.get(t, t)} (TensorRT takes {accepted})"})
                continue
        if op == "DequantizeLinear" and len(node.input) > 2 and node.input[2]:
            if _zero_point_is_zero(model, node.input[2]) is not True:
                found.append({**where, "reason": "DequantizeLinear with a nonzero zero point: TensorRT "
                                                 "quantization is symmetric (zero points must be 0)"})
    return found


def has_qdq(model: Any) -> bool:
    """Whether the graph holds QuantizeLinear/DequantizeLinear (explicit quantization)."""
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def legalize(model: Any) -> dict[str, int]:
    """Rewrite integer Clip and boolean Equal (in place) into ops TensorRT reads; returns the counts."""
    from onnx import helper

    types = element_types(model)
    counts = {"Clip(int) -> Max/Min": 0, "Equal(bool) -> Not(Xor)": 0}
    new_nodes = []
    for node in model.graph.node:
        first = types.get(node.input[0]) if node.input and node.input[0] else None
        base = node.name or node.output[0]
        if node.op_type == "Clip" and node.domain in ("", "ai.onnx") and first in _INT:
            x, out = node.input[0], node.output[0]
            lo = node.input[1] if len(node.input) > 1 and node.input[1] else None
            hi = node.input[2] if len(node.input) > 2 and node.input[2] else None
            if lo and hi:
                mid = f"{out}__max"
                new_nodes += [helper.make_node("Max", [x, lo], [mid], name=f"{base}/max"),
                              helper.make_node("Min", [mid, hi], [out], name=f"{base}/min")]
            elif lo or hi:
                new_nodes.append(helper.make_node("Max" if lo else "Min", [x, lo or hi], [out],
                                                  name=f"{base}/{'max' if lo else 'min'}"))
            else:
                new_nodes.append(helper.make_node("Identity", [x], [out], name=f"{base}/identity"))
            counts["Clip(int) -> Max/Min"] += 1
        elif node.op_type == "Equal" and node.domain in ("", "ai.onnx") and first == BOOL:
            mid = f"{node.output[0]}__xor"
            new_nodes += [helper.make_node("Xor", list(node.input), [mid], name=f"{base}/xor"),
                          helper.make_node("Not", [mid], [node.output[0]], name=f"{base}/not")]
            counts["Equal(bool) -> Not(Xor)"] += 1
        else:
            new_nodes.append(node)
    if any(counts.values()):
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
        log.info("legalized for TensorRT: %s", counts)
    return counts


__all__ = ["SUPPORT", "element_types", "has_qdq", "legalize", "unsupported_nodes"]
