"""INT8 W8A8 for ONNX Runtime CPU: int8 weights per output channel, int8 activations computed at run time.

Every Linear but the ignored ones (lm_head by default: the logits are the most sensitive output and
the vocabulary GEMM the least activation-bound) gets symmetric int8 weights with one scale per
output row (compiler/quant/int8.py), codes in [-64, 64] by default (`weight_range: reduced`: the
integer GEMM is then exact on every x86 ISA, AVX2 without VNNI included; `full`, [-127, 127], is
exact only where ONNX Runtime has VNNI or AMX kernels, see compiler/quant/int8.py). Activations are
quantized dynamically in the graph, per token (default: a step's tokens do not share a scale, so a
request's output does not depend on what else is in its batch) or per tensor (ONNX
DynamicQuantizeLinear). lower_quant writes ONNX Runtime's integer GEMMs (MatMulIntegerToFloat /
DynamicQuantizeMatMul: VNNI / AMX kernels); embeddings and the norms stay float (gathers and
elementwise ops gain nothing from int8).

`smoothquant_alpha` (optional, needs the recipe's calibration data) migrates activation outliers into
the weights first: per input channel of q/k/v and of gate/up, s = amax(x)^a / amax(w)^(1-a) from the
calibration tokens, folded into the RMSNorm before them (the float model is unchanged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from compiler.passes.base import BuildContext, BuildError, QuantizePass
from compiler.quant.common import matches

if TYPE_CHECKING:  # pragma: no cover
    from compiler.quant.state import QuantRun
    from compiler.recipe import Recipe

log = logging.getLogger(__name__)

# (group, RMSNorm before it, the Linears that read the norm's output) in a Llama-family decoder layer
SMOOTH_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("qkv", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("gate_up", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)


@dataclass(frozen=True)
class Int8Options:
    activations: Literal["per_token", "per_tensor"] = "per_token"
    # reduced: weight codes in [-64, 64], exact on every ISA; full: [-127, 127], exact only with VNNI / AMX
    weight_range: Literal["reduced", "full"] = "reduced"
    smoothquant_alpha: float | None = None  # None: no migration; else in [0, 1] (0.5 is SmoothQuant's default)
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])  # module name patterns kept in float

    def __post_init__(self) -> None:
        if self.activations not in ("per_token", "per_tensor"):
            raise ValueError(f"activations must be per_token or per_tensor, got {self.activations!r}")
        if self.weight_range not in ("reduced", "full"):
            raise ValueError(f"weight_range must be reduced or full, got {self.weight_range!r}")
        if self.smoothquant_alpha is not None and not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ValueError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")


class QuantizeInt8Pass(QuantizePass):
    """INT8 weights (per channel) and dynamic INT8 activations (per token / per tensor), optional SmoothQuant."""

    name: ClassVar[str] = "quantize_int8"
    Config = Int8Options
    summary = "INT8 W8A8: int8 weights per channel, dynamic int8 activations (ONNX Runtime CPU integer GEMMs)"

    def check_recipe(self, recipe: Recipe) -> tuple[str, str] | None:
        t = recipe.target
        if (t.backend, t.device) != ("onnxruntime", "cpu"):
            return ("name", f"quantize_int8 lowers to ONNX Runtime's CPU integer GEMMs (MatMulIntegerToFloat, "
                            f"DynamicQuantizeMatMul); target {t.backend}/{t.device} has no such kernels: build "
                            "it for onnxruntime/cpu, or use quantize_fp8 / an INT4 method for this target")
        return None

    def estimated_bytes(self, module: str, shape: tuple[int, ...], kind: str | None) -> int | None:
        """Stored bytes of a checkpoint tensor after this pass (None: left as it is), for the dry run."""
        if kind != "linear" or matches(module, self.config.ignore):
            return None
        return shape[0] * shape[1] + shape[0] * 4

    def needs_calibration(self) -> bool:
        return self.config.smoothquant_alpha is not None

    def streaming_problem(self, info: Any) -> str | None:
        """Why this pass cannot run on streamed weights (compiler/memory.py streaming_reason), or None."""
        c = self.config
        if c.smoothquant_alpha is None:
            return None
        scaled = [f"layers.0.{n}" for _g, _norm, consumers in SMOOTH_GROUPS for n in consumers]
        ignored = [n for n in scaled if matches(n, c.ignore)]
        if ignored:
            return (f"quantize_int8 ignores {ignored[0]}: a Linear left in float still takes its group's "
                    "SmoothQuant scales, a changed float weight that streaming cannot write")
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from compiler.quant import int8
        from compiler.quant.state import start_quantize

        c = self.config
        q = start_quantize(ctx, self.name, c.ignore)
        extra: dict[str, Any] = {}
        if c.smoothquant_alpha is not None:
            if ctx.checkpoint.config.post_norm:
                raise BuildError(f"{self.name}: smoothquant_alpha folds scales into the norm before q/k/v and "
                                 f"gate/up; {ctx.checkpoint.config.architecture} has none there (post-norm)")
            if ctx.checkpoint.config.num_experts:
                raise BuildError(f"{self.name}: smoothquant_alpha scales one gate/up pair per layer; "
                                 f"{ctx.checkpoint.config.architecture} routes to experts: leave smoothquant_alpha "
                                 "unset (plain W8A8), or use quantize_awq / quantize_gptq / quantize_fp8")
            extra = self._smooth(q, c.smoothquant_alpha)
        # a streamed layer's weights were quantized while SmoothQuant read them; the other streamed ones are
        # quantized when package writes them
        streamed = q.quantize_rest("int8",
                                   lambda name, source: int8.StreamedInt8(name, source, c.activations, c.weight_range),
                                   lambda w: int8.quantize_weight(w, c.activations, c.weight_range))
        if q.deferred:
            extra["streamed"] = streamed
        qmax = int8.WEIGHT_QMAX[c.weight_range]
        log.info("quantize_int8: %d Linear weights to INT8 (codes in [-%d, %d]), activations %s", len(q.targets),
                 qmax, qmax, c.activations)
        if c.weight_range == "full":
            log.warning("quantize_int8: weight_range full: ONNX Runtime's uint8 x int8 GEMM is exact only on CPUs "
                        "with VNNI or AMX; on AVX2 without them its int16 pair sums saturate (weight_range: reduced "
                        "is exact everywhere)")
        return {"method": "int8", "bits": 8, "weights": "per_channel symmetric", "activations": c.activations,
                "weight_range": c.weight_range, "weight_qmax": qmax,
                "exact_on": "every ISA" if c.weight_range == "reduced" else "VNNI / AMX CPUs only",
                "smoothquant_alpha": c.smoothquant_alpha, **extra,
                **q.finish()}

    def _smooth(self, q: QuantRun, alpha: float) -> dict[str, Any]:
        """Fold SmoothQuant scales into each layer's norms and Linears (`q.targets`), layer by layer on calibration
        data. Streamed (`q.deferred`): each layer's weights read from the checkpoint for the while, and its
        Linears quantized from the scaled weights and spilled to disk before they are dropped."""
        from compiler.quant.calibration import load_calibration

        cal = load_calibration(q.ctx, self.name)
        runner = q.layer_runner(cal.samples)
        migration: dict[str, float] = {}
        for i, layer, prefix in q.layers("smoothquant"):
            self._smooth_layer(i, layer, runner, q.targets, alpha, migration)
            if q.deferred:
                self._spill_layer(q, prefix)
        return {"calibration": cal.record, "smoothquant_scale_spread": dict(sorted(migration.items()))}

    def _spill_layer(self, q: QuantRun, prefix: str) -> None:
        """A streamed layer's Linears to INT8 from their (scaled) weights in memory, codes spilled to disk."""
        from compiler.quant import int8
        from compiler.quant.state import QuantizedWeight

        c = self.config
        for name, lin in q.targets.items():
            if name.startswith(prefix + ".") and f"{name}.weight" in q.deferred:
                w = int8.quantize_weight(lin.weight, c.activations, c.weight_range)
                q.st.weights[f"{name}.weight"] = QuantizedWeight(f"{name}.weight", "int8", int8.SpilledInt8(w))

    def _smooth_layer(self, i: int, layer: Any, runner: Any, targets: dict[str, Any], alpha: float,
                      migration: dict[str, float]) -> None:
        """SmoothQuant's scales of layer i from its calibration inputs, folded; the runner advances past it."""
        import torch

        from compiler.quant import int8
        from compiler.quant.awq import ScaleGroup, apply_scale

        prefix = f"layers.{i}"
        first = {g[2][0]: layer.get_submodule(g[2][0]) for g in SMOOTH_GROUPS}
        amax: dict[str, torch.Tensor] = {}

        def sink(n: str, x: torch.Tensor, amax: dict[str, torch.Tensor] = amax) -> None:
            m = x.abs().amax(dim=0)
            amax[n] = m if n not in amax else torch.maximum(amax[n], m)

        runner.capture(i, first, sink=sink)
        for gname, norm, consumers in SMOOTH_GROUPS:
            if not any(f"{prefix}.{n}" in targets for n in consumers):
                continue
            linears = [layer.get_submodule(n) for n in consumers]
            w_amax = torch.stack([lin.weight.detach().abs().amax(dim=0).to(torch.float32) for lin in linears]
                                 ).amax(dim=0)
            s = int8.smooth_scales(amax[consumers[0]], w_amax, alpha)
            apply_scale(ScaleGroup(f"{prefix}.{gname}", layer.get_submodule(norm), linears,
                                   [True] * len(linears), [], lambda b, x: x), s)
            migration[f"{prefix}.{gname}"] = float(f"{float(s.max() / s.min()):.6g}")
        runner.advance(i)
