"""Fusion for ONNX Runtime: rewrite the lowered graph (after lower_onnx / lower_quant) into fused ops.

Rules (compiler/fusion/, one module per family; all on by default): `rms_norm`
(SimplifiedLayerNormalization), `skip_rms_norm` (com.microsoft.SkipSimplifiedLayerNormalization),
`qkv` and `gate_up` (one Gemm / MatMul / MatMulNBits + Split), `rotary`
(com.microsoft.RotaryEmbedding with cos/sin caches of max_model_len rows), `rotary_attention`
(optimize.RotaryPagedAttention on the packed QKV, paged_cpu graphs), `quick_gelu`
(com.microsoft.QuickGelu for SiLU), `swiglu` (optimize.SiluMul for the MLP's Split + SiLU + Mul, graphs that
use the C library), `quantize_rows` (optimize.QuantizeRows), `row_scale` (the gate/up projection's per-token
INT8 row scale into SiluMul's scale input), `skip_norm_quantize` (optimize.SkipNormQuantize for the row-scale
Mul + SkipSimplifiedLayerNormalization + QuantizeRows after o_proj and down_proj). Options: `rules: [...]` (the
set to run) or `disable: [...]`.

Stats (manifest): rules run, how often each fired (`fusions`), candidates left alone and why
(`not_fused`), `nodes_before`, `nodes_after`, `op_types` after, what was checked. The result is
checked with onnx.checker (full) on the standard part and loaded in an ONNX Runtime session.
Numerics change only by float rounding (tests/test_fusion.py compares logits and greedy tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from compiler.attention.paged import validate_paged_attention
from compiler.fusion import RULES, check_model, fuse_model
from compiler.passes.base import BuildContext, BuildError, Pass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FuseOptions:
    rules: list[str] | None = None  # the rules to run (default: all, compiler.fusion.RULES)
    disable: list[str] = field(default_factory=list)  # rules not to run
    check_onnxruntime: bool = True  # load the fused model in an ONNX Runtime session (CPU) as a check

    def __post_init__(self) -> None:
        for key, names in (("rules", self.rules or []), ("disable", self.disable)):
            unknown = [n for n in names if n not in RULES]
            if unknown:
                raise ValueError(f"{key}: unknown rule(s) {unknown}; known: {list(RULES)}")

    def enabled(self) -> list[str]:
        chosen = RULES if self.rules is None else tuple(self.rules)
        return [r for r in RULES if r in chosen and r not in self.disable]


class FusePass(Pass):
    """Rewrite RMSNorm, residual + RMSNorm, QKV / gate-up projections, RoPE and SiLU into fused ops."""

    name: ClassVar[str] = "fuse"
    Config = FuseOptions
    requires = ("lower_onnx",)
    summary = "ONNX Runtime fusions: (Skip)SimplifiedLayerNormalization, QKV / gate-up, RotaryEmbedding, QuickGelu"

    def skip_reason(self, ctx: BuildContext) -> str | None:
        if ctx.recipe.target.backend != "onnxruntime":
            return f"the rules emit ONNX Runtime contrib ops; target backend is {ctx.recipe.target.backend}"
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        names = [p.name for p in ctx.recipe.passes]
        if "lower_quant" in names and "lower_quant" not in ctx.completed:
            raise BuildError("pass 'fuse' must come after 'lower_quant' (it fuses the lowered, quantized graph)")
        model = ctx.require("onnx", self.name)
        rows = ctx.max_model_len
        bf16 = ctx.recipe.target.matmul == "bfloat16"
        fused, stats = fuse_model(model, self.config.enabled(), rope_cache_rows=rows, matmul_bf16=bf16)
        # PagedAttention has no CPU kernel: such a graph cannot open an ONNX Runtime CPU session here, so
        # its contrib nodes are checked against ONNX Runtime's registered schema instead
        cuda_only = any(n.op_type == "PagedAttention" and n.domain == "com.microsoft" for n in fused.graph.node)
        try:
            stats["checks"] = check_model(fused, onnxruntime_session=self.config.check_onnxruntime and not cuda_only)
        except Exception as e:
            raise BuildError(f"fuse: the fused graph fails its check: {str(e).splitlines()[0]}") from e
        if cuda_only:
            result = validate_paged_attention(fused)
            if result["problems"]:
                raise BuildError(f"fuse: PagedAttention nodes break ONNX Runtime's schema: {result['problems'][:3]}")
            stats["checks"]["paged_attention_schema"] = f"{result['nodes']} nodes valid"
        if "package" in stats["checks"].get("onnxruntime_session", ""):
            ctx.artifacts["session_check_pending"] = True
        ctx.artifacts["onnx"] = fused
        log.info("fuse: %s; nodes %d -> %d", stats["fusions"], stats["nodes_before"], stats["nodes_after"])
        return stats
