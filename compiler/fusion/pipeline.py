"""The fusion driver: runs the rules of compiler/fusion/ in order, counts, cleans up, checks (see
compiler/fusion/__init__.py)."""

from __future__ import annotations

import contextlib
import re
import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import onnx

from compiler.fusion import RULES
from compiler.fusion.graph import MS_DOMAIN, FusionGraph, RuleReport
from compiler.streamed import checkable, is_streamed, streamed_count
from runtime.kernels.paged_attention_cpu import register, uses_kernel

IMPLEMENTATION = {
    "rms_norm": "onnxscript.rewriter.ort_fusions.rms_normalization",
    "skip_rms_norm": "onnxscript.rewriter.ort_fusions.skip_normalization (SkipRmsNorm; rank-2 shape check: "
                     "compiler/fusion/norm.py)",
    "qkv": "compiler/fusion/projections.py",
    "gate_up": "compiler/fusion/projections.py",
    "rotary": "compiler/fusion/rotary.py",
    "rotary_attention": "compiler/fusion/attention.py (optimize.RotaryPagedAttention, "
                        "runtime/kernels/op_rotary_paged_attention.c)",
    "quick_gelu": "compiler/fusion/activation.py",
    "swiglu": "compiler/fusion/swiglu.py (optimize.SiluMul, runtime/kernels/op_silu_mul.c)",
    "quantize_rows": "compiler/fusion/quantize_rows.py (optimize.QuantizeRows, runtime/kernels/op_quantize_rows.c)",
    "row_scale": "compiler/fusion/row_scale.py (optimize.SiluMul's scale input, runtime/kernels/op_silu_mul.c)",
    "skip_norm_quantize": "compiler/fusion/skip_norm_quantize.py (optimize.SkipNormQuantize, "
                          "runtime/kernels/op_skip_norm_quantize.c)",
    "matmul_bf16": "compiler/fusion/matmul_bf16.py (optimize.MatMulBf16, runtime/kernels/op_matmul_bf16.c)",
}
# ONNX Runtime registers SimplifiedLayerNormalization in the default domain (opset 1): onnx's
# checker does not know it, so the standard check treats it as a contrib op (see check_model).
DEFAULT_DOMAIN_CONTRIB_OPS = ("SimplifiedLayerNormalization",)


_LAYER = re.compile(r"(?:^|[./_])layers\.(\d+)\.")
_TAIL = re.compile(r"(?:^|[./_])(?:norm\.weight|lm_head\.)")


def nodes_per_layer(model: onnx.ModelProto) -> int | None:
    """Nodes of a typical decoder layer (the median over layers), or None when the graph names no layers.

    Nodes are in export order, layer after layer: a node that reads a weight of layer i starts or
    continues layer i, and nodes that read no weight belong to the layer in progress; nodes before the
    first layer weight and from the final norm's or lm_head's weight on are outside every layer."""
    weights = {t.name for t in model.graph.initializer}
    counts: dict[int, int] = {}
    layer: int | None = None
    for node in model.graph.node:
        named = [x for x in node.input if x in weights]
        found = [int(m.group(1)) for x in named if (m := _LAYER.search(x))]
        if found:
            layer = max(found)
        elif layer is not None and any(_TAIL.search(x) for x in named):  # final norm, lm_head
            break
        if layer is not None:
            counts[layer] = counts.get(layer, 0) + 1
    return int(statistics.median(counts.values())) if counts else None


def fuse_model(model: onnx.ModelProto, rules: Sequence[str], rope_cache_rows: int, matmul_bf16: bool = False
               ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Apply `rules` (names from RULES, run in RULES order), then, with `matmul_bf16` (the target's
    `matmul: bfloat16`), the opt-in rule of that name; returns (model, stats).

    The returned model may be a new ModelProto (the onnxscript rules go through onnx_ir)."""
    unknown = sorted(set(rules) - set(RULES))
    if unknown:
        raise ValueError(f"unknown fusion rule(s) {unknown}; known: {list(RULES)}")
    enabled = [r for r in RULES if r in rules]
    nodes_before = len(model.graph.node)
    per_layer_before = nodes_per_layer(model)
    io_before = ([i.name for i in model.graph.input], [o.name for o in model.graph.output])
    reports: dict[str, RuleReport] = {r: RuleReport() for r in [*RULES, "matmul_bf16"]}

    if "rms_norm" in enabled or "skip_rms_norm" in enabled:
        model = _onnxscript_rules(model, enabled, reports)
    g = FusionGraph(model)
    from compiler.fusion.activation import fuse_quick_gelu
    from compiler.fusion.attention import fuse_rotary_attention
    from compiler.fusion.projections import fuse_projections
    from compiler.fusion.quantize_rows import fuse_quantize_rows
    from compiler.fusion.rotary import fuse_rotary
    from compiler.fusion.row_scale import fuse_row_scale
    from compiler.fusion.skip_norm_quantize import fuse_skip_norm_quantize
    from compiler.fusion.swiglu import fuse_swiglu

    for rule in ("qkv", "gate_up"):
        if rule in enabled:
            reports[rule] = fuse_projections(g, rule)
    if "rotary" in enabled:
        reports["rotary"] = fuse_rotary(g, rope_cache_rows)
    dropped: list[str] = []
    if "rotary_attention" in enabled:
        reports["rotary_attention"], dropped = fuse_rotary_attention(g)
    if "quick_gelu" in enabled:
        reports["quick_gelu"] = fuse_quick_gelu(g)
    if "swiglu" in enabled:
        reports["swiglu"] = fuse_swiglu(g)
    if "quantize_rows" in enabled:
        reports["quantize_rows"] = fuse_quantize_rows(g)
    if "row_scale" in enabled:
        reports["row_scale"] = fuse_row_scale(g)
    if "skip_norm_quantize" in enabled:
        reports["skip_norm_quantize"] = fuse_skip_norm_quantize(g)
    bf16_bytes: dict[str, int] = {}
    if matmul_bf16:
        from compiler.fusion.matmul_bf16 import fuse_matmul_bf16

        reports["matmul_bf16"], bf16_bytes = fuse_matmul_bf16(g)
    _drop_unused_optional_outputs(g)
    g.remove_dead()
    if any(n.domain == MS_DOMAIN for n in g.nodes):
        g.ensure_opset(MS_DOMAIN, 1)
    g.commit()
    # the only change to the interface a rule may make: rotary_attention drops the new K/V outputs
    if ([i.name for i in model.graph.input], [o.name for o in model.graph.output]) != \
            (io_before[0], [o for o in io_before[1] if o not in dropped]):
        raise AssertionError("fusion changed the graph inputs or outputs")  # pragma: no cover
    ops = Counter((f"{n.domain}." if n.domain not in ("", "ai.onnx") else "") + n.op_type for n in model.graph.node)
    opt_in = ["matmul_bf16"] if matmul_bf16 else []
    names, ran = [*RULES, *opt_in], enabled + opt_in
    stats: dict[str, Any] = {
        "rules": ran,
        "disabled": [r for r in RULES if r not in enabled],
        "fusions": {r: reports[r].fired for r in names},
        "nodes_before": nodes_before,
        "nodes_after": len(model.graph.node),
        "nodes_per_layer": {"before": per_layer_before, "after": nodes_per_layer(model)},
        "op_types": dict(sorted(ops.items())),
        "implementation": {r: IMPLEMENTATION[r] for r in ran},
    }
    if matmul_bf16:
        stats["matmul_bf16"] = bf16_bytes
    not_fused = {r: dict(sorted(reports[r].not_fused.items())) for r in names if reports[r].not_fused}
    if not_fused:
        stats["not_fused"] = not_fused
    if dropped:
        stats["outputs_dropped"] = dropped
    if "rotary" in enabled and reports["rotary"].fired:
        stats["rotary_cache_rows"] = rope_cache_rows
    return model, stats


def _onnxscript_rules(model: onnx.ModelProto, enabled: list[str], reports: dict[str, RuleReport]) -> onnx.ModelProto:
    import onnx_ir as ir

    from compiler.fusion.norm import fuse_rms, fuse_skip_rms
    irm = ir.serde.deserialize_model(model)
    if "rms_norm" in enabled:
        reports["rms_norm"].fired = fuse_rms(irm)
    if "skip_rms_norm" in enabled:
        if "rms_norm" not in enabled:
            reports["skip_rms_norm"].miss("*", "needs the rms_norm rule (it matches SimplifiedLayerNormalization)")
        else:
            reports["skip_rms_norm"].fired = fuse_skip_rms(irm)
    out = ir.serde.serialize_model(irm)
    # keep what the onnx_ir round trip does not need to change: producer, and the streamed placeholders as
    # they were (onnx_ir rewrites external tensors' fields; it keeps in-memory ones verbatim)
    out.producer_name, out.producer_version = model.producer_name, model.producer_version
    placeholders = {t.name: t for t in model.graph.initializer if is_streamed(t)}
    for t in out.graph.initializer:
        if t.name in placeholders:
            t.CopyFrom(placeholders[t.name])
    return out


def _drop_unused_optional_outputs(g: FusionGraph) -> None:
    """SkipSimplifiedLayerNormalization's mean / inv_std_var outputs: unnamed when nothing reads them."""
    used = {x for n in g.nodes for x in n.input} | g.graph_outputs
    for n in g.nodes:
        if n.op_type == "SkipSimplifiedLayerNormalization" and n.domain == MS_DOMAIN:
            for i in (1, 2):
                if i < len(n.output) and n.output[i] and n.output[i] not in used:
                    n.output[i] = ""


@contextlib.contextmanager
def _contrib_domain(model: onnx.ModelProto) -> Iterator[None]:
    """Temporarily move default-domain ONNX Runtime contrib ops to com.microsoft (for onnx.checker)."""
    moved = [n for n in model.graph.node if n.domain in ("", "ai.onnx") and n.op_type in DEFAULT_DOMAIN_CONTRIB_OPS]
    added = False
    if moved and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
        added = True
    for n in moved:
        n.domain = MS_DOMAIN
    try:
        yield
    finally:
        for n in moved:
            n.domain = ""
        if added:
            del model.opset_import[-1]


def check_model(model: onnx.ModelProto, onnxruntime_session: bool = True) -> dict[str, Any]:
    """onnx.checker (full: strict shape inference) on the standard part, then an ONNX Runtime session.

    The checker validates every node of the default domain against its schema and skips
    com.microsoft ops (no schema in onnx); SimplifiedLayerNormalization, which ONNX Runtime keeps in
    the default domain, is checked as a contrib op. Raises on failure; returns what was checked."""
    if model.ByteSize() >= 2**31 - 1:  # protobuf limit: both checks need the model serialized in memory
        return {"skipped": "model over 2 GiB in memory: onnx.checker and the session check need a file"}
    with _contrib_domain(model):
        onnx.checker.check_model(checkable(model), full_check=True)
    out: dict[str, Any] = {"onnx_checker": "full_check (contrib ops: not in onnx's schema set)"}
    if onnxruntime_session and streamed_count(model):  # no weights in memory: package loads the written file
        out["onnxruntime_session"] = "loaded by package from the written artifact (streamed weights)"
        return out
    if onnxruntime_session:
        load_in_cpu_session(model.SerializeToString(), uses_kernel(model))
        out["onnxruntime_session"] = "loads (CPUExecutionProvider)"
    return out


def load_in_cpu_session(source: str | bytes, kernel: bool, prepack: bool = True) -> None:
    """Create an ONNX Runtime CPU session of a model (a file path or its bytes) without graph optimizations,
    with the package's C ops registered when it uses them; raises what ONNX Runtime raises. `prepack=False`
    skips the kernels' weight prepacking: a file's external data is then memory-mapped and never copied, so
    the check of a written artifact costs about no memory whatever its size (the graph, its types and shapes,
    and every node's kernel, custom ops included, are still created)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if kernel:
        register(so)
    ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])

