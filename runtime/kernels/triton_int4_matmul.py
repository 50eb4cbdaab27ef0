"""The Triton INT4 weight-only matmul kernel (imported only where triton is installed; see int4_matmul.py).

In a process started with TRITON_INTERPRET=1 (read when triton is imported) it is built for Triton's
interpreter, which runs it on CPU tensors: how the tests check it on a machine without a GPU.
"""

import triton
import triton.language as tl


@triton.jit
def int4_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,  # noqa: ANN001
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,  # noqa: ANN001, N803
    GROUP: tl.constexpr, IEEE: tl.constexpr,  # noqa: N803
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
):
    """y[M, N] = x[M, K] @ dequant(W)^T, W's codes packed two per byte along K (low nibble first),
    scales (float32) and zero points (uint8) per (row of W, group of GROUP columns). Each program
    owns a BLOCK_M x BLOCK_N tile of y and walks K in BLOCK_K steps: it unpacks the tile of codes,
    dequantizes in float32, casts to x's dtype and accumulates tl.dot in float32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wk = n_ok[None, :] & k_ok[:, None]  # [BLOCK_K, BLOCK_N]
        byte = tl.load(w_ptr + rn[None, :] * stride_wn + (k[:, None] // 2), mask=wk, other=0).to(tl.int32)
        code = (byte >> ((k[:, None] % 2) * 4)) & 0xF
        g = k[:, None] // GROUP
        s = tl.load(s_ptr + rn[None, :] * stride_sn + g, mask=wk, other=0.0)
        z = tl.load(z_ptr + rn[None, :] * stride_sn + g, mask=wk, other=0).to(tl.float32)
        w = ((code.to(tl.float32) - z) * s).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
