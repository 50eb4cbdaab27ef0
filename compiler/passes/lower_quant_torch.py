"""Lowering of quantization for the torch targets: FP8 weights into the torch.export program.

The torch twin of lower_quant. Every Linear that quantize_fp8 quantized becomes an `Fp8Linear`
holding the stored form (float8_e4m3fn weight [N, K], float32 scales per channel or per tensor, the
static input scale) and calling `optimize::fp8_linear` (runtime/backends/torch_ops.py): FP8 tensor
cores through `torch._scaled_mm` on GPUs that have them, the dequantized product elsewhere. The model
is then exported again, so the program that ships (and that plan_cuda_graphs checks) holds 1 byte
per quantized weight. INT4 weights and quantized KV caches are not lowered for torch (refused by
check_recipe with the reason).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from compiler.passes.base import BuildContext, BuildError, Pass

log = logging.getLogger(__name__)

_ACT = {"none": 0, "static": 1, "dynamic": 2}


def fp8_linear_module(q: Any, bias: Any, dtype: Any) -> Any:
    """An nn.Module computing the quantized Linear `q` (a QuantizedWeight of scheme fp8_e4m3)."""
    import torch

    from runtime.backends import torch_ops

    class Fp8Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            codes = torch.from_numpy(q.data.codes.copy()).view(torch.float8_e4m3fn)
            self.register_buffer("weight", codes)
            self.register_buffer("weight_scale", torch.from_numpy(q.data.scales.copy()).to(torch.float32))
            scale = q.act_scale if q.act_scale is not None else 1.0
            self.register_buffer("input_scale", torch.tensor(scale, dtype=torch.float32))
            self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)
            self.act = _ACT[q.act_mode]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch_ops.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, self.act)

    return Fp8Linear()


class LowerQuantTorchPass(Pass):
    """FP8-quantized Linears -> Fp8Linear modules (optimize::fp8_linear), then the program is exported again."""

    name: ClassVar[str] = "lower_quant_torch"
    requires = ("capture",)
    summary = "FP8 Linears -> optimize::fp8_linear (torch._scaled_mm on FP8 GPUs); re-export the program"

    def check_recipe(self, recipe: Any) -> tuple[str, str] | None:
        if recipe.target.backend != "torch":
            return ("name", f"lower_quant_torch lowers into the torch.export program; the {recipe.target.backend} "
                    "target uses lower_quant (after lower_onnx)")
        names = [p.name for p in recipe.passes]
        for other in names:
            if other.startswith("quantize_") and other != "quantize_fp8":
                return ("name", f"{other!r}: the torch targets lower FP8 weights only (quantize_fp8); INT4 and "
                        "KV-cache quantization are lowered for the ONNX Runtime targets")
        if "quantize_fp8" not in names[:names.index(self.name)]:
            return ("name", "lower_quant_torch needs quantize_fp8 earlier in the list")
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import torch

        from compiler.passes.capture import export_forward_batch

        st = ctx.artifacts.get("quant")
        model = ctx.require("model", self.name)
        if st is None or not st.weights:
            raise BuildError("lower_quant_torch: no quantized weights (quantize_fp8 must run before it)")
        dtype = getattr(torch, ctx.recipe.target.dtype)
        replaced, fp8_bytes, float_bytes = 0, 0, 0
        for name, q in sorted(st.weights.items()):
            if q.scheme != "fp8_e4m3" or q.kind != "linear":
                raise BuildError(f"lower_quant_torch: {name} is {q.scheme} {q.kind}; the torch targets lower FP8 "
                                 "Linear weights only (ignore embeddings: quantize_fp8 ignore: [embed_tokens])")
            path = name.removesuffix(".weight")
            parent_name, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, child)
            setattr(parent, child, fp8_linear_module(q, old.bias, dtype))
            replaced += 1
            fp8_bytes += q.data.codes.nbytes + q.data.scales.nbytes
            float_bytes += old.weight.numel() * old.weight.element_size()
        cfg = ctx.checkpoint.config
        try:
            exported, args = export_forward_batch(model, cfg, ctx.recipe.runtime.kv_block_size, dtype)
        except Exception as e:
            raise BuildError(f"lower_quant_torch: torch.export failed: {str(e).splitlines()[0]}") from e
        ctx.artifacts["exported"] = exported
        ctx.artifacts["example_inputs"] = args
        calls = sum(1 for n in exported.graph.nodes if n.op == "call_function" and "fp8_linear" in str(n.target))
        log.info("lower_quant_torch: %d Linears in FP8 (%d op calls in the program)", replaced, calls)
        return {"fp8_linears": replaced, "fp8_linear_calls": calls, "weight_bytes": fp8_bytes,
                "float_weight_bytes": float_bytes, "graph_nodes": len(exported.graph.nodes)}
