"""INT4 round-to-nearest: the baseline every other weight quantization method is compared with.

Every Linear but the ignored ones (lm_head by default) gets asymmetric INT4 weights with one scale
and zero point per group of `group_size` input columns (compiler/quant/int4.py); no calibration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from compiler.passes.base import BuildContext, QuantizePass
from compiler.quant.common import Int4WeightSizes, check_group_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RtnOptions:
    group_size: int = 128
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])  # module name patterns kept in float
    symmetric: bool = False  # zero point 8, signed int4 values (what TensorRT dequantizes)

    def __post_init__(self) -> None:
        check_group_size(self.group_size)


class QuantizeRtnPass(Int4WeightSizes, QuantizePass):
    """INT4 weight-only, round-to-nearest per group (the baseline)."""

    name: ClassVar[str] = "quantize_rtn"
    Config = RtnOptions
    summary = "INT4 weight-only round-to-nearest, per group, asymmetric (or symmetric) (baseline)"

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        from compiler.quant.state import start_quantize

        c = self.config
        q = start_quantize(ctx, self.name, c.ignore)
        # a streamed build's large weights are not in memory: their quantization runs when package writes them
        streamed = q.round_rest(c.group_size, c.symmetric)
        extra = {"streamed": streamed} if q.deferred else {}
        log.info("quantize_rtn: %d Linear weights to INT4 (group %d)", len(q.targets), c.group_size)
        return {"method": "rtn", "bits": 4, "group_size": c.group_size, "symmetric": c.symmetric,
                **q.finish(), **extra}
