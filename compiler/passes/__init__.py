"""The pass registry: recipe pass names -> pass classes (one pass per file in this folder)."""

from __future__ import annotations

from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.passes.build_engine import BuildEnginePass
from compiler.passes.capture import CapturePass
from compiler.passes.fuse import FusePass
from compiler.passes.lower_onnx import LowerOnnxPass
from compiler.passes.lower_quant import LowerQuantPass
from compiler.passes.lower_quant_torch import LowerQuantTorchPass
from compiler.passes.package import PackagePass
from compiler.passes.plan_cuda_graphs import PlanCudaGraphsPass
from compiler.passes.quantize_awq import QuantizeAwqPass
from compiler.passes.quantize_fp8 import QuantizeFp8Pass
from compiler.passes.quantize_gptq import QuantizeGptqPass
from compiler.passes.quantize_int8 import QuantizeInt8Pass
from compiler.passes.quantize_kv_cache import QuantizeKvCachePass
from compiler.passes.quantize_rtn import QuantizeRtnPass
from compiler.passes.select_attention import SelectAttentionPass

PASSES: dict[str, type[Pass]] = {
    p.name: p
    for p in (
        # attention-variant selection (before capture: it picks the model definition's attention)
        SelectAttentionPass,
        # capture
        CapturePass,
        # quantization (after capture, before lower_onnx; lower_quant writes the quantized form)
        QuantizeRtnPass,
        QuantizeAwqPass,
        QuantizeGptqPass,
        QuantizeFp8Pass,
        QuantizeInt8Pass,
        QuantizeKvCachePass,
        # lowering
        LowerOnnxPass,
        LowerQuantPass,
        LowerQuantTorchPass,  # the torch targets' twin of lower_quant (FP8 into the program)
        FusePass,
        # planning (on the final graph)
        PlanCudaGraphsPass,
        # engine compilation (tensorrt target: the final graph and its decode buckets -> a TensorRT engine)
        BuildEnginePass,
        # packaging
        PackagePass,
    )
}


def pass_options() -> dict[str, type]:
    """name -> options dataclass, for the recipe loader's option checks."""
    return {name: cls.Config for name, cls in PASSES.items()}


__all__ = ["PASSES", "BuildContext", "BuildError", "Pass", "pass_options"]
