"""Paged attention over packed tokens: a PyTorch reference and a Triton kernel that reads the block table.

Inputs (the ForwardBatch after RoPE and any q/k norm): q [T, h*d], this step's k and v [T, kvh*d], the
layer's KV pools [num_blocks, block_size, kvh, d], cu_seqlens [B+1], past_lens [B], block_table
[B, max_blocks]. Token t of sequence b sits at position past_lens[b] + (t - cu_seqlens[b]) and attends
to b's past (pool slots block_table[b][j // block_size] * block_size + j % block_size for j <
past_lens[b]) and to b's new tokens up to itself; with `window` >= 1 only to the last `window`
positions including its own. Softmax in float32; the output [T, h*d] has q's dtype.

`paged_attention_reference`: one sequence at a time in torch ops (host loop over cu_seqlens): the
CPU implementation and the test oracle.

`paged_attention_triton`: one Triton program per (token, KV head) holding the query heads of that KV
head's group ([G, d]), streaming the past from the pool through the block table and then the step's
own K/V in tiles of BLOCK_N keys with an online softmax (flash-decoding style, no split over the
context). Every index is computed on the device (the token -> sequence map by searchsorted), so a
decode step containing it can be captured in a CUDA graph. In a process started with TRITON_INTERPRET=1
it runs in Triton's interpreter on CPU tensors (how the tests compare it with the reference on a
machine without a GPU).
"""

from __future__ import annotations

import functools

import torch


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
    dev = q.device
    out = torch.zeros(t, num_heads, d, dtype=q.dtype, device=dev)
    q3, k3, v3 = q.reshape(t, num_heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
    cu = cu_seqlens.tolist()
    past = past_lens.tolist()
    for b in range(len(cu) - 1):
        s0, s1 = cu[b], cu[b + 1]
        if s1 == s0:
            continue
        p = int(past[b])
        j = torch.arange(p, device=dev)
        slots = block_table[b].to(torch.int64)[j // bs] * bs + j % bs
        keys = torch.cat([k_cache.reshape(-1, kv_heads, d)[slots], k3[s0:s1]])  # [P + Q, kvh, d]
        vals = torch.cat([v_cache.reshape(-1, kv_heads, d)[slots], v3[s0:s1]])
        keys = keys.repeat_interleave(group, dim=1).permute(1, 0, 2).float()  # [h, P + Q, d]
        vals = vals.repeat_interleave(group, dim=1).permute(1, 0, 2).float()
        qb = q3[s0:s1].permute(1, 0, 2).float()  # [h, Q, d]
        scores = torch.matmul(qb, keys.transpose(1, 2)) * scale  # [h, Q, P + Q]
        qpos = p + torch.arange(s1 - s0, device=dev).unsqueeze(1)
        kpos = torch.arange(p + s1 - s0, device=dev).unsqueeze(0)
        ok = kpos <= qpos
        if window > 0:
            ok = ok & (kpos > qpos - window)
        scores = scores.masked_fill(~ok, float("-inf"))
        out[s0:s1] = torch.matmul(torch.softmax(scores, dim=-1), vals).permute(1, 0, 2).to(q.dtype)
    return out.reshape(t, num_heads * d)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def paged_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor, past_lens: torch.Tensor, block_table: torch.Tensor,
    num_heads: int, kv_heads: int, window: int, scale: float,
) -> torch.Tensor:
    """The Triton kernel over the same inputs as paged_attention_reference (no host synchronisation)."""
    from runtime.kernels.triton_paged_attention import paged_attention_kernel

    t = q.shape[0]
    d = k_cache.shape[-1]
    out = torch.empty(t, num_heads * d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention_triton: the KV pools must be contiguous")
    group = num_heads // kv_heads
    cu = cu_seqlens.to(torch.int32).contiguous()
    tok = torch.arange(t, dtype=torch.int32, device=q.device)
    seq = torch.searchsorted(cu[1:].contiguous(), tok, right=True).to(torch.int32)
    bt = block_table.to(torch.int32).contiguous()
    block_g, block_d = pow2(group), pow2(d)
    block_n = max(16, min(64, 8192 // (block_g * block_d)))
    paged_attention_kernel[(t, kv_heads)](
        q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, out,
        seq, cu, past_lens.to(torch.int32).contiguous(), bt,
        bt.shape[1], float(scale),
        KVH=kv_heads, G=group, D=d, BS=k_cache.shape[1], WINDOW=max(0, int(window)),
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
    )
    return out


__all__ = ["paged_attention_reference", "paged_attention_triton", "triton_available"]
