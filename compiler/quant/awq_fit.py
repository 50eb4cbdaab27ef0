"""AWQ's quantized form with its scales and clipping ranges fitted end to end (`search: fit`).

AWQ stores each Linear as Q(W * s) with the previous op's output divided by s: per input channel
scales s shared by the Linears that read one tensor (compiler/quant/awq.py), per (row, group) ranges,
round to nearest. AutoAWQ picks s on a one-parameter grid (s = x_mean^a / w_mean^(1-a)) against each
block's output error, and the ranges by a per-Linear shrink search. Here the same parameters are
fitted by gradient descent on what the model is scored on, the KL divergence of the quantized model's
next-token distribution from the float model's on the calibration tokens:

- log s per input channel of every scale group (under grouped-query attention, v -> o's scales are
  tied: one per v output channel, as awq.ScaleGroup.tied folds them), starting at s = 1;
- per (row, group) clipping factors sigmoid(a_max), sigmoid(a_min) in (0, 1) on the group's max and
  min (learnable weight clipping, as OmniQuant), starting at sigmoid(4) ~ 0.982;
- the rounding of w / scale and of the zero point passes gradients straight through.

The unfolded model is fitted (each Linear reads Q(W * s) / s; a row scaling commutes with per-group
quantization, so folding s into the previous op afterwards gives the same function), with Adam and a
cosine learning rate over `epochs` passes of the calibration batches, the float model's distribution
computed per batch. The stored form is AWQ's: integer codes, per-group scale and zero point, no
change to the artifact or the runtime; nothing is rounded other than to nearest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from compiler.quant import int4

log = logging.getLogger(__name__)

CLIP_INIT = 4.0  # initial clipping logit: sigmoid(4) ~ 0.982 of the group's max and min


@dataclass
class FitGroup:
    """One input-sharing group of a layer: its Linears (name, module, INT4 target?), and the GQA tie of
    v -> o (awq.ScaleGroup.tie) or None; `scaled` False: no scale (the group's scale could not be folded)."""

    name: str
    linears: list[tuple[str, nn.Linear, bool]]
    tie: torch.Tensor | None = None
    scaled: bool = True


@dataclass
class FitResult:
    scales: dict[str, torch.Tensor]  # group name -> s [in] of its Linears' input channels
    clips: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Linear name -> (max, min) factors [out, G]
    kl: list[float] = field(default_factory=list)  # mean KL per epoch (fitting, quantized forward)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return (x.round() - x).detach() + x


def clipped_range(w: torch.Tensor, group_size: int, f_max: torch.Tensor, f_min: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-group (min, max) [out, G] of w scaled by the clipping factors."""
    wmin, wmax = int4.group_minmax(w, group_size)
    return f_min * wmin, f_max * wmax


def fake_quantize(w: torch.Tensor, group_size: int, f_max: torch.Tensor, f_min: torch.Tensor) -> torch.Tensor:
    """Q(w) with the clipped per-group ranges, differentiable (straight-through rounding); exactly
    int4.params_from_range / quantize_codes / dequantize_codes in the forward direction."""
    wmin, wmax = clipped_range(w, group_size, f_max, f_min)
    wmin = torch.clamp(wmin, max=0)
    wmax = torch.clamp(wmax, min=0)
    scale = (wmax - wmin).clamp(min=1e-5) / int4.MAXQ
    zero = torch.clamp(round_ste(-wmin / scale), 0, int4.MAXQ)
    s = int4.expand(scale, w.shape[1], group_size)
    z = int4.expand(zero, w.shape[1], group_size)
    return (torch.clamp(round_ste(w / s) + z, 0, int4.MAXQ) - z) * s


def quantize(w: torch.Tensor, group_size: int, f_max: torch.Tensor, f_min: torch.Tensor) -> int4.Int4Weight:
    """The stored INT4 weight of fake_quantize (same ranges, same rounding)."""
    w = w.detach().to(torch.float32)
    wmin, wmax = clipped_range(w, group_size, f_max, f_min)
    scale, zero = int4.params_from_range(wmin, wmax)
    codes = int4.quantize_codes(w, int4.expand(scale, w.shape[1], group_size), int4.expand(zero, w.shape[1], group_size))
    return int4.from_codes(codes, scale, zero, group_size)


class _Swap:
    """Replaces Linear weights by plain tensors (the fitted Q(W s) / s) and puts the parameters back."""

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.linears = linears
        self.params = {n: lin.weight for n, lin in linears.items()}

    def set(self, weights: dict[str, torch.Tensor]) -> None:
        for n, w in weights.items():
            lin = self.linears[n]
            lin._parameters.pop("weight", None)
            lin.__dict__["weight"] = w

    def restore(self) -> None:
        for n, lin in self.linears.items():
            lin.__dict__.pop("weight", None)
            lin._parameters["weight"] = self.params[n]


def fit(groups: list[FitGroup], batches: int, forward: Callable[[int], torch.Tensor], group_size: int,
        epochs: int, lr_scale: float, lr_clip: float, seed: int = 0,
        on_epoch: Callable[[int, float], None] | None = None) -> FitResult:
    """Fit every group's scales and its target Linears' clipping factors; `forward(b)` is the model's
    logits [tokens, vocab] on calibration batch b with the Linears' current weights. The model's
    weights are unchanged on return."""
    logs: dict[str, torch.Tensor] = {}
    clip_logits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    linears: dict[str, nn.Linear] = {}
    originals: dict[str, torch.Tensor] = {}
    for g in groups:
        width = g.linears[0][1].in_features
        if g.scaled:
            n = int(g.tie.max()) + 1 if g.tie is not None else width
            logs[g.name] = torch.zeros(n, dtype=torch.float32, requires_grad=True)
        for name, lin, target in g.linears:
            if not target:
                continue
            linears[name] = lin
            originals[name] = lin.weight.detach().to(torch.float32).clone()
            shape = (lin.out_features, int4.num_groups(lin.in_features, group_size))
            clip_logits[name] = (torch.full(shape, CLIP_INIT, requires_grad=True),
                                 torch.full(shape, CLIP_INIT, requires_grad=True))

    def scale_of(g: FitGroup) -> torch.Tensor | None:
        if not g.scaled:
            return None
        s = logs[g.name].exp()
        return s[g.tie] if g.tie is not None else s

    def quantized() -> dict[str, torch.Tensor]:
        out = {}
        for g in groups:
            s = scale_of(g)
            for name, _lin, target in g.linears:
                if not target:
                    continue
                a_max, a_min = clip_logits[name]
                w = originals[name] if s is None else originals[name] * s
                q = fake_quantize(w, group_size, torch.sigmoid(a_max), torch.sigmoid(a_min))
                out[name] = q if s is None else q / s
        return out

    params = [{"params": list(logs.values()), "lr": lr_scale},
              {"params": [t for pair in clip_logits.values() for t in pair], "lr": lr_clip}]
    opt = torch.optim.Adam(params)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, epochs * batches))
    swap = _Swap(linears)
    kl_per_epoch: list[float] = []
    rng = np.random.default_rng(seed)
    try:
        for epoch in range(epochs):
            total, count = 0.0, 0
            for b in rng.permutation(batches):
                with torch.no_grad():
                    swap.restore()
                    teacher = torch.log_softmax(forward(int(b)).to(torch.float32), -1)
                swap.set(quantized())
                student = torch.log_softmax(forward(int(b)).to(torch.float32), -1)
                loss = (teacher.exp() * (teacher - student)).sum(-1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += float(loss.detach()) * teacher.shape[0]
                count += teacher.shape[0]
            kl_per_epoch.append(total / max(1, count))
            log.debug("awq fit epoch %d: KL %.5f", epoch, kl_per_epoch[-1])
            if on_epoch is not None:
                on_epoch(epoch, kl_per_epoch[-1])
    finally:
        swap.restore()
    with torch.no_grad():
        scales = {g.name: s.detach().clone() for g in groups if (s := scale_of(g)) is not None}
        clips = {n: (torch.sigmoid(a).detach(), torch.sigmoid(b).detach()) for n, (a, b) in clip_logits.items()}
    return FitResult(scales, clips, kl_per_epoch)
