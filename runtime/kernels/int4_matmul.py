"""INT4 weight-only matmul for the torch targets: a PyTorch reference and a Triton kernel.

The stored form (compiler/passes/lower_quant_torch.py writes it into the program): `packed` uint8
[N, ceil(K/2)], the 4-bit codes of W [N, K] two per byte along K (even column in the low nibble, as
MatMulNBits packs them); `scales` float32 [N, G] and `zeros` uint8 [N, G] per group of `group_size`
columns (G = ceil(K / group_size)); W[n, k] = (code - zero) * scale of k's group. y = x W^T.

`int4_matmul_reference`: unpack and dequantize W in float32, then one matmul in x's dtype: the CPU
implementation and the test oracle.

`int4_matmul_triton`: a tiled kernel that reads the packed codes and dequantizes each tile in
registers (weight traffic stays at half a byte per weight), accumulating in float32; float32 inputs
use IEEE products (no TF32), so a float32 artifact computes what the reference computes. In a
process started with TRITON_INTERPRET=1 it runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from runtime.kernels.paged_attention import pow2


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [N, ceil(K/2)] -> codes int16 [N, K] (0..15)."""
    p = packed.to(torch.int16)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :k]


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    k: int) -> torch.Tensor:
    """W float32 [N, K]."""
    codes = unpack_int4(packed, k).to(torch.float32)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :k]
    return (codes - z) * s


def int4_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype."""
    k = x.shape[-1]
    w = dequantize_int4(packed, scales, zeros, group_size, k)
    return torch.matmul(x, w.to(x.dtype).t())


def int4_matmul_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """The Triton kernel over the same inputs as int4_matmul_reference."""
    from runtime.kernels.triton_int4_matmul import int4_matmul_kernel

    n, k = packed.shape[0], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    packed, scales, zeros = packed.contiguous(), scales.contiguous(), zeros.contiguous()
    if scales.dtype != torch.float32 or zeros.dtype != torch.uint8 or packed.dtype != torch.uint8:
        raise ValueError("int4_matmul_triton: packed uint8, scales float32, zeros uint8")
    block_m = max(16, min(64, pow2(m)))  # decode steps: one tile of rows
    block_n, block_k = 64, 64
    grid = (-(-m // block_m), -(-n // block_n))
    int4_matmul_kernel[grid](
        x2, packed, scales, zeros, y, m, n, k, x2.stride(0), packed.stride(0), scales.stride(0), y.stride(0),
        GROUP=group_size, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y.reshape(*x.shape[:-1], n)


__all__ = ["dequantize_int4", "int4_matmul_reference", "int4_matmul_triton", "unpack_int4"]
