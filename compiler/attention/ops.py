"""The fused attention variants as torch custom ops over the ForwardBatch's packed tokens.

Each op takes this step's packed q [T, h*d], k and v [T, kvh*d] (after RoPE and any q/k norm), the
layer's KV pools [num_blocks, block_size, kvh, d] and the ForwardBatch's cu_seqlens, past_lens and
block_table, and returns the attention output [T, h*d]. Token t of sequence b sits at position
past_lens[b] + (t - cu_seqlens[b]) (what the runtime's scheduler produces), and attends to the b's
past (read from the pool through its block table) and to b's new tokens up to itself, within the
sliding window when there is one (`window` >= 1: the last `window` positions including its own).

Eagerly (torch.export's fake tensors excepted) an op computes `paged_attention_reference`, a plain
per-sequence attention in torch: the quantization calibration, the build's quality gate and the
tests run it. Its ONNX translation (compiler/attention/lowering.py) is the contrib op of the variant.
"""

from __future__ import annotations

import torch

NAMESPACE = "optimize"


def paged_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor, past_lens: torch.Tensor, block_table: torch.Tensor,
    num_heads: int, kv_heads: int, window: int, scale: float,
) -> torch.Tensor:
    """Attention of packed tokens over a paged KV pool, one sequence at a time (softmax in float32)."""
    t = q.shape[0]
    d = k_cache.shape[-1]
    bs = k_cache.shape[1]
    group = num_heads // kv_heads
    out = torch.zeros(t, num_heads, d, dtype=q.dtype)
    q3, k3, v3 = q.view(t, num_heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s0, s1 = cu[b], cu[b + 1]
        if s1 == s0:
            continue
        p = int(past_lens[b])
        j = torch.arange(p)
        slots = block_table[b].to(torch.int64)[j // bs] * bs + j % bs
        keys = torch.cat([k_cache.reshape(-1, kv_heads, d)[slots], k3[s0:s1]])  # [P + Q, kvh, d]
        vals = torch.cat([v_cache.reshape(-1, kv_heads, d)[slots], v3[s0:s1]])
        keys = keys.repeat_interleave(group, dim=1).permute(1, 0, 2).float()  # [h, P + Q, d]
        vals = vals.repeat_interleave(group, dim=1).permute(1, 0, 2).float()
        qb = q3[s0:s1].permute(1, 0, 2).float()  # [h, Q, d]
        scores = torch.matmul(qb, keys.transpose(1, 2)) * scale  # [h, Q, P + Q]
        qpos = p + torch.arange(s1 - s0).unsqueeze(1)
        kpos = torch.arange(p + s1 - s0).unsqueeze(0)
        ok = kpos <= qpos
        if window > 0:
            ok = ok & (kpos > qpos - window)
        scores = scores.masked_fill(~ok, float("-inf"))
        out[s0:s1] = torch.matmul(torch.softmax(scores, dim=-1), vals).permute(1, 0, 2).to(q.dtype)
    return out.reshape(t, num_heads * d)


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

OPS = {"gqa": paged_gqa, "paged_attention": paged_attention}
