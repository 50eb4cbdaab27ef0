"""ONNX Runtime's registered contrib-op schemas: an onnx.defs.OpSchema for onnxscript, and validation.

ONNX does not know the com.microsoft ops; ONNX Runtime registers them (with their inputs, attributes
and type constraints) and exposes them through `get_all_operator_schema()`. `onnx_schema()` turns one
into an `onnx.defs.OpSchema` so onnxscript can build the node (positional inputs with optional
holes, attributes by name). `validate_node()` checks a node against the registered schema: domain,
input and output counts and order (required inputs present, no input past the last declared one),
attribute names, types and required attributes, and the element types of the inputs and outputs
where the graph knows them (each within its type constraint, one type per homogeneous constraint).
"""

from __future__ import annotations

import functools
from typing import Any

DOMAIN = "com.microsoft"


@functools.cache
def ort_schema(name: str, domain: str = DOMAIN) -> Any:
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    found = [s for s in C.get_all_operator_schema() if s.name == name and s.domain == domain]
    if not found:
        raise LookupError(f"ONNX Runtime registers no schema {domain}.{name}")
    return max(found, key=lambda s: s.since_version)


def missing_input(name: str, input_name: str, domain: str = DOMAIN) -> str | None:
    """Why this ONNX Runtime's `domain.name` cannot take the input `input_name` (an op that gained inputs in a
    later release), or None when its registered schema has it."""
    import onnxruntime

    try:
        inputs = [p.name for p in ort_schema(name, domain).inputs]
    except LookupError as e:
        return str(e)
    if input_name in inputs:
        return None
    return f"{domain}.{name} of onnxruntime {onnxruntime.__version__} has no input {input_name!r}"


@functools.cache
def onnx_schema(name: str, domain: str = DOMAIN) -> Any:
    """The ONNX Runtime schema as an onnx.defs.OpSchema (for onnxscript's Op)."""
    from onnx import defs

    s = ort_schema(name, domain)
    opt = defs.OpSchema.FormalParameterOption

    def param(p: Any) -> Any:
        return defs.OpSchema.FormalParameter(p.name, p.typeStr, p.description,
                                             param_option=getattr(opt, p.option.name),
                                             is_homogeneous=bool(p.isHomogeneous))

    return defs.OpSchema(
        s.name, s.domain, s.since_version, "",
        inputs=[param(p) for p in s.inputs],
        outputs=[param(p) for p in s.outputs],
        type_constraints=[(tc.type_param_str, list(tc.allowed_type_strs), "") for tc in s.type_constraints],
        attributes=[defs.OpSchema.Attribute(a.name, getattr(defs.OpSchema.AttrType, a.type.name), "",
                                            required=bool(a.required)) for a in s.attributes.values()],
    )


def _elem_name(elem: int) -> str:
    from onnx import helper

    return f"tensor({helper.tensor_dtype_to_np_dtype(elem).name})" if elem else "?"


_ONNX_TYPE_STR = {  # TensorProto element type -> ONNX type string
    1: "tensor(float)", 2: "tensor(uint8)", 3: "tensor(int8)", 5: "tensor(int16)", 6: "tensor(int32)",
    7: "tensor(int64)", 9: "tensor(bool)", 10: "tensor(float16)", 11: "tensor(double)", 16: "tensor(bfloat16)",
    17: "tensor(float8e4m3fn)",
}


def validate_node(node: Any, elem_types: dict[str, int] | None = None) -> list[str]:
    """Problems of `node` against ONNX Runtime's schema for its op (empty list: valid).

    `elem_types` maps value names to TensorProto element types (from shape inference / graph I/O);
    values not in it are not type-checked."""
    from onnx import AttributeProto

    elem_types = elem_types or {}
    where = f"{node.op_type} node {node.name!r}"
    if node.domain != DOMAIN:
        return [f"{where}: domain {node.domain!r}, expected {DOMAIN!r}"]
    try:
        s = ort_schema(node.op_type)
    except LookupError as e:
        return [f"{where}: {e}"]
    problems: list[str] = []
    bound: dict[str, str] = {}

    def check_values(kind: str, names: list[str], params: list[Any], max_count: int) -> None:
        if len(names) > max_count:
            problems.append(f"{where}: {len(names)} {kind}s, the schema declares at most {max_count}")
        for i, p in enumerate(params):
            given = i < len(names) and names[i] != ""
            if p.option.name == "Single" and not given:
                problems.append(f"{where}: required {kind} {i} ({p.name}) is missing")
            if not given:
                continue
            elem = elem_types.get(names[i])
            if elem is None:
                continue
            ts = _ONNX_TYPE_STR.get(elem, f"elem{elem}")
            allowed = next((list(tc.allowed_type_strs) for tc in s.type_constraints if tc.type_param_str == p.typeStr),
                           [p.typeStr])
            if ts not in allowed:
                problems.append(f"{where}: {kind} {i} ({p.name}) is {ts}, allowed {p.typeStr} in {allowed}")
            elif p.typeStr in bound and bound[p.typeStr] != ts:
                problems.append(f"{where}: {kind} {i} ({p.name}) is {ts} but {p.typeStr} is already {bound[p.typeStr]}")
            else:
                bound.setdefault(p.typeStr, ts)

    check_values("input", list(node.input), list(s.inputs), s.max_input)
    check_values("output", list(node.output), list(s.outputs), s.max_output)
    given = {a.name: a for a in node.attribute}
    for name, a in given.items():
        if name not in s.attributes:
            problems.append(f"{where}: unknown attribute {name!r} (known: {', '.join(sorted(s.attributes))})")
            continue
        want = s.attributes[name].type.name
        got = AttributeProto.AttributeType.Name(a.type)
        if got != want:
            problems.append(f"{where}: attribute {name!r} is {got}, the schema says {want}")
    for name, a in s.attributes.items():
        if a.required and name not in given:
            problems.append(f"{where}: required attribute {name!r} is missing")
    return problems


def graph_elem_types(model: Any) -> dict[str, int]:
    """Element types of the graph's values: inputs, outputs, initializers and ONNX shape inference
    (which types what it can; ops it does not know leave their outputs untyped)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # pragma: no cover - inference is best effort
        inferred = model
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def validate_model(model: Any, op_type: str) -> dict[str, Any]:
    """Validate every `op_type` node of `model` against ONNX Runtime's schema."""
    types = graph_elem_types(model)
    nodes = [n for n in model.graph.node if n.op_type == op_type]
    problems = [p for n in nodes for p in validate_node(n, types)]
    typed = sum(1 for n in nodes for x in n.input if x and x in types)
    return {"op_type": op_type, "nodes": len(nodes), "typed_inputs": typed, "problems": problems}


__all__ = ["graph_elem_types", "onnx_schema", "ort_schema", "validate_model", "validate_node"]
