"""FP8 E4M3 (float8_e4m3fn: no infinities, max 448) scales and casts.

    q = saturate(x / scale) rounded to the nearest E4M3 value      x' = float(q) * scale

`scale = amax / 448`, per output channel or per tensor for weights, per tensor (static, from
calibration) or per token (dynamic, computed in the graph) for activations. The cast is
round-to-nearest-even with saturation, as ONNX QuantizeLinear (saturate=1) does it.

A weight that a streamed build has not read (compiler/streamed.py) is a `StreamedFp8`: its codes and
scales are computed from the checkpoint tensor when package writes them, by the same `quantize_weight`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from compiler.streamed import Deferred, as_torch, cached

E4M3_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero channel still gets a finite, positive scale


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn with saturation (values beyond +-448 clamp instead of becoming NaN)."""
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return to_e4m3(x / scale).to(torch.float32) * scale


@dataclass
class Fp8Weight:
    """One weight in FP8 E4M3: bit patterns + float32 scales (per row [out] or per tensor [])."""

    codes: np.ndarray  # uint8 [out, in]: E4M3 bit patterns
    scales: np.ndarray  # float32 [out] (axis 0) or shape () (per tensor)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> torch.Tensor:
        q = torch.from_numpy(self.codes.copy()).view(torch.float8_e4m3fn).to(torch.float32)
        s = torch.from_numpy(self.scales)
        return q * (s.view(-1, 1) if s.ndim == 1 else s)


class StreamedFp8(Fp8Weight):
    """FP8 E4M3 of a weight that is not in memory (compiler/streamed.py): codes and scales are Deferreds of one
    `quantize_weight` of `source` (the checkpoint tensor's reader), run when the artifact is written."""

    def __init__(self, name: str, source: Deferred, per_channel: bool) -> None:
        n, k = source.shape
        self.key = ("fp8", name, per_channel)

        def run() -> Fp8Weight:
            return quantize_weight(as_torch(source.compute()), per_channel)

        def part(field: str) -> Callable[[], np.ndarray]:
            return lambda: getattr(cached(self.key, run), field)

        super().__init__(codes=Deferred((n, k), np.uint8, part("codes"), group=self.key),  # type: ignore[arg-type]
                         scales=Deferred((n,) if per_channel else (), np.float32, part("scales"), group=self.key))  # type: ignore[arg-type]

    def dequantize(self) -> torch.Tensor:
        raise TypeError("a streamed FP8 weight is computed when the artifact is written, not dequantized")


def weight_scales(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    w = w.detach().to(torch.float32)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    return (amax / E4M3_MAX).clamp(min=MIN_SCALE)


def quantize_weight(w: torch.Tensor, per_channel: bool = True) -> Fp8Weight:
    w = w.detach().to(torch.float32)
    scale = weight_scales(w, per_channel)
    q = to_e4m3(w / (scale.view(-1, 1) if per_channel else scale))
    return Fp8Weight(codes=q.view(torch.uint8).numpy().copy(), scales=scale.to(torch.float32).numpy().copy())


def activation_scale(amax: float) -> float:
    """Static per-tensor scale of an activation whose calibration absolute maximum is `amax`."""
    return float(np.float32(max(amax / E4M3_MAX, MIN_SCALE)))
