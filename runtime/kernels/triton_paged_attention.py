"""The Triton paged-attention kernel (imported only where triton is installed; see paged_attention.py).

In a process started with TRITON_INTERPRET=1 (read when triton is imported) it is built for Triton's
interpreter, which runs it on CPU tensors: how the tests check it on a machine without a GPU.
"""

import triton
import triton.language as tl


@triton.jit
def _attend(q, kk, vv, jm, m_i, l_i, acc):  # noqa: ANN001, ANN202
    """Online-softmax update with one tile of keys kk / values vv [N, D] (jm: which are valid) for the
    group's queries q [G, D]: running max m_i, sum l_i [G] and output acc [G, D]."""
    s = tl.sum(q[:, None, :] * kk[None, :, :], axis=2)  # [G, N]
    s = tl.where(jm[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vv[None, :, :], axis=1)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["bt_stride"])
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr,  # noqa: ANN001
    seq_ptr, cu_ptr, past_ptr, bt_ptr,  # noqa: ANN001
    bt_stride, scale,  # noqa: ANN001
    KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, WINDOW: tl.constexpr,  # noqa: N803
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: N803
):
    """One (token, KV head): the G query heads of the group against the past in the pool, then the
    step's own keys up to the token; online softmax in float32."""
    t = tl.program_id(0)
    kh = tl.program_id(1)
    b = tl.load(seq_ptr + t)
    start = tl.load(cu_ptr + b)
    past = tl.load(past_ptr + b)
    pos = past + (t - start)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(pos - WINDOW + 1, 0)
    og = tl.arange(0, BLOCK_G)
    od = tl.arange(0, BLOCK_D)
    on = tl.arange(0, BLOCK_N)
    qmask = (og < G)[:, None] & (od < D)[None, :]
    q_off = t.to(tl.int64) * (KVH * G * D) + (kh * G + og)[:, None] * D + od[None, :]
    q = tl.load(q_ptr + q_off, mask=qmask, other=0.0).to(tl.float32) * scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride
    # the past, read from the pool through the block table
    for j0 in range(lo, past, BLOCK_N):
        j = j0 + on
        jm = j < past
        blk = tl.load(bt_row + j // BS, mask=jm, other=0).to(tl.int64)
        row = (blk * BS + j % BS) * KVH + kh  # row of the pool viewed as [slots * KVH, D]
        kv_mask = jm[:, None] & (od < D)[None, :]
        kk = tl.load(kc_ptr + row[:, None] * D + od[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        vv = tl.load(vc_ptr + row[:, None] * D + od[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        m_i, l_i, acc = _attend(q, kk, vv, jm, m_i, l_i, acc)
    # this step's own keys of the sequence, up to the token itself
    for j0 in range(tl.maximum(lo, past), pos + 1, BLOCK_N):
        j = j0 + on
        jm = j <= pos
        row = (start + (j - past)).to(tl.int64) * KVH + kh  # row of k viewed as [T * KVH, D]
        kv_mask = jm[:, None] & (od < D)[None, :]
        kk = tl.load(k_ptr + row[:, None] * D + od[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + row[:, None] * D + od[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        m_i, l_i, acc = _attend(q, kk, vv, jm, m_i, l_i, acc)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=qmask)
