"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each column's rounding error
onto the columns not yet quantized through the inverse Hessian of the layer's reconstruction loss.

    H = 2/n * sum over calibration tokens of x x^T          (x: the Linear's input)
    H += damp * mean(diag H) * I;   U = chol(H^-1) upper
    for column j (in order, or by decreasing diag H with act_order):
        q_j = Q(w_j);  e = (w_j - q_j) / U[j, j];  w_k -= e * U[j, k] for k after j

with the lazy batch updates of the reference implementation (blocks of `block_size` columns).
Groups stay contiguous along the input dimension (what MatMulNBits and blocked DequantizeLinear
store): a group's scale and zero point are set from the group's current (error-updated) weights
when its first column comes up, also under act_order, so no g_idx permutation is needed (from the
group's min and max, or with `range_search` the shrunk range of least |Q(w) - w|^2.4). Dead
inputs (diag H = 0) get weight 0. Everything runs in float64.
"""

from __future__ import annotations

import torch

from compiler.quant import int4


class Hessian:
    """Running 2/n * X^T X of one Linear's inputs (float64)."""

    def __init__(self, columns: int) -> None:
        self.h = torch.zeros(columns, columns, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        self.h += x.T @ x
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError("no calibration input reached this Linear")
        return self.h * (2.0 / self.n)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, damp: float = 0.01,
                  act_order: bool = False, block_size: int = 128, symmetric: bool = False,
                  range_search: bool = False, overwrite_h: bool = False) -> tuple[int4.Int4Weight, float]:
    """INT4 codes of W [out, in] given the Hessian H [in, in]; returns (weight, reconstruction loss).
    `range_search`: each group's range by int4.search_range (least |Q(w) - w|^2.4 over shrunk ranges)
    instead of its min and max. `overwrite_h`: H (float64) is changed in place instead of copied."""
    # memory: three [in, in] float64 matrices at a time (H, its Cholesky factor, the inverse), with overwrite_h
    w = w.detach().to(torch.float64).clone()
    h = h if overwrite_h and h.dtype == torch.float64 else h.to(torch.float64).clone()
    rows, cols = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(cols)
    if act_order:
        w = w[:, perm]
        h = h[perm][:, perm]
    h.diagonal().add_(damp * torch.mean(torch.diag(h)))  # H + damp * mean(diag H) * I
    try:
        hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
        del h
        hinv = torch.linalg.cholesky(hinv, upper=True)
    except RuntimeError as e:  # not positive definite even after dampening
        raise ValueError(f"Hessian is not positive definite (raise damp above {damp}): {e}") from e

    groups = int4.num_groups(cols, group_size)
    gidx = (perm // group_size)  # group of the j-th processed column
    members = [torch.nonzero(gidx == g).flatten() for g in range(groups)]  # processed positions per group
    scale = torch.zeros(rows, groups, dtype=torch.float32)
    zero = torch.zeros(rows, groups, dtype=torch.float32)
    ready = [False] * groups
    codes = torch.zeros(rows, cols, dtype=torch.float64)
    loss = 0.0
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = int(gidx[j])
            if not ready[g]:
                pos = members[g]
                cur = torch.empty(rows, pos.numel(), dtype=torch.float64)
                inside = pos < i2
                cur[:, inside] = w1[:, pos[inside] - i1]
                later = pos[~inside]
                if later.numel():
                    cur[:, ~inside] = w[:, later] - err1[:, :i] @ hinv[i1:j, later]
                scale[:, g], zero[:, g] = int4.search_range(cur, symmetric) if range_search else \
                    int4.params_from_range(cur.amin(1), cur.amax(1), symmetric)
                ready[g] = True
            s, z = scale[:, g].to(torch.float64), zero[:, g].to(torch.float64)
            col = w1[:, i]
            q = int4.quantize_codes(col, s, z)
            dq = int4.dequantize_codes(q, s, z)
            codes[:, j] = q
            d = hinv1[i, i]
            e = (col - dq) / d
            loss += float((e * e).sum()) / 2
            w1[:, i:] -= e.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    return int4.from_codes(codes[:, inv], scale, zero, group_size, symmetric), loss
