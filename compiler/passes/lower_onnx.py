"""Lowering to ONNX: the torch.export graph becomes a standard ONNX model (the portable IR).

The pass around compiler/export.py's `lower_exported` (the exporter, its optimizer without SlicesSplit, the
metadata stripped so builds are byte-identical, a fused attention variant translated to its contrib op) and,
for a streamed build, the placeholders of the weights capture left unread.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from compiler.export import graph_io_names, lower_exported
from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.passes.capture import STREAM_MAX_LOADED, attention_variant
from compiler.streamed import streamed_count

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LowerOnnxOptions:
    opset: int = 21
    optimize: bool = True  # the exporter's graph optimizer (constant folding, dead code elimination)


class LowerOnnxPass(Pass):
    """Translate the captured graph to ONNX (opset >= 21) with named ForwardBatch inputs and outputs."""

    name: ClassVar[str] = "lower_onnx"
    Config = LowerOnnxOptions
    requires = ("capture",)
    summary = "torch.export graph -> ONNX (standard ops), optimizer, deterministic metadata"

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import onnx

        if self.config.opset < 21:
            raise BuildError(f"lower_onnx: opset {self.config.opset} < 21 is not supported")
        exported = ctx.require("exported", self.name)
        inputs, outputs = graph_io_names(ctx.checkpoint.config.num_layers)
        deferred = ctx.artifacts.get("deferred_params")
        model = lower_exported(exported, ctx.checkpoint.config.num_layers, self.config.opset, self.config.optimize,
                               attention_variant(ctx), deferred, STREAM_MAX_LOADED)
        ctx.artifacts["onnx"] = model
        extra = {"streamed_initializers": streamed_count(model)} if deferred else {}
        ops = Counter(n.op_type for n in model.graph.node)
        return {
            "opset": self.config.opset,
            "nodes": sum(ops.values()),
            "op_types": dict(sorted(ops.items())),
            "initializers": len(model.graph.initializer),
            "inputs": inputs,
            "outputs": outputs,
            "ir_version": int(model.ir_version),
            "onnx_version": onnx.__version__,
            **extra,
        }
