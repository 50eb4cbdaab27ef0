"""Graph helpers shared by the fusion rules (plain GraphProto edits, in the style of
compiler/quant/onnx_rules.py, whose `Graph` this extends).

Every rule records what it did in a `RuleReport`: how often it fired and, for each candidate it
looked at but left alone, why (the pass puts both into the manifest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto

from compiler import streamed
from compiler.quant.onnx_rules import MS_DOMAIN, Graph, attr

__all__ = ["MS_DOMAIN", "FusionGraph", "RuleReport", "attr", "const_array", "const_value", "shape_of", "tensor"]


@dataclass
class RuleReport:
    fired: int = 0
    not_fused: dict[str, str] = field(default_factory=dict)  # candidate -> reason

    def miss(self, what: str, why: str) -> None:
        self.not_fused.setdefault(what, why)


class FusionGraph(Graph):
    """`Graph` plus value shapes (from value_info / graph inputs and outputs) and dead-code removal."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        g = model.graph
        self.value_info: dict[str, onnx.ValueInfoProto] = {}
        for v in [*g.input, *g.output, *g.value_info]:
            self.value_info.setdefault(v.name, v)
        self.graph_outputs = {o.name for o in g.output}

    def consumer_map(self) -> dict[str, list[onnx.NodeProto]]:
        out: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for x in n.input:
                if x:
                    out.setdefault(x, []).append(n)
        return out

    def producer_map(self) -> dict[str, onnx.NodeProto]:
        return {x: n for n in self.nodes for x in n.output if x}

    def remove_dead(self) -> int:
        """Drop nodes none of whose outputs is read (by a live node or as a graph output)."""
        needed = set(self.graph_outputs)
        keep: list[onnx.NodeProto] = []
        for n in reversed(self.nodes):
            if any(o and o in needed for o in n.output):
                keep.append(n)
                needed.update(x for x in n.input if x)
        removed = len(self.nodes) - len(keep)
        self.nodes = keep[::-1]
        return removed

    def ensure_opset(self, domain: str, version: int = 1) -> None:
        if not any(o.domain == domain for o in self.model.opset_import):
            self.model.opset_import.append(onnx.helper.make_opsetid(domain, version))


def shape_of(g: FusionGraph, name: str) -> list[int | str | None] | None:
    """Static dims as ints, symbolic dims as their names, unknown dims as None; None if no shape."""
    v = g.value_info.get(name)
    if v is None or not v.type.HasField("tensor_type") or not v.type.tensor_type.HasField("shape"):
        init = g.inits.get(name)
        return list(init.dims) if init is not None else None
    dims: list[int | str | None] = []
    for d in v.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def const_array(g: FusionGraph, name: str) -> np.ndarray | None:
    """The value of an initializer (None when `name` is not a constant initializer; a streamed one is
    computed: for the small constants rules read, not for weights)."""
    init = g.inits.get(name)
    return None if init is None else streamed.array_of(init)


def const_value(g: FusionGraph, name: str) -> np.ndarray | streamed.Deferred | None:
    """An initializer's array, or its Deferred when it is streamed (not computed)."""
    init = g.inits.get(name)
    return None if init is None else streamed.value_of(init)


def tensor(array: np.ndarray | streamed.Deferred, name: str) -> TensorProto:
    return streamed.tensor(array, name)

