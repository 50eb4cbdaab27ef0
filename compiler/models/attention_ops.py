"""The fused attention variants as torch custom ops over the ForwardBatch's packed tokens.

Each op takes this step's packed q [T, h*d], k and v [T, kvh*d] (after RoPE and any q/k norm), the
layer's KV pools [num_blocks, block_size, kvh, d] and the ForwardBatch's cu_seqlens, past_lens and
block_table, and returns the attention output [T, h*d]. Token t of sequence b sits at position
past_lens[b] + (t - cu_seqlens[b]) (what the runtime's scheduler produces), and attends to the b's
past (read from the pool through its block table) and to b's new tokens up to itself, within the
sliding window when there is one (`window` >= 1: the last `window` positions including its own).

Eagerly (torch.export's fake tensors excepted) an op computes `paged_attention_reference`
(runtime/kernels/paged_attention.py), a plain per-sequence attention in torch: the quantization
calibration, the build's quality gate and the tests run it. The ONNX translation of `gqa` and
`paged_attention` (compiler/attention/lowering.py) is the contrib op of the variant, of `paged_cpu`
our optimize.PagedAttention; `triton` has none
(torch targets only: the program calls optimize::paged_attention_triton, whose CUDA kernel is Triton);
nor has `flashinfer` (optimize::paged_attention_flashinfer, FlashInfer's kernels on CUDA).
"""

from __future__ import annotations

import torch

from runtime.backends.torch_ops import paged_attention_flashinfer_op, paged_attention_triton_op
from runtime.kernels.paged_attention import paged_attention_reference

NAMESPACE = "optimize"


def _define(name: str) -> torch._library.custom_ops.CustomOpDef:
    @torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           cu_seqlens: torch.Tensor, past_lens: torch.Tensor, block_table: torch.Tensor,
           num_heads: int, kv_heads: int, head_dim: int, block_size: int, window: int, scale: float) -> torch.Tensor:
        return paged_attention_reference(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table,
                                         num_heads, kv_heads, window, scale)

    @op.register_fake
    def _(q, k, v, k_cache, v_cache, cu_seqlens, past_lens, block_table, num_heads, kv_heads, head_dim, block_size,
          window, scale):
        return q.new_empty(q.shape)

    return op


# One op per fused variant (same semantics, different ONNX translation).
paged_gqa = _define("paged_gqa")  # com.microsoft.GroupQueryAttention (ONNX Runtime CPU and CUDA)
paged_attention = _define("paged_attention")  # com.microsoft.PagedAttention (ONNX Runtime CUDA)
paged_cpu = _define("paged_cpu")  # optimize.PagedAttention (the C kernel, ONNX Runtime CPU)

# The torch targets' kernel variant (runtime/backends/torch_ops.py): Triton on CUDA, the reference on CPU.
OPS = {"gqa": paged_gqa, "paged_attention": paged_attention, "paged_cpu": paged_cpu, "triton": paged_attention_triton_op,
       "flashinfer": paged_attention_flashinfer_op}
