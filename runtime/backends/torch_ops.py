"""torch custom ops that the torch targets' programs (model.pt2) call; registered before a program loads.

`optimize::fp8_linear(x, weight, weight_scale, input_scale, bias, act)`: y = x W^T + b with W stored in
FP8 E4M3 (float8_e4m3fn [N, K]) and float32 scales per output channel ([N]) or per tensor ([]).
`act` says how the input is quantized: 0 none (x stays in its dtype), 1 static per tensor
(`input_scale`, from calibration), 2 dynamic per token (amax / 448 of each row). Quantization is
x / scale saturated to +-448 and rounded to the nearest E4M3 value, as ONNX QuantizeLinear does.

On a CUDA GPU with FP8 tensor cores (compute capability >= 8.9) and act != 0 the product runs in FP8
through `torch._scaled_mm` (row-wise scales: the input's per row, the weight's per column), with
float32 accumulation; elsewhere the weight is dequantized and the product runs in x's dtype on the
fake-quantized input: the same arithmetic up to accumulation order.

`optimize::int4_linear(x, packed, scales, zeros, group_size, bias)`: y = x W^T + b with W in INT4
(runtime/kernels/int4_matmul.py: codes packed two per byte along K, float32 scales and uint8 zero
points per group of `group_size` input columns). On CUDA tensors with triton installed the Triton
kernel (dequantized tile by tile in registers); elsewhere the reference, which dequantizes W and runs
one matmul in x's dtype, or the same Triton kernel in the interpreter under TRITON_INTERPRET=1.

`optimize::paged_attention_triton(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads,
kv_heads, head_dim, block_size, window, scale)`: the `triton` attention variant (runtime/kernels/
paged_attention.py). On CUDA tensors the Triton kernel, which reads the pools through the block table
without host synchronisation (CUDA-graph safe); on CPU the per-sequence PyTorch reference, or the same
Triton kernel in Triton's interpreter when the process runs with TRITON_INTERPRET=1.

`optimize::paged_attention_flashinfer(...)` (same arguments): the `flashinfer` attention variant. On CUDA
tensors FlashInfer's kernels with the plan the torch backend made for this step
(runtime/kernels/flashinfer_attention.py); on CPU the per-sequence PyTorch reference.
"""

from __future__ import annotations

import functools
import os

import torch

from runtime.kernels.int4_matmul import int4_matmul_reference, int4_matmul_triton
from runtime.kernels.paged_attention import (
    paged_attention_reference,
    paged_attention_triton,
    triton_available,
)

E4M3_MAX = 448.0
ACT_NONE, ACT_STATIC, ACT_DYNAMIC = 0, 1, 2


@functools.lru_cache(maxsize=8)
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9) and hasattr(torch, "_scaled_mm")


def _input_scales(x2: torch.Tensor, input_scale: torch.Tensor, act: int) -> torch.Tensor:
    """float32 [M, 1] scale of each row of x2 [M, K]."""
    if act == ACT_STATIC:
        return input_scale.to(torch.float32).reshape(1, 1).expand(x2.shape[0], 1)
    amax = x2.abs().amax(dim=1, keepdim=True).to(torch.float32)
    return (amax / E4M3_MAX).clamp(min=1e-12)


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


@torch.library.custom_op("optimize::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
               bias: torch.Tensor | None, act: int) -> torch.Tensor:
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    w_scale = weight_scale.to(torch.float32)
    if act != ACT_NONE and x.is_cuda and _fp8_tensor_cores(x.device.index or 0) and k % 16 == 0 and n % 16 == 0:
        a_scale = _input_scales(x2, input_scale, act)
        b_scale = (w_scale.reshape(1, n) if w_scale.ndim else w_scale.reshape(1, 1).expand(1, n)).contiguous()
        out = torch._scaled_mm(_to_e4m3(x2, a_scale), weight.t(), scale_a=a_scale.contiguous(), scale_b=b_scale,
                               out_dtype=torch.bfloat16)
        out = out.to(x.dtype)
    else:
        w = weight.to(torch.float32) * (w_scale.reshape(n, 1) if w_scale.ndim else w_scale)
        if act != ACT_NONE:
            a_scale = _input_scales(x2, input_scale, act)
            x2 = (_to_e4m3(x2, a_scale).to(torch.float32) * a_scale).to(x.dtype)
        out = torch.matmul(x2, w.to(x.dtype).t())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


@fp8_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias, act):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_available()


@torch.library.custom_op("optimize::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    matmul = int4_matmul_triton if _interpreted() else int4_matmul_reference
    out = matmul(x, packed, scales, zeros, group_size)
    return out if bias is None else out + bias


@int4_linear.register_kernel("cuda")
def _(x, packed, scales, zeros, group_size, bias):  # noqa: ANN001, ANN202
    matmul = int4_matmul_triton if triton_available() else int4_matmul_reference
    out = matmul(x, packed, scales, zeros, group_size)
    return out if bias is None else out + bias


@int4_linear.register_fake
def _(x, packed, scales, zeros, group_size, bias):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.custom_op("optimize::paged_attention_triton", mutates_args=())
def paged_attention_triton_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, cu_seqlens: torch.Tensor, past_lens: torch.Tensor,
                              block_table: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int,
                              block_size: int, window: int, scale: float) -> torch.Tensor:
    args = (q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads, kv_heads, window, scale)
    if _interpreted():
        return paged_attention_triton(*args)
    return paged_attention_reference(*args)


@paged_attention_triton_op.register_kernel("cuda")
def _(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads, kv_heads, head_dim,  # noqa: ANN001, ANN202
      block_size, window, scale):
    return paged_attention_triton(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads,
                                  kv_heads, window, scale)


@paged_attention_triton_op.register_fake
def _(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads, kv_heads, head_dim,  # noqa: ANN001, ANN202
      block_size, window, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("optimize::paged_attention_flashinfer", mutates_args=())
def paged_attention_flashinfer_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, cu_seqlens: torch.Tensor, past_lens: torch.Tensor,
                                  block_table: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int,
                                  block_size: int, window: int, scale: float) -> torch.Tensor:
    return paged_attention_reference(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads,
                                     kv_heads, window, scale)


@paged_attention_flashinfer_op.register_kernel("cuda")
def _(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads, kv_heads, head_dim,  # noqa: ANN001, ANN202
      block_size, window, scale):
    from runtime.kernels.flashinfer_attention import active

    return active().attend(q, k, v, k_cache, v_cache, scale)


@paged_attention_flashinfer_op.register_fake
def _(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads, kv_heads, head_dim,  # noqa: ANN001, ANN202
      block_size, window, scale):
    return q.new_empty(q.shape)


__all__ = ["ACT_DYNAMIC", "ACT_NONE", "ACT_STATIC", "fp8_linear", "int4_linear", "paged_attention_flashinfer_op",
           "paged_attention_triton_op"]
