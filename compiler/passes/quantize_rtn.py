"""INT4 round-to-nearest: the baseline every other weight quantization method is compared with.

Every Linear but the ignored ones (lm_head by default) gets asymmetric INT4 weights with one scale
and zero point per group of `group_size` input columns (compiler/quant/int4.py); no calibration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from compiler.passes.base import BuildContext, Pass
from compiler.quant.common import Int4WeightSizes, check_group_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RtnOptions:
    group_size: int = 128
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])  # module name patterns kept in float
    symmetric: bool = False  # zero point 8, signed int4 values (what TensorRT dequantizes)

    def __post_init__(self) -> None:
        check_group_size(self.group_size)


class QuantizeRtnPass(Int4WeightSizes, Pass):
    """INT4 weight-only, round-to-nearest per group (the baseline)."""

    name: ClassVar[str] = "quantize_rtn"
    Config = RtnOptions
    requires = ("capture",)
    summary = "INT4 weight-only round-to-nearest, per group, asymmetric (or symmetric) (baseline)"
    quant_kind: ClassVar[str] = "weights"

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from compiler.quant import int4
        from compiler.quant.state import (
            QuantizedWeight,
            begin,
            quant_state,
            skipped_modules,
            stats_for,
            target_linears,
            write_weight,
        )

        model = begin(ctx, self.name)
        st = quant_state(ctx)
        targets = target_linears(model, self.config.ignore)
        # a streamed build's large weights are not in memory: their quantization runs when package writes them
        deferred = ctx.artifacts.get("deferred_params", {})
        streamed = 0
        for name, lin in targets.items():
            source = deferred.get(f"{name}.weight")
            if source is not None:
                q: int4.Int4Weight = int4.StreamedInt4(f"{name}.weight", source[1], self.config.group_size,
                                                       self.config.symmetric)
                streamed += 1
            else:
                q = int4.quantize_rtn(lin.weight, self.config.group_size, symmetric=self.config.symmetric)
                write_weight(lin, q.dequantize())
            st.weights[f"{name}.weight"] = QuantizedWeight(f"{name}.weight", "rtn", q)
        st.weight_method = self.name
        extra = {"streamed": streamed} if deferred else {}
        log.info("quantize_rtn: %d Linear weights to INT4 (group %d)", len(targets), self.config.group_size)
        return {"method": "rtn", "bits": 4, "group_size": self.config.group_size, "symmetric": self.config.symmetric,
                **stats_for(st, model, skipped_modules(model, st.weights, self.config.ignore)), **extra}
