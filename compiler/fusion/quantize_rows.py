"""Per-token INT8 activation quantization (six nodes) -> one optimize.QuantizeRows node.

quantize_int8 with `activations: per_token` quantizes each Linear input at run time as
(compiler/quant/onnx_rules.py, DqGemmToInt8)

    s  = Max(Mul(ReduceMax(Abs(x), axes=[-1], keepdims=1), 1/127), 1e-12)      [T, 1]
    xq = QuantizeLinear(Div(x, s), 1.0, uint8 128)                            [T, K] uint8

six nodes and four passes over [T, K] per quantized tensor (four per decoder layer). The C library of
the paged_cpu kernel has the same computation as one op, `optimize.QuantizeRows(x) -> (xq, s)`
(runtime/kernels/op_quantize_rows.c): the same float operations in the same order, so the codes and
scales are the ones the six nodes give (tests/test_paged_cpu_kernel.py compares them exactly).

The rule fires only in graphs that already use the library (a node of domain `optimize`: the paged_cpu
attention), whose runtime.json makes the backend register it; other graphs keep the standard nodes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from compiler.fusion.graph import FusionGraph, RuleReport, attr, const_array

DOMAIN = "optimize"


def _scalar(g: FusionGraph, name: str) -> np.ndarray | None:
    a = const_array(g, name)
    return a if a is not None and a.size == 1 else None


def _match(g: FusionGraph, q: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> tuple[str, str] | str | None:
    """(x, s) when QuantizeLinear `q` ends the pattern; a reason when it half-matches; None otherwise."""
    def prod(name: str, op: str) -> onnx.NodeProto | None:
        p = producers.get(name)
        return p if p is not None and p.op_type == op and p.domain in ("", "ai.onnx") else None

    div = prod(q.input[0], "Div")
    if div is None:
        return None
    x, s = div.input
    one = _scalar(g, q.input[1]) if len(q.input) > 1 else None
    zp = _scalar(g, q.input[2]) if len(q.input) > 2 else None
    if one is None or float(one.reshape(-1)[0]) != 1.0 or zp is None or zp.dtype != np.uint8 \
            or int(zp.reshape(-1)[0]) != 128 or attr(q, "axis", 1) not in (1, -1) or attr(q, "saturate", 1) != 1:
        return "QuantizeLinear is not (scale 1, uint8 zero point 128)"
    mx = prod(s, "Max")
    mul = prod(mx.input[0], "Mul") if mx is not None else None
    red = prod(mul.input[0], "ReduceMax") if mul is not None else None
    ab = prod(red.input[0], "Abs") if red is not None else None
    if ab is None or ab.input[0] != x:
        return "the scale is not Max(Mul(ReduceMax(Abs(x)), c), tiny) of the divided tensor"
    tiny, inv = _scalar(g, mx.input[1]), _scalar(g, mul.input[1])  # type: ignore[union-attr]
    axes = const_array(g, red.input[1]) if len(red.input) > 1 else None
    if tiny is None or inv is None or tiny.dtype != np.float32 or inv.dtype != np.float32 \
            or tiny.reshape(-1)[0] != np.float32(1e-12) or inv.reshape(-1)[0] != np.float32(1 / 127):
        return "the scale's constants are not float32 1/127 and 1e-12"
    if axes is None or axes.reshape(-1).tolist() != [-1] or attr(red, "keepdims", 1) != 1:
        return "ReduceMax is not over the last axis with keepdims"
    return x, s


def fuse_quantize_rows(g: FusionGraph) -> RuleReport:
    report = RuleReport()
    if not any(n.domain == DOMAIN for n in g.nodes):
        return report
    producers = g.producer_map()
    consumers = g.consumer_map()
    for q in [n for n in g.nodes if n.op_type == "QuantizeLinear" and n.domain in ("", "ai.onnx")]:
        m = _match(g, q, producers)
        if m is None:
            continue
        if isinstance(m, str):
            report.miss(q.output[0], m)
            continue
        x, s = m
        div = producers[q.input[0]]
        mx = producers[s]
        mul = producers[mx.input[0]]
        red = producers[mul.input[0]]
        ab = producers[red.input[0]]
        # the intermediates must serve only the pattern (the scale itself may be read by anyone: it stays)
        if any(len(consumers.get(n.output[0], [])) != 1 or n.output[0] in g.graph_outputs
               for n in (div, mul, red, ab)):
            report.miss(q.output[0], "an intermediate of the pattern has other uses")
            continue
        node = helper.make_node("QuantizeRows", [x], [q.output[0], s], name=g.unique(f"{q.name}_rows"),
                                domain=DOMAIN)
        # the new node stands where the Abs stood: after x exists, before every reader of s and of the codes
        g.nodes[g.index(ab)] = node
        for dead in (red, mul, mx, div, q):
            g.nodes.remove(dead)
        report.fired += 1
    return report
