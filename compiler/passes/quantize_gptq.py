"""INT4 GPTQ: Hessian-aware rounding from calibration inputs, layer by layer.

For each decoder layer, in the order the layer computes (q/k/v, then o, then gate/up, then down:
"true sequential"), the Hessian 2/n X^T X of each Linear's input is accumulated over the
calibration windows with the earlier Linears already quantized, then GPTQ rounds the weights
(compiler/quant/gptq.py). The next layer's input is the quantized layer's output. Memory: one
layer's activations and one [in, in] Hessian per Linear of the current step.

With streamed weights (compiler/streamed.py: capture left the large parameters unread) the pass holds one
decoder layer at a time: the embedding is read for the calibration tokens' hidden states and dropped, then
each layer's weights are read from the checkpoint (capture's `deferred_params`) into its parameters, the layer
is quantized as above, its INT4 codes are spilled to disk (int4.SpilledInt4, read back when package writes
them) and its weights dropped. The parameters keep their unread storage, which lower_onnx recognises.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from compiler.passes.base import BuildContext, BuildError, QuantizePass
from compiler.quant.common import Int4WeightSizes, check_group_size, sequential_steps

log = logging.getLogger(__name__)

# The order a decoder layer computes its Linears in, by the last part of their names (Linears of one step
# share an input; a mixture of experts' experts and shared expert step together: gate/up, then down).
@dataclass(frozen=True)
class GptqOptions:
    group_size: int = 128
    damp: float = 0.01  # dampening: damp * mean(diag H) added to the diagonal
    act_order: bool = False  # process columns by decreasing diag H (groups stay contiguous)
    block_size: int = 128  # columns per lazy batch update
    true_sequential: bool = True  # Hessians of later Linears see the earlier ones quantized
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    symmetric: bool = False  # zero point 8, signed int4 values (what TensorRT dequantizes)
    # each group's range searched (shrunk min/max of least |Q(w) - w|^2.4, GPTQ's `mse` quantizer)
    range_search: bool = False
    # the Hessian, its factor and the weights' error feedback: float32 as the reference implementation (half the
    # memory and time of float64), or float64
    precision: Literal["float32", "float64"] = "float32"

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1), got {self.damp}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


class QuantizeGptqPass(Int4WeightSizes, QuantizePass):
    """INT4 weight-only GPTQ with Hessians from calibration inputs, layer by layer."""

    name: ClassVar[str] = "quantize_gptq"
    Config = GptqOptions
    summary = "INT4 weight-only GPTQ (Hessian from calibration inputs), asymmetric, per group"

    def needs_calibration(self) -> bool:
        return True

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from compiler.quant import int4
        from compiler.quant.calibration import float32_search, load_calibration
        from compiler.quant.state import start_quantize, write_weight

        c = self.config
        q = start_quantize(ctx, self.name, c.ignore)
        model = q.model

        def keep(name: str, method: str, w: int4.Int4Weight) -> None:
            """The quantized weight: written back dequantized (the next steps and layers see it); a streamed
            layer's codes go to disk."""
            write_weight(model.get_submodule(name), w.dequantize())
            q.keep_int4(f"{name}.weight", method, w)

        with float32_search(model, q.deferred):  # searches in float32 on the target's weights
            cal = load_calibration(ctx, self.name)
            runner = q.layer_runner(cal.samples)
            losses: dict[str, float] = {}
            unseen: list[str] = []  # Linears no calibration token reached (experts): rounded to nearest
            for i, layer, prefix in q.layers("gptq"):
                self._quantize_layer(i, layer, prefix, q.targets, runner, keep, losses, unseen)
            q.round_rest(c.group_size, c.symmetric)  # Linears outside the decoder layers (an un-ignored lm_head)
            extra = {"streamed_layers": len(model.layers)} if q.deferred else {}
            return {"method": "gptq", "bits": 4, "group_size": c.group_size, "symmetric": c.symmetric,
                    "damp": c.damp, "act_order": c.act_order, "range_search": c.range_search,
                    "precision": c.precision,
                    "calibration": cal.record,
                    "reconstruction_loss": {k: float(f"{v:.6g}") for k, v in sorted(losses.items())},
                    "unseen_rtn": unseen,
                    **q.finish(), **extra}

    def _quantize_layer(self, i: int, layer: Any, prefix: str, targets: dict[str, Any], runner: Any,
                        keep: Any, losses: dict[str, float], unseen: list[str]) -> None:
        """GPTQ of decoder layer i's target Linears, step by step; then the runner advances past the layer."""
        import torch

        from compiler.quant import gptq, int4
        from compiler.quant.state import layer_linears

        c = self.config
        mine = layer_linears(layer, prefix, targets)
        steps = sequential_steps(list(mine))
        if not c.true_sequential:
            steps = [[n for s in steps for n in s]]
        for k, step in enumerate(steps):
            changing = [n for s in steps[k:] for n in s]  # what this step and the later ones quantize
            if not any(".self_attn." in n for n in changing):  # the runner keeps the attention's output
                runner.attention_final(i)
                if changing and all(n.endswith(".mlp.down_proj") for n in changing):
                    runner.mlp_input_final(i)  # and down_proj's input: advance computes only down_proj
            hess = gptq.SharedHessians({n: mine[n].in_features for n in step}, getattr(torch, c.precision))
            runner.capture(i, {n: mine[n] for n in step}, sink=hess.add)
            prepared: dict[int, gptq.Prepared] = {}  # per accumulator: Linears fed one input share the factor
            users = Counter(id(a) for a in hess.of.values())  # Linears still to quantize, per accumulator
            for n in step:
                acc = hess.of.get(n)
                if acc is None or acc.n == 0:  # an expert no calibration token was routed to
                    keep(n, "rtn", int4.quantize_rtn(mine[n].weight, c.group_size, symmetric=c.symmetric))
                    unseen.append(n)
                    continue
                try:  # the accumulator's value dampened, inverted and factored in its own storage
                    if id(acc) not in prepared:
                        prepared[id(acc)] = gptq.prepare(acc.take(), c.damp, c.act_order)
                    q, loss = gptq.gptq_quantize_prepared(mine[n].weight, prepared[id(acc)], c.group_size,
                                                          c.block_size, c.symmetric, c.range_search)
                except ValueError as e:
                    raise BuildError(f"quantize_gptq: {n}: {e}") from e
                users[id(acc)] -= 1
                if not users[id(acc)]:  # its factor is not needed again
                    del prepared[id(acc)]
                keep(n, "gptq", q)
                losses[n] = loss
        runner.advance(i)  # the quantized layer's output feeds the next layer (what the runner kept reused)
