"""FP8 E4M3: weights per output channel (or per tensor), activations static per tensor from
calibration (or dynamic per token, computed in the graph).

lm_head and the embeddings stay float by default (`ignore`, module name patterns); an embedding
that is not ignored gets FP8 rows with one scale per row. The torch model holds the dequantized
weights; activation quantization is written into the graph by lower_quant (QuantizeLinear /
DequantizeLinear before each Gemm), with the scales recorded here. Static scales are the absolute
maximum of each Linear's input over the calibration tokens / 448, measured layer by layer with the
earlier layers already quantized.

With streamed weights (compiler/streamed.py: capture left the large parameters unread) no weight is held:
each is recorded as an `fp8.StreamedFp8`, quantized from its checkpoint tensor when package writes it.
Static activations then run the calibration one decoder layer at a time, as quantize_gptq does: the
embedding is read for the calibration tokens' hidden states (FP8 and dequantized first when it is
quantized), and each layer's weights are read from the checkpoint (capture's `deferred_params`), quantized
and written back dequantized for the layer's calibration run and output, then dropped. The codes package
writes are computed again from the checkpoint tensor by the same function, so they are the ones the
calibration saw.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from compiler.passes.base import BuildContext, Pass
from compiler.quant.common import matches

if TYPE_CHECKING:  # pragma: no cover - torch is imported where a pass runs (not by the dry run)
    from compiler.quant.fp8 import Fp8Weight

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

        from compiler.quant.calibration import LayerRunner, load_calibration
        from compiler.quant.fp8 import StreamedFp8
        from compiler.quant.state import (
            begin,
            layer_linears,
            parameters_read,
            progress_done,
            progress_task,
            quant_state,
            skipped_modules,
            stats_for,
            target_linears,
        )

        c = self.config
        model = begin(ctx, self.name)
        st = quant_state(ctx)
        per_channel = c.weights == "per_channel"
        # streamed: parameter -> its checkpoint reader, for the parameters capture left unread
        deferred: dict[str, tuple[int, Any]] = ctx.artifacts.get("deferred_params", {})

        def streamed_under(prefix: str) -> list[str]:
            return [n for n in deferred if n.startswith(prefix)]

        targets = target_linears(model, c.ignore)
        embeddings = {n: m for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Embedding) and not matches(n, c.ignore)}
        static = c.activations == "static"

        amax: dict[str, float] = {}
        record: dict[str, Any] = {}
        unseen: list[str] = []  # Linears no calibration token reached (experts): the layer's range of their role
        runner = None
        if static:
            cal = load_calibration(ctx, self.name)
            record = cal.record
            # the embedding in memory for the moment (streamed): FP8 first where it is quantized, then the
            # calibration tokens' hidden states
            with parameters_read(model, deferred, streamed_under("embed_tokens.")):
                self._quantize_embeddings(st, embeddings, deferred, read=True)
                runner = LayerRunner(model, cal.samples)
        else:
            self._quantize_embeddings(st, embeddings, deferred, read=False)
        if runner is not None:
            bar, task = progress_task(ctx, "fp8 calibration", len(model.layers))

            def sink(n: str, x: torch.Tensor) -> None:
                if x.numel():  # (an expert no token of a batch was routed to sees 0 rows)
                    amax[n] = max(amax.get(n, 0.0), float(x.abs().max()))

            for i, layer in enumerate(model.layers):
                mine = layer_linears(layer, f"layers.{i}", targets)
                with parameters_read(model, deferred, streamed_under(f"layers.{i}.")):  # streamed: this layer
                    runner.capture(i, mine, sink=sink)  # inputs with the earlier layers quantized
                    for n, lin in mine.items():
                        if n not in amax:  # an expert no calibration token reached: the layer's largest input
                            # range of the same role (its gate/up read the same norm output as the others)
                            role = n.rsplit(".", 1)[-1]
                            amax[n] = max((v for k, v in amax.items() if k.startswith(f"layers.{i}.")
                                           and k.endswith(f".{role}")), default=0.0)
                            unseen.append(n)
                        self._quantize(st, n, lin, per_channel, amax.get(n), deferred, read=True)
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
                    self._quantize(st, n, lin, per_channel, top, deferred, read=False)
        else:
            for n, lin in targets.items():
                self._quantize(st, n, lin, per_channel, None, deferred, read=False)
        st.weight_method = self.name
        streamed = sum(1 for q in st.weights.values() if isinstance(q.data, StreamedFp8))
        extra: dict[str, Any] = {"streamed": streamed} if deferred else {}
        if deferred and static:
            extra["streamed_layers"] = len(model.layers)
        log.info("quantize_fp8: %d weights to FP8 E4M3 (%s, activations %s)", len(st.weights), c.weights,
                 c.activations)
        return {
            "method": "fp8", "format": "e4m3fn", "weights": c.weights, "activations": c.activations,
            **({"calibration": record, "unseen_amax_of_role": unseen} if record else {}),
            **({"activation_amax": {k: float(f"{v:.6g}") for k, v in sorted(amax.items())}} if amax else {}),
            **stats_for(st, model, skipped_modules(model, st.weights, c.ignore, embeddings_supported=True)), **extra,
        }

    @staticmethod
    def _fp8_of(name: str, module: Any, per_channel: bool, deferred: dict[str, tuple[int, Any]], read: bool
                ) -> Fp8Weight:
        """`module`'s weight in FP8. Held in memory (loaded, or `read` for a calibration run): quantized now and
        written back dequantized (what the later layers and the torch model see). Streamed: a StreamedFp8 of
        its checkpoint tensor, computed when package writes it (after a read, the same codes again)."""
        from compiler.quant import fp8
        from compiler.quant.state import write_weight

        source = deferred.get(f"{name}.weight")
        if source is None or read:
            q = fp8.quantize_weight(module.weight, per_channel)
            write_weight(module, q.dequantize())
            if source is None:
                return q
        return fp8.StreamedFp8(f"{name}.weight", source[1], per_channel)

    def _quantize_embeddings(self, st: Any, embeddings: dict[str, Any], deferred: dict[str, tuple[int, Any]],
                             read: bool) -> None:
        from compiler.quant.state import QuantizedWeight

        for name, emb in embeddings.items():  # rows: one scale per token's embedding
            q = self._fp8_of(name, emb, True, deferred, read)
            st.weights[f"{name}.weight"] = QuantizedWeight(f"{name}.weight", "fp8", q, kind="embedding")

    def _quantize(self, st: Any, name: str, lin: Any, per_channel: bool, amax: float | None,
                  deferred: dict[str, tuple[int, Any]], read: bool) -> None:
        from compiler.quant import fp8
        from compiler.quant.state import QuantizedWeight

        q = self._fp8_of(name, lin, per_channel, deferred, read)
        mode = self.config.activations
        scale = fp8.activation_scale(amax) if mode == "static" and amax is not None else None
        st.weights[f"{name}.weight"] = QuantizedWeight(f"{name}.weight", "fp8", q, act_mode=mode, act_scale=scale)
