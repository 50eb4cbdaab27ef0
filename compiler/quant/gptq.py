"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each column's rounding error
onto the columns not yet quantized through the inverse Hessian of the layer's reconstruction loss.

    H = 2/n * sum over calibration tokens of x x^T          (x: the Linear's input)
    H += damp * mean(diag H) * I;   U = chol(H^-1) upper
    for column j (in order, or by decreasing diag H with act_order):
        q_j = Q(w_j);  e = (w_j - q_j) / U[j, j];  w_k -= e * U[j, k] for k after j

with the lazy batch updates of the reference implementation (blocks of `block_size` columns), and inside
each block sub-batches of SUB_BLOCK columns: a column's error is pushed one by one only onto the rest of its
sub-batch, onto the rest of the block by one product per sub-batch (the same arithmetic, a fraction of the
memory traffic). A block's columns are held as rows ([n, rows]), so each update is contiguous.
Groups stay contiguous along the input dimension (what MatMulNBits and blocked DequantizeLinear
store): a group's scale and zero point are set from the group's current (error-updated) weights
when its first column comes up, also under act_order, so no g_idx permutation is needed (from the
group's min and max, or with `range_search` the shrunk range of least |Q(w) - w|^2.4). Dead
inputs (diag H = 0) get weight 0. Everything runs in the Hessian's dtype: float32 (quantize_gptq's default, as
the reference implementation) or float64 (`precision: float64`; AWQ's `rounding: gptq`).

Memory: the Hessian is prepared in place (`prepare`: permuted, dampened, inverted and factored in its own
storage), so GPTQ holds one [in, in] matrix, plus the weight in the Hessian's dtype and its uint8 codes. Linears
fed the same input (q/k/v, gate/up) share one accumulator and one prepared factor. X^T X is accumulated in the
upper triangle only (half the products) and mirrored when the value is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiler.quant import int4


class Hessian:
    """Running 2/n * X^T X of one Linear's inputs (float64, or `dtype`), accumulated in the upper triangle."""

    def __init__(self, columns: int, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"a Hessian is float32 or float64, not {dtype}")
        self.h = torch.zeros(columns, columns, dtype=dtype)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.h.dtype)
        # the upper triangle of X^T X a band of rows at a time (the product's working copy is [ADD_ROWS, in])
        for r in range(0, self.h.shape[0], ADD_ROWS):
            self.h[r:r + ADD_ROWS, r:] += x[:, r:r + ADD_ROWS].T @ x[:, r:]
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError("no calibration input reached this Linear")
        return _mirror_upper_(self.h.clone()).mul_(2.0 / self.n)

    def take(self) -> torch.Tensor:
        """value(), computed in the accumulator's own storage (the accumulator is spent)."""
        if self.n == 0:
            raise ValueError("no calibration input reached this Linear")
        h, self.h = self.h, torch.empty(0, dtype=self.h.dtype)
        return _mirror_upper_(h).mul_(2.0 / self.n)


def _mirror_upper_(h: torch.Tensor) -> torch.Tensor:
    """h's strict lower triangle set from its upper one, in place (a band of rows at a time)."""
    for r in range(0, h.shape[0], ADD_ROWS):
        h[r + ADD_ROWS:, r:r + ADD_ROWS] = h[r:r + ADD_ROWS, r + ADD_ROWS:].T
    return h


class SharedHessians:
    """The Hessians of one step's Linears, fed by LayerRunner.capture's sink. Linears whose input is the same
    tensor (q/k/v of one attention, gate/up of one MLP) share one accumulator: X^T X is computed once."""

    def __init__(self, columns: dict[str, int], dtype: torch.dtype = torch.float64) -> None:
        self.columns = columns
        self.dtype = dtype
        self.of: dict[str, Hessian] = {}
        self._users: dict[int, list[str]] = {}  # per accumulator, its Linears in the order they were first fed
        self._fed: dict[int, torch.Tensor] = {}  # per accumulator, the input it last took
        self._last: Hessian | None = None  # the accumulator that took the latest input

    def add(self, name: str, x: torch.Tensor) -> None:
        acc = self.of.get(name)
        if acc is None:
            last = self._last
            if last is not None and self._fed[id(last)] is x:  # the input the previous Linear was fed
                self.of[name] = last
                self._users[id(last)].append(name)
                return
            acc = self.of[name] = Hessian(self.columns[name], self.dtype)
            self._users[id(acc)] = [name]
        elif self._fed.get(id(acc)) is x:  # a Linear sharing the accumulator took this input already
            return
        elif self._users[id(acc)][0] != name:  # never the case: one call computes all Linears of an input
            raise RuntimeError(f"{name}: its input was shared with {self._users[id(acc)][0]} and no longer is")
        acc.add(x)
        self._fed[id(acc)] = x
        self._last = acc


# rows of X^T X computed at a time by Hessian.add
ADD_ROWS = 1024
# columns of a lazy batch updated one by one in gptq_quantize_prepared (the rest of the batch takes one product
# per sub-batch): the rank-1 updates touch rows x SUB_BLOCK values instead of rows x block_size
SUB_BLOCK = 16


@dataclass(frozen=True)
class Prepared:
    """A Hessian made ready for GPTQ: the processing order, the dead inputs and the upper Cholesky factor of
    (H + damp * mean(diag H) * I)^-1 in that order."""

    perm: torch.Tensor
    dead: torch.Tensor
    hinv: torch.Tensor


def _permute_symmetric_(h: torch.Tensor, perm: torch.Tensor) -> None:
    """h <- h[perm][:, perm], in place (one row of extra memory, and a band of rows for the columns)."""
    n = h.shape[0]
    for r in range(0, n, ADD_ROWS):
        h[r:r + ADD_ROWS] = h[r:r + ADD_ROWS][:, perm]
    order = perm.tolist()
    seen = [False] * n
    for start in range(n):  # row j takes row order[j], cycle by cycle
        if seen[start] or order[start] == start:
            seen[start] = True
            continue
        first = h[start].clone()
        j = start
        while True:
            seen[j] = True
            k = order[j]
            if k == start:
                h[j] = first
                break
            h[j] = h[k]
            j = k


def prepare(h: torch.Tensor, damp: float = 0.01, act_order: bool = False) -> Prepared:
    """H (float32 or float64 [in, in], changed in place and returned inside the result) made ready for
    gptq_quantize_prepared, which then computes in H's dtype."""
    if h.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"prepare takes a float32 or float64 Hessian, got {h.dtype}")
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    cols = h.shape[0]
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(cols)
    if act_order:
        _permute_symmetric_(h, perm)
    h.diagonal().add_(damp * torch.mean(torch.diag(h)))  # H + damp * mean(diag H) * I
    try:  # chol(H), then H^-1 from it, then chol(H^-1) upper: each in H's storage
        torch.linalg.cholesky(h, out=h)
        torch.cholesky_inverse(h, out=h)
        torch.linalg.cholesky(h, upper=True, out=h)
    except RuntimeError as e:  # not positive definite even after dampening
        raise ValueError(f"Hessian is not positive definite (raise damp above {damp}): {e}") from e
    return Prepared(perm, dead, h)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, damp: float = 0.01,
                  act_order: bool = False, block_size: int = 128, symmetric: bool = False,
                  range_search: bool = False, overwrite_h: bool = False) -> tuple[int4.Int4Weight, float]:
    """INT4 codes of W [out, in] given the Hessian H [in, in]; returns (weight, reconstruction loss).
    `range_search`: each group's range by int4.search_range (least |Q(w) - w|^2.4 over shrunk ranges)
    instead of its min and max. `overwrite_h`: H (float64) is changed in place instead of copied."""
    h = h if overwrite_h and h.dtype == torch.float64 else h.to(torch.float64).clone()
    return gptq_quantize_prepared(w, prepare(h, damp, act_order), group_size, block_size, symmetric, range_search)


def gptq_quantize_prepared(w: torch.Tensor, prep: Prepared, group_size: int, block_size: int = 128,
                           symmetric: bool = False, range_search: bool = False) -> tuple[int4.Int4Weight, float]:
    """gptq_quantize with the Hessian already prepared (shared by the Linears of one input), in its dtype."""
    perm, hinv = prep.perm, prep.hinv
    dtype = hinv.dtype
    w = w.detach().to(dtype).clone()
    rows, cols = w.shape
    w[:, prep.dead] = 0.0
    if not torch.equal(perm, torch.arange(cols)):
        w = w[:, perm]

    groups = int4.num_groups(cols, group_size)
    gidx = (perm // group_size)  # group of the j-th processed column
    members = [torch.nonzero(gidx == g).flatten() for g in range(groups)]  # processed positions per group
    scale = torch.zeros(rows, groups, dtype=torch.float32)
    zero = torch.zeros(rows, groups, dtype=torch.float32)
    ready = [False] * groups
    codes = torch.zeros(cols, rows, dtype=torch.uint8)  # by processed column; exact: integers 0..15
    loss = torch.zeros((), dtype=torch.float64)
    for i1 in range(0, cols, block_size):  # lazy batches of block_size columns ...
        i2 = min(i1 + block_size, cols)
        n = i2 - i1
        w1 = w[:, i1:i2].T.contiguous()  # [n, rows]: the batch's column i is the row w1[i]
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for s1 in range(0, n, SUB_BLOCK):  # ... and inside each, sub-batches: one product per sub-batch
            s2 = min(s1 + SUB_BLOCK, n)
            for i in range(s1, s2):
                j = i1 + i
                g = int(gidx[j])
                if not ready[g]:
                    scale[:, g], zero[:, g] = _group_params(
                        _current(members[g], w, w1, err1, hinv, hinv1, i1, i2, s1, s2, i), symmetric, range_search)
                    ready[g] = True
                s, z = scale[:, g].to(dtype), zero[:, g].to(dtype)
                col = w1[i]
                q = int4.quantize_codes(col, s, z)
                e = (col - int4.dequantize_codes(q, s, z)) / hinv1[i, i]
                codes[j] = q
                err1[i] = e
                if i + 1 < s2:  # the rest of the sub-batch, column by column
                    w1[i + 1:s2].addr_(hinv1[i, i + 1:s2], e, alpha=-1)
            if s2 < n:  # the rest of the batch
                w1[s2:] -= hinv1[s1:s2, s2:].T @ err1[s1:s2]
        loss += (err1.to(torch.float64) ** 2).sum() / 2
        if i2 < cols:  # the columns after the batch
            w[:, i2:] -= err1.T @ hinv[i1:i2, i2:]
    codes = codes.T
    inv = torch.argsort(perm)
    return int4.from_codes(codes[:, inv], scale, zero, group_size, symmetric), float(loss)


def _current(pos: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, err1: torch.Tensor, hinv: torch.Tensor,
             hinv1: torch.Tensor, i1: int, i2: int, s1: int, s2: int, i: int) -> torch.Tensor:
    """The current (error-updated) weights [rows, len(pos)] of the processed positions `pos` (all at or after the
    column i1 + i being processed) while the lazy updates of batch [i1, i2) and its sub-batch [s1, s2) are pending:
    inside the sub-batch w1 is up to date; later in the batch the sub-batch's columns s1..i-1 are not applied yet;
    after the batch none of the batch's columns are."""
    rows = w.shape[0]
    cur = torch.empty(pos.numel(), rows, dtype=w.dtype)
    sub = pos < i1 + s2
    cur[sub] = w1[pos[sub] - i1]
    batch = ~sub & (pos < i2)
    if batch.any():
        k = pos[batch] - i1
        cur[batch] = w1[k] - hinv1[s1:i, k].T @ err1[s1:i] if i > s1 else w1[k]
    later = pos >= i2
    if later.any():
        k = pos[later]
        cur[later] = w[:, k].T - hinv[i1:i1 + i, k].T @ err1[:i]
    return cur.T


def _group_params(cur: torch.Tensor, symmetric: bool, range_search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of one group from its current weights [rows, n]."""
    if range_search:
        return int4.search_range(cur, symmetric)
    return int4.params_from_range(cur.amin(1), cur.amax(1), symmetric)
