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

from compiler.passes.base import BuildContext, QuantizePass
from compiler.quant.common import matches
from runtime.ort_releases import FP8_ACTIVATIONS_CPU, missing

if TYPE_CHECKING:  # pragma: no cover - torch is imported where a pass runs (not by the dry run)
    from compiler.quant.calibration import LayerRunner
    from compiler.quant.fp8 import Fp8Weight
    from compiler.quant.state import QuantRun

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Options:
    weights: Literal["per_channel", "per_tensor"] = "per_channel"
    activations: Literal["static", "dynamic", "none"] = "static"  # static: per tensor from calibration
    ignore: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens"])


class QuantizeFp8Pass(QuantizePass):
    """FP8 E4M3 weights (per channel / per tensor) and activations (static per tensor / dynamic per token)."""

    name: ClassVar[str] = "quantize_fp8"
    Config = Fp8Options
    summary = "FP8 E4M3 weights (per channel) and activations (static per tensor or dynamic per token)"

    def estimated_bytes(self, module: str, shape: tuple[int, ...], kind: str | None) -> int | None:
        """Stored bytes of a checkpoint tensor after this pass (None: left as it is), for the dry run."""
        if kind is None or matches(module, self.config.ignore):
            return None
        scales = shape[0] * 4 if kind == "embedding" or self.config.weights == "per_channel" else 4
        return shape[0] * shape[1] + scales

    def needs_calibration(self) -> bool:
        return self.config.activations == "static"

    def check_environment(self, recipe: Any) -> str | None:
        t = recipe.target
        if (t.backend, t.device) != ("onnxruntime", "cpu") or self.config.activations == "none":
            return None
        return missing(FP8_ACTIVATIONS_CPU)

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import torch

        from compiler.quant.calibration import LayerRunner, load_calibration
        from compiler.quant.fp8 import StreamedFp8
        from compiler.quant.state import start_quantize

        c = self.config
        q = start_quantize(ctx, self.name, c.ignore)
        model, st = q.model, q.st
        per_channel = c.weights == "per_channel"
        embeddings = {n: m for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Embedding) and not matches(n, c.ignore)}
        static = c.activations == "static"

        amax: dict[str, float] = {}
        record: dict[str, Any] = {}
        unseen: list[str] = []  # Linears no calibration token reached (experts): the layer's range of their role
        if static:
            cal = load_calibration(ctx, self.name)
            record = cal.record
            # the embedding in memory for the moment (streamed): FP8 first where it is quantized, then the
            # calibration tokens' hidden states
            with q.reading("embed_tokens."):
                self._quantize_embeddings(st, embeddings, q.deferred, read=True)
                runner = LayerRunner(model, cal.samples)
            self._calibrate(q, runner, per_channel, amax, unseen)
        else:
            self._quantize_embeddings(st, embeddings, q.deferred, read=False)
            for n, lin in q.targets.items():
                self._quantize(st, n, lin, per_channel, None, q.deferred, read=False)
        streamed = sum(1 for w in st.weights.values() if isinstance(w.data, StreamedFp8))
        extra: dict[str, Any] = {"streamed": streamed} if q.deferred else {}
        if q.deferred and static:
            extra["streamed_layers"] = len(model.layers)
        log.info("quantize_fp8: %d weights to FP8 E4M3 (%s, activations %s)", len(st.weights), c.weights,
                 c.activations)
        return {
            "method": "fp8", "format": "e4m3fn", "weights": c.weights, "activations": c.activations,
            **({"calibration": record, "unseen_amax_of_role": unseen} if record else {}),
            **({"activation_amax": {k: float(f"{v:.6g}") for k, v in sorted(amax.items())}} if amax else {}),
            **q.finish(embeddings_supported=True), **extra,
        }

    def _calibrate(self, q: QuantRun, runner: LayerRunner, per_channel: bool, amax: dict[str, float],
                   unseen: list[str]) -> None:
        """Static activations: each Linear's input range (`amax`) over the calibration tokens, layer by layer with
        the earlier layers quantized, and its weight quantized with the scale of that range."""
        import torch

        from compiler.quant.state import layer_linears

        def sink(n: str, x: torch.Tensor) -> None:
            if x.numel():  # (an expert no token of a batch was routed to sees 0 rows)
                amax[n] = max(amax.get(n, 0.0), float(x.abs().max()))

        for i, layer, prefix in q.layers("fp8 calibration"):  # streamed: this layer's weights read
            mine = layer_linears(layer, prefix, q.targets)
            runner.capture(i, mine, sink=sink)  # inputs with the earlier layers quantized
            for n, lin in mine.items():
                if n not in amax:  # an expert no calibration token reached: the layer's largest input
                    # range of the same role (its gate/up read the same norm output as the others)
                    role = n.rsplit(".", 1)[-1]
                    amax[n] = max((v for k, v in amax.items() if k.startswith(f"{prefix}.")
                                   and k.endswith(f".{role}")), default=0.0)
                    unseen.append(n)
                self._quantize(q.st, n, lin, per_channel, amax.get(n), q.deferred, read=True)
            runner.advance(i)
        rest = {n: m for n, m in q.targets.items() if f"{n}.weight" not in q.st.weights}
        if rest:  # outside the decoder layers (an un-ignored lm_head reads the final norm)
            with torch.no_grad():
                top = max((float(q.model.norm(h).abs().max()) for h in runner.hidden), default=0.0)
            for n, lin in rest.items():
                amax[n] = top
                self._quantize(q.st, n, lin, per_channel, top, q.deferred, read=False)

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
