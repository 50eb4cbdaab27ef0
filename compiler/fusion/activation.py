"""SiLU -> com.microsoft.QuickGelu (alpha 1.0).

QuickGelu(x) = x * Sigmoid(alpha * x); with alpha = 1 it is SiLU, which our MLP lowers to
Sigmoid(gate) -> Mul(gate, .). The rule rewrites that pair into one QuickGelu node (output name
unchanged), so the MLP becomes QuickGelu(gate) * up -> down_proj. (onnxscript has no SiLU fusion
for ONNX Runtime; ONNX Runtime's own QuickGeluFusion does the same at session creation, the rule
puts it in the artifact so every consumer sees the fused form.)
"""

from __future__ import annotations

from onnx import helper

from compiler.fusion.graph import MS_DOMAIN, FusionGraph, RuleReport


def fuse_quick_gelu(g: FusionGraph) -> RuleReport:
    report = RuleReport()
    consumers = g.consumer_map()
    for sig in [n for n in g.nodes if n.op_type == "Sigmoid" and n.domain in ("", "ai.onnx")]:
        x, s = sig.input[0], sig.output[0]
        users = consumers.get(s, [])
        if len(users) != 1 or s in g.graph_outputs:
            report.miss(s, "the Sigmoid output has other uses")
            continue
        mul = users[0]
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or sorted(mul.input) != sorted([x, s]):
            report.miss(s, "Sigmoid(x) is not multiplied by x")
            continue
        node = helper.make_node("QuickGelu", [x], [mul.output[0]], name=g.unique(f"{mul.output[0]}_QuickGelu"),
                                domain=MS_DOMAIN, alpha=1.0)
        g.nodes[g.index(mul)] = node
        g.nodes.remove(sig)
        report.fired += 1
    return report
