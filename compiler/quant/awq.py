"""AWQ (activation-aware weight quantization, Lin et al. 2023), as llm-awq / AutoAWQ do it.

For each group of Linears that read the same input (q/k/v after input_layernorm, gate/up after
post_attention_layernorm, down after up, o after v; under grouped-query attention o's input channel
(head h, dim j) comes from v's channel (h // group, j), so those channels share one scale, the
geometric mean of theirs; AutoAWQ skips v -> o there):

1. **Scale search.** s = x_mean^a / w_mean^(1-a) (normalised so max*min = 1) for a on a grid of
   `n_grid` values in [0, 1); x_mean is the mean |activation| per input channel on the calibration
   tokens, w_mean the mean |w| per input channel with each group scaled to its own maximum. For each
   a the Linears get Q(W * s) / s and the block that contains them (attention, MLP or the Linear
   itself) runs on the calibration input; the a with the least output MSE wins.
2. **Scale folding.** W[:, c] *= s[c] in the Linears and the op before them divides its output
   channel c by s[c] (an RMSNorm weight or the rows of the previous Linear): the float model
   computes the same function, the salient channels lose less in INT4.
3. **Clip search** (all but q/k, whose errors the attention softmax amplifies): per (row, group) the
   range is shrunk to max|w| * (1 - i / n_grid), i < max_shrink * n_grid, keeping the shrink with
   the least error of the group's partial dot products on up to `clip_tokens` calibration tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from compiler.quant import int4


@dataclass
class ScaleGroup:
    """Linears that read one tensor, the op that produces it, and the block to measure them in."""

    name: str  # for the manifest, e.g. "layers.0.qkv"
    prev: nn.Module | None  # RMSNorm (weight [C]) or Linear (rows [C]); None: no folding possible
    linears: list[nn.Linear]  # every consumer of the tensor (ignored ones are scaled, not quantized)
    quantize: list[bool]  # which of `linears` are INT4 targets
    inputs: list[torch.Tensor]  # calibration input per batch [tokens, C]
    block: Callable[[int, torch.Tensor], torch.Tensor]  # (batch, input) -> output of the measured block
    tie: torch.Tensor | None = None  # [C] -> channel of `prev`'s output feeding input channel c (GQA v -> o)

    def tied(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale of the consumers' inputs [C], scale of prev's outputs): equal without a tie; with one,
        the geometric mean over the input channels fed by the same output channel."""
        if self.tie is None:
            return s, s
        n = int(self.tie.max()) + 1
        logs = torch.zeros(n, dtype=torch.float64).index_add_(0, self.tie, s.double().log())
        counts = torch.zeros(n, dtype=torch.float64).index_add_(0, self.tie, torch.ones_like(s, dtype=torch.float64))
        small = (logs / counts).exp().to(s.dtype)
        return small[self.tie], small


def x_mean(inputs: list[torch.Tensor]) -> torch.Tensor:
    total = sum(x.abs().sum(0, dtype=torch.float64) for x in inputs)
    count = sum(x.shape[0] for x in inputs)
    return (total / count).to(torch.float32)


def w_mean(linears: list[nn.Linear], group_size: int) -> torch.Tensor:
    """Mean over rows of |w| / (group max of |w|) per input channel."""
    rows = []
    for lin in linears:
        w = lin.weight.detach().to(torch.float32).abs()
        _, wmax = int4.group_minmax(w, group_size)
        rows.append(w / (int4.expand(wmax, w.shape[1], group_size) + 1e-6))
    return torch.cat(rows, 0).mean(0)


def _mse(block: Callable[[int, torch.Tensor], torch.Tensor], inputs: list[torch.Tensor],
         reference: list[torch.Tensor]) -> float:
    err, count = 0.0, 0
    for b, x in enumerate(inputs):
        out = block(b, x)
        err += float((out - reference[b]).double().pow(2).sum())
        count += out.numel()
    return err / count


def search_scale(g: ScaleGroup, group_size: int, n_grid: int = 20, duo_scaling: bool | str = True
                 ) -> tuple[torch.Tensor, float, float]:
    """The best per-channel scale of a group: (scales [C], ratio, loss). duo_scaling "both" searches the
    grid with and without the weight term (2 n_grid candidates); the ratio of a weight-free winner is
    reported negative (-a)."""
    with torch.no_grad():
        xm = x_mean(g.inputs)
        wm = w_mean(g.linears, group_size)
        originals = [lin.weight.detach().clone() for lin in g.linears]
        reference = [g.block(b, x) for b, x in enumerate(g.inputs)]
        best = (float("inf"), -1.0, torch.ones_like(xm))
        try:
            modes = (True, False) if duo_scaling == "both" else (bool(duo_scaling),)
            for duo, i in ((d, i) for d in modes for i in range(n_grid)):
                ratio = i / n_grid
                if duo:
                    s = (xm.pow(ratio) / (wm.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
                else:
                    s = xm.pow(ratio).clamp(min=1e-4)
                s = s / (s.max() * s.min()).sqrt()
                s = g.tied(s)[0]
                for lin, w0, q in zip(g.linears, originals, g.quantize, strict=True):
                    if q:
                        lin.weight.copy_(int4.fake_quantize(w0 * s, group_size) / s)
                loss = _mse(g.block, g.inputs, reference)
                if loss < best[0]:
                    best = (loss, ratio if duo or ratio == 0 else -ratio, s.clone())
        finally:
            for lin, w0 in zip(g.linears, originals, strict=True):
                lin.weight.copy_(w0)
    return best[2], best[1], best[0]


def apply_scale(g: ScaleGroup, s: torch.Tensor) -> None:
    """Fold s into the group: the previous op's output channel c / s[c], the Linears' column c * s[c]."""
    with torch.no_grad():
        prev = g.prev
        s, s_prev = g.tied(s)
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s_prev.view(-1, 1))
            if prev.bias is not None:
                prev.bias.div_(s_prev)
        elif prev is not None:  # RMSNorm
            prev.weight.div_(s_prev)
        for lin in g.linears:
            lin.weight.mul_(s.view(1, -1))
        for x in g.inputs:
            x.div_(s)


def rescale_rows(q: int4.Int4Weight, s: torch.Tensor) -> int4.Int4Weight:
    """An INT4 weight with row c divided by s[c]: the same codes and zero points, scales / s (exact in
    INT4, since scales are per (row, group))."""
    scales = (torch.from_numpy(q.scales) / s.to(torch.float32).view(-1, 1)).numpy()
    return int4.Int4Weight(q.codes, scales.astype("float32"), q.zeros, q.group_size, q.symmetric)


def search_clip(w: torch.Tensor, inputs: list[torch.Tensor], group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5, clip_tokens: int = 512, rows_per_batch: int = 256) -> torch.Tensor:
    """Per (row, group) clipping bound max_val [out, G] with the least partial-output error."""
    w = w.detach().to(torch.float32)
    x = torch.cat(inputs, 0)
    step = max(1, x.shape[0] // clip_tokens)
    x = x[::step][:clip_tokens]  # evenly spaced tokens: deterministic
    xg, _ = int4._grouped(x, group_size)  # [n, G, gs], padding 0
    best_all = []
    with torch.no_grad():
        for r0 in range(0, w.shape[0], rows_per_batch):
            wb = w[r0:r0 + rows_per_batch]
            wg, _ = int4._grouped(wb, group_size)  # [o, G, gs]
            org_out = torch.einsum("ogk,ngk->ong", wg, xg)
            wmin, wmax = int4.group_minmax(wb, group_size)
            org_max = torch.maximum(wmax.abs(), wmin.abs())
            best_max = org_max.clone()
            min_err = torch.full_like(org_max, float("inf"))
            for i in range(int(max_shrink * n_grid)):
                max_val = org_max * (1 - i / n_grid)
                qg, _ = int4._grouped(int4.fake_quantize(wb, group_size, max_val), group_size)
                cur_out = torch.einsum("ogk,ngk->ong", qg, xg)
                err = (cur_out - org_out).pow(2).mean(1)  # [o, G]
                better = err < min_err
                min_err = torch.where(better, err, min_err)
                best_max = torch.where(better, max_val, best_max)
            best_all.append(best_max)
    return torch.cat(best_all, 0)
