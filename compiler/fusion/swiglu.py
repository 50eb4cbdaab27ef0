"""A SwiGLU MLP's Split + QuickGelu(alpha 1) + Mul -> one optimize.SiluMul node.

After `gate_up` and `quick_gelu`, a Llama-family MLP reads

    gate, up = Split(gate_up, [I, I], axis=-1);  h = QuickGelu(gate, alpha=1) * up;  down_proj(h)

three nodes and three passes over the [T, 2I] projection output (the Split copies both halves). The C
library of the paged_cpu kernel computes h = silu(x[.., :I]) * x[.., I:] from the fused output in one
pass (`optimize.SiluMul`, runtime/kernels/op_silu_mul.c), so a decoder layer is the minimum
ONNX Runtime runs it with: norm, QKV, rotary attention, o_proj, skip-norm, gate/up, SiluMul, down,
skip-norm. Numbers change by float rounding only (the sigmoid's exp: ~2 ulp, against MLAS's logistic).

Like `quantize_rows`, the rule fires only in graphs that already use the library (a node of domain
`optimize`), whose runtime.json makes the backend register it; other graphs keep the standard nodes.
"""

from __future__ import annotations

from onnx import helper

from compiler.fusion.graph import MS_DOMAIN, FusionGraph, RuleReport, attr, const_array

DOMAIN = "optimize"
OP_TYPE = "SiluMul"


def fuse_swiglu(g: FusionGraph) -> RuleReport:
    report = RuleReport()
    if not any(n.domain == DOMAIN for n in g.nodes):
        return report
    consumers = g.consumer_map()
    for split in [n for n in g.nodes if n.op_type == "Split" and n.domain in ("", "ai.onnx")]:
        if len(split.output) != 2 or len(split.input) < 2:
            continue
        gate, up = split.output
        users = consumers.get(gate, [])
        gelu = users[0] if len(users) == 1 else None
        if gelu is None or gelu.op_type != "QuickGelu" or gelu.domain != MS_DOMAIN:
            continue  # not an MLP's split (q/k/v, or a gate read elsewhere)
        where = split.output[0]
        sizes = const_array(g, split.input[1])
        if attr(split, "axis", 0) != -1 or sizes is None or sizes.size != 2 or int(sizes[0]) != int(sizes[1]):
            report.miss(where, "the Split is not two equal halves of the last axis")
            continue
        if abs(attr(gelu, "alpha", 1.702) - 1.0) > 0:
            report.miss(where, "QuickGelu's alpha is not 1 (not SiLU)")
            continue
        act = gelu.output[0]
        mul_users, up_users = consumers.get(act, []), consumers.get(up, [])
        mul = mul_users[0] if len(mul_users) == 1 else None
        if mul is None or mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") \
                or sorted(mul.input) != sorted([act, up]) or up_users != [mul]:
            report.miss(where, "SiLU(gate) is not multiplied by up alone")
            continue
        if any(x in g.graph_outputs for x in (gate, up, act)):
            report.miss(where, "an intermediate is a graph output")
            continue
        node = helper.make_node(OP_TYPE, [split.input[0]], [mul.output[0]], name=g.unique(f"{mul.name}_silu_mul"),
                                domain=DOMAIN)
        g.nodes[g.index(mul)] = node
        g.nodes.remove(gelu)
        g.nodes.remove(split)
        report.fired += 1
    return report
