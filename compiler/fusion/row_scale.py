"""A per-token INT8 GEMM's row-scale Mul feeding optimize.SiluMul -> SiluMul's own scale input.

With `quantize_int8 {activations: per_token}` every Linear's output is the integer GEMM's result times
the row scale of its quantized input (compiler/quant/onnx_rules.py, DqGemmToInt8):

    xq, s = QuantizeRows(x)                      s [T, 1], one scale per token
    y = Mul(MatMulIntegerToFloat(xq, w, ...), s)

After `gate_up`, `swiglu` and `quantize_rows`, the MLP reads SiluMul(Mul(gate_up, s)): a whole pass over
the [T, 2I] projection output (the largest activation of a decoder layer) only to multiply each row by
one number. SiluMul takes that number as its optional second input and multiplies each row by it before
the SiLU (runtime/kernels/op_silu_mul.c), the same float32 products the Mul computed, so the
outputs are bit-identical (tests/test_paged_cpu_kernel.py, tests/test_fusion.py).

The rule fires only where the scale is QuantizeRows' second output (so it is one value per row) and the
Mul's output is read by the SiluMul alone.
"""

from __future__ import annotations

import onnx
from onnx import helper

from compiler.fusion.graph import FusionGraph, RuleReport

DOMAIN = "optimize"


def row_scaled(producers: dict[str, onnx.NodeProto], name: str) -> tuple[onnx.NodeProto, str, str] | None:
    """(Mul, x, s) when `name` is a per-token GEMM's scaled output Mul(x, s), s QuantizeRows' scale output (one
    value per row); None otherwise. (compiler/fusion/skip_norm_quantize.py folds the same Mul.)"""
    mul = producers.get(name)
    if mul is None or mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx"):
        return None
    scaled = [i for i, x in enumerate(mul.input)
              if (p := producers.get(x)) is not None and p.op_type == "QuantizeRows" and p.domain == DOMAIN
              and list(p.output[1:2]) == [x]]
    if len(scaled) != 1:
        return None
    return mul, mul.input[1 - scaled[0]], mul.input[scaled[0]]


def fuse_row_scale(g: FusionGraph) -> RuleReport:
    report = RuleReport()
    if not any(n.domain == DOMAIN for n in g.nodes):
        return report
    producers = g.producer_map()
    consumers = g.consumer_map()
    for sm in [n for n in g.nodes if n.op_type == "SiluMul" and n.domain == DOMAIN and len(n.input) == 1]:
        found = row_scaled(producers, sm.input[0])
        if found is None:
            continue  # not a per-token GEMM's row scale
        mul, x, s = found
        if consumers.get(mul.output[0], []) != [sm] or mul.output[0] in g.graph_outputs:
            report.miss(sm.output[0], "the scaled projection is read by more than the SiluMul")
            continue
        node = helper.make_node("SiluMul", [x, s], list(sm.output), name=g.unique(f"{sm.name}_scaled"), domain=DOMAIN)
        g.nodes[g.index(sm)] = node
        g.nodes.remove(mul)
        report.fired += 1
    return report
