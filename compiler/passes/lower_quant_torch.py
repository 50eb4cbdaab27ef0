"""Lowering of quantization for the torch targets: FP8 and INT4 weights into the torch.export program.

The torch twin of lower_quant. Every Linear that a weight-quantization pass quantized becomes a module
holding the stored form and calling a custom op (runtime/backends/torch_ops.py):

- quantize_fp8 -> `Fp8Linear`: float8_e4m3fn weight [N, K], float32 scales per channel or per tensor,
  the static input scale; `optimize::fp8_linear` (FP8 tensor cores through `torch._scaled_mm` on GPUs
  that have them, the dequantized product elsewhere).
- quantize_rtn / quantize_awq / quantize_gptq -> `Int4Linear`: the codes packed two per byte along K
  (uint8 [N, ceil(K/2)]), float32 scales and uint8 zero points per group; `optimize::int4_linear`
  (a Triton kernel that dequantizes tile by tile on CUDA, the dequantized product elsewhere).

The model is then exported again, so the program that ships (and that plan_cuda_graphs checks) holds
1 byte (FP8) or about half a byte (INT4) per quantized weight. Quantized KV caches are not lowered
for torch (refused by check_recipe with the reason).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np

from compiler.export import export_forward_batch
from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.streamed import Deferred

log = logging.getLogger(__name__)

_ACT = {"none": 0, "static": 1, "dynamic": 2}


def stored_tensor(value: Any, dtype: Any, deferred: list[tuple[str, Any, Any]], name: str) -> Any:
    """A buffer of the stored form: the array as a tensor of `dtype` (same bytes; FP8 codes arrive as uint8), or
    for a streamed weight's Deferred an unwritten tensor of its shape (never resident) recorded in `deferred` as
    (name, tensor, Deferred), which package computes and writes when it writes model.pt2."""
    import torch

    if isinstance(value, Deferred):
        t = torch.empty(value.shape, dtype=dtype)
        deferred.append((name, t, value))
        return t
    t = torch.from_numpy(value.copy())
    return t.view(dtype) if dtype == torch.float8_e4m3fn else t.to(dtype)  # E4M3: the codes' bytes


def fp8_linear_module(q: Any, bias: Any, dtype: Any, deferred: list[tuple[str, Any, Any]] | None = None) -> Any:
    """An nn.Module computing the quantized Linear `q` (a QuantizedWeight of scheme fp8_e4m3); its streamed
    buffers go to `deferred` (stored_tensor)."""
    import torch

    from runtime.backends import torch_ops

    pending = [] if deferred is None else deferred

    class Fp8Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("weight", stored_tensor(q.data.codes, torch.float8_e4m3fn, pending, "weight"))
            self.register_buffer("weight_scale", stored_tensor(q.data.scales, torch.float32, pending, "weight_scale"))
            scale = q.act_scale if q.act_scale is not None else 1.0
            self.register_buffer("input_scale", torch.tensor(scale, dtype=torch.float32))
            self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)
            self.act = _ACT[q.act_mode]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch_ops.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, self.act)

    return Fp8Linear()


def int4_linear_module(q: Any, bias: Any, dtype: Any, deferred: list[tuple[str, Any, Any]] | None = None) -> Any:
    """An nn.Module computing the quantized Linear `q` (a QuantizedWeight of scheme int4); its streamed buffers go
    to `deferred` (stored_tensor)."""
    import torch

    from compiler.quant.int4 import pack_nibbles
    from runtime.backends import torch_ops

    pending = [] if deferred is None else deferred
    codes = q.data.codes
    n, k = codes.shape
    packed = (codes.map(pack_nibbles, (n, (k + 1) // 2), np.uint8) if isinstance(codes, Deferred)
              else pack_nibbles(codes))

    class Int4Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("weight_packed", stored_tensor(packed, torch.uint8, pending, "weight_packed"))
            self.register_buffer("weight_scale", stored_tensor(q.data.scales, torch.float32, pending, "weight_scale"))
            self.register_buffer("weight_zero", stored_tensor(q.data.zeros, torch.uint8, pending, "weight_zero"))
            self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)
            self.group_size = int(q.data.group_size)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch_ops.int4_linear(x, self.weight_packed, self.weight_scale, self.weight_zero,
                                         self.group_size, self.bias)

    return Int4Linear()


WEIGHT_PASSES = ("quantize_fp8", "quantize_rtn", "quantize_awq", "quantize_gptq")


class LowerQuantTorchPass(Pass):
    """FP8 / INT4 Linears -> Fp8Linear / Int4Linear modules (custom ops); then the program is exported again."""

    name: ClassVar[str] = "lower_quant_torch"
    requires = ("capture",)
    summary = ("FP8 Linears -> optimize::fp8_linear (torch._scaled_mm on FP8 GPUs), INT4 -> optimize::int4_linear "
               "(Triton on CUDA); re-export the program")

    def check_recipe(self, recipe: Any) -> tuple[str, str] | None:
        if recipe.target.backend != "torch":
            return ("name", f"lower_quant_torch lowers into the torch.export program; the {recipe.target.backend} "
                    "target uses lower_quant (after lower_onnx)")
        names = [p.name for p in recipe.passes]
        for other in names:
            if other.startswith("quantize_") and other not in WEIGHT_PASSES:
                return ("name", f"{other!r}: the torch targets lower weight quantization only ("
                        f"{', '.join(WEIGHT_PASSES)}); KV-cache quantization is lowered for the ONNX Runtime targets")
        if not any(p in WEIGHT_PASSES for p in names[:names.index(self.name)]):
            return ("name", f"lower_quant_torch needs a weight-quantization pass ({', '.join(WEIGHT_PASSES)}) "
                    "earlier in the list")
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import torch

        st = ctx.artifacts.get("quant")
        model = ctx.require("model", self.name)
        if st is None or not st.weights:
            raise BuildError("lower_quant_torch: no quantized weights (a weight-quantization pass must run before it)")
        dtype = getattr(torch, ctx.recipe.target.dtype)
        replaced = {"fp8_e4m3": 0, "int4": 0}
        quant_bytes, float_bytes = 0, 0
        # a streamed build: the stored forms are computed when package writes model.pt2 (compiler/streamed_pt2.py)
        deferred: dict[str, tuple[int, Any]] | None = ctx.artifacts.get("deferred_params")
        streamed = 0
        for name, q in sorted(st.weights.items()):
            if q.kind != "linear":
                raise BuildError(f"lower_quant_torch: {name} is a quantized {q.kind}; the torch targets lower "
                                 "Linear weights only (ignore embeddings: quantize_fp8 ignore: [embed_tokens])")
            path = name.removesuffix(".weight")
            parent_name, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, child)
            make = fp8_linear_module if q.scheme == "fp8_e4m3" else int4_linear_module
            pending: list[tuple[str, Any, Any]] = []
            new = make(q, old.bias, dtype, pending)
            setattr(parent, child, new)
            if deferred is not None:  # the float weight is gone (its storage may be reused): its record goes too
                deferred.pop(name, None)
                for buffer, t, value in pending:
                    deferred[f"{path}.{buffer}"] = (t.untyped_storage().data_ptr(), value)
                streamed += bool(pending)
            elif pending:
                raise BuildError(f"lower_quant_torch: {name} was quantized on streamed weights, but the build holds "
                                 "the model")
            replaced[q.scheme] += 1
            quant_bytes += sum(b.numel() * b.element_size() for b in new.buffers())
            float_bytes += old.weight.numel() * old.weight.element_size()
        cfg = ctx.checkpoint.config
        try:
            exported, args = export_forward_batch(model, cfg, ctx.recipe.runtime.kv_block_size, dtype)
        except Exception as e:
            raise BuildError(f"lower_quant_torch: torch.export failed: {str(e).splitlines()[0]}") from e
        ctx.artifacts["exported"] = exported
        ctx.artifacts["example_inputs"] = args

        def calls(op: str) -> int:
            return sum(1 for n in exported.graph.nodes if n.op == "call_function" and op in str(n.target))

        stats: dict[str, Any] = {"streamed": streamed} if deferred is not None else {}
        if replaced["fp8_e4m3"]:
            stats |= {"fp8_linears": replaced["fp8_e4m3"], "fp8_linear_calls": calls("fp8_linear")}
        if replaced["int4"]:
            stats |= {"int4_linears": replaced["int4"], "int4_linear_calls": calls("int4_linear")}
        log.info("lower_quant_torch: %d FP8 and %d INT4 Linears", replaced["fp8_e4m3"], replaced["int4"])
        return {**stats, "weight_bytes": quant_bytes, "float_weight_bytes": float_bytes,
                "graph_nodes": len(exported.graph.nodes)}
