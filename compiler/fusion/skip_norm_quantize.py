"""Row-scale Mul + SkipSimplifiedLayerNormalization + QuantizeRows -> one optimize.SkipNormQuantize node.

In a W8A8 graph (`quantize_int8 {activations: per_token}`) after `skip_rms_norm` and `quantize_rows`,
the attention and the MLP of every decoder layer end as

    y = Mul(MatMulIntegerToFloat(xq, w, ...), s)          s: QuantizeRows' scale of xq, one per row
    n, _, _, sum = SkipSimplifiedLayerNormalization(y, skip, gamma)
    codes, scale = QuantizeRows(n)

three nodes, each a pass over [T, D], two of whose outputs (y and n) only feed the next one. The C
library computes all of it as `optimize.SkipNormQuantize(x, skip, gamma, s) -> (codes, scale, sum)`
(runtime/kernels/op_skip_norm_quantize.c) with the same float operations in the same order, so the
codes, scales and residual sums are bit-identical (tests/test_paged_cpu_kernel.py, tests/test_fusion.py).

The rule fires where QuantizeRows reads output 0 of a SkipSimplifiedLayerNormalization without bias
whose normalized output nothing else reads; the Mul is folded in (input `s`) where it multiplies one
of the norm's two summands by a QuantizeRows scale and nothing else reads the product, and is left in
place (the op then takes no `s`) otherwise.
"""

from __future__ import annotations

from onnx import helper

from compiler.fusion.graph import MS_DOMAIN, FusionGraph, RuleReport
from compiler.fusion.row_scale import row_scaled

DOMAIN = "optimize"


def fuse_skip_norm_quantize(g: FusionGraph) -> RuleReport:
    report = RuleReport()
    if not any(n.domain == DOMAIN for n in g.nodes):
        return report
    producers = g.producer_map()
    consumers = g.consumer_map()
    for q in [n for n in g.nodes if n.op_type == "QuantizeRows" and n.domain == DOMAIN]:
        norm = producers.get(q.input[0])
        if norm is None or norm.op_type != "SkipSimplifiedLayerNormalization" or norm.domain != MS_DOMAIN \
                or norm.output[0] != q.input[0]:
            continue
        if len(norm.input) > 3 and any(norm.input[3:]):
            report.miss(q.output[0], "the norm adds a bias")
            continue
        if consumers.get(norm.output[0], []) != [q] or norm.output[0] in g.graph_outputs:
            report.miss(q.output[0], "the normalized tensor has other readers")
            continue
        if any(o and (consumers.get(o) or o in g.graph_outputs) for o in norm.output[1:3]):
            report.miss(q.output[0], "the norm's mean or inv_std_var output is read")
            continue
        eps = next((a.f for a in norm.attribute if a.name == "epsilon"), None)
        if eps is None:
            report.miss(q.output[0], "the norm has no epsilon attribute")
            continue
        a, b = norm.input[0], norm.input[1]
        inputs = [a, b, norm.input[2]]
        mul = None
        for summand, other in ((a, b), (b, a)):  # the Mul folds in when the norm alone reads its product
            found = row_scaled(producers, summand)
            if found is not None and consumers.get(summand, []) == [norm] and summand not in g.graph_outputs:
                mul, x, s = found
                inputs = [x, other, norm.input[2], s]
                break
        sum_out = norm.output[3] if len(norm.output) > 3 and norm.output[3] else g.unique(f"{norm.name}_sum")
        node = helper.make_node("SkipNormQuantize", inputs, [q.output[0], q.output[1], sum_out],
                                name=g.unique(f"{norm.name}_quantized"), domain=DOMAIN, epsilon=eps)
        # the new node stands where the norm stood: after both summands exist, before every reader
        g.nodes[g.index(norm)] = node
        g.nodes.remove(q)
        if mul is not None:
            g.nodes.remove(mul)
        report.fired += 1
    return report
