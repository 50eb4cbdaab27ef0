"""FP8 E4M3: weights per output channel (or per tensor), activations static per tensor from
calibration (or dynamic per token, computed in the graph).

lm_head and the embeddings stay float by default (`ignore`, module name patterns); an embedding
that is not ignored gets FP8 rows with one scale per row. The torch model holds the dequantized
weights; activation quantization is written into the graph by lower_quant (QuantizeLinear /
DequantizeLinear before each Gemm), with the scales recorded here. Static scales are the absolute
maximum of each Linear's input over the calibration tokens / 448, measured layer by layer with the
earlier layers already quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from compiler.passes.base import BuildContext, Pass
from compiler.quant.common import matches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Options:
    weights: Literal["per_channel", "per_tensor"] = "per_channel"
    activations: Literal["static", "dynamic", "none"] = "static"  # static: per tensor from calibration
    ignore: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens"])


class QuantizeFp8Pass(Pass):
    """FP8 E4M3 weights (per channel / per tensor) and activations (static per tensor / dynamic per token)."""

    name: ClassVar[str] = "quantize_fp8"
    Config = Fp8Options
    requires = ("capture",)
    summary = "FP8 E4M3 weights (per channel) and activations (static per tensor or dynamic per token)"
    quant_kind: ClassVar[str] = "weights"

    def estimated_bytes(self, module: str, shape: tuple[int, ...], kind: str | None) -> int | None:
        """Stored bytes of a checkpoint tensor after this pass (None: left as it is), for the dry run."""
        if kind is None or matches(module, self.config.ignore):
            return None
        scales = shape[0] * 4 if kind == "embedding" or self.config.weights == "per_channel" else 4
        return shape[0] * shape[1] + scales

    def needs_calibration(self) -> bool:
        return self.config.activations == "static"

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import torch

        from compiler.quant import fp8
        from compiler.quant.calibration import LayerRunner, load_calibration
        from compiler.quant.state import (
            QuantizedWeight,
            begin,
            layer_linears,
            progress_done,
            progress_task,
            quant_state,
            skipped_modules,
            stats_for,
            target_linears,
            write_weight,
        )

        c = self.config
        model = begin(ctx, self.name)
        st = quant_state(ctx)
        per_channel = c.weights == "per_channel"
        targets = target_linears(model, c.ignore)
        embeddings = {n: m for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Embedding) and not matches(n, c.ignore)}
        for name, emb in embeddings.items():  # rows: one scale per token's embedding
            q = fp8.quantize_weight(emb.weight, per_channel=True)
            write_weight(emb, q.dequantize())
            st.weights[f"{name}.weight"] = QuantizedWeight(f"{name}.weight", "fp8", q, kind="embedding")

        amax: dict[str, float] = {}
        record: dict[str, Any] = {}
        unseen: list[str] = []  # Linears no calibration token reached (experts): the layer's range of their role
        if c.activations == "static":
            cal = load_calibration(ctx, self.name)
            record = cal.record
            runner = LayerRunner(model, cal.samples)
            bar, task = progress_task(ctx, "fp8 calibration", len(model.layers))

            def sink(n: str, x: torch.Tensor) -> None:
                if x.numel():  # (an expert no token of a batch was routed to sees 0 rows)
                    amax[n] = max(amax.get(n, 0.0), float(x.abs().max()))

            for i, layer in enumerate(model.layers):
                mine = layer_linears(layer, f"layers.{i}", targets)
                runner.capture(i, mine, sink=sink)  # inputs with the earlier layers quantized
                for n, lin in mine.items():
                    if n not in amax:  # an expert no calibration token reached: the layer's largest input
                        # range of the same role (its gate/up read the same norm output as the others)
                        role = n.rsplit(".", 1)[-1]
                        amax[n] = max((v for k, v in amax.items() if k.startswith(f"layers.{i}.")
                                       and k.endswith(f".{role}")), default=0.0)
                        unseen.append(n)
                    self._quantize(st, n, lin, per_channel, amax.get(n))
                runner.advance(i)
                if bar is not None:
                    bar.advance(task)
            progress_done(bar, task)
            rest = {n: m for n, m in targets.items() if f"{n}.weight" not in st.weights}
            if rest:  # outside the decoder layers (an un-ignored lm_head reads the final norm)
                with torch.no_grad():
                    top = max((float(model.norm(h).abs().max()) for h in runner.hidden), default=0.0)
                for n, lin in rest.items():
                    amax[n] = top
                    self._quantize(st, n, lin, per_channel, top)
        else:
            for n, lin in targets.items():
                self._quantize(st, n, lin, per_channel, None)
        st.weight_method = self.name
        return {
            "method": "fp8", "format": "e4m3fn", "weights": c.weights, "activations": c.activations,
            **({"calibration": record, "unseen_amax_of_role": unseen} if record else {}),
            **({"activation_amax": {k: float(f"{v:.6g}") for k, v in sorted(amax.items())}} if amax else {}),
            **stats_for(st, model, skipped_modules(model, st.weights, c.ignore, embeddings_supported=True)),
        }

    def _quantize(self, st: Any, name: str, lin: Any, per_channel: bool, amax: float | None) -> None:
        from compiler.quant import fp8
        from compiler.quant.state import QuantizedWeight, write_weight

        q = fp8.quantize_weight(lin.weight, per_channel)
        write_weight(lin, q.dequantize())
        mode = self.config.activations
        scale = fp8.activation_scale(amax) if mode == "static" and amax is not None else None
        st.weights[f"{name}.weight"] = QuantizedWeight(f"{name}.weight", "fp8", q, act_mode=mode, act_scale=scale)
