"""INT8 W8A8 math: symmetric per-output-channel int8 weights, dynamic int8 activations, SmoothQuant.

    weights     s_w[n] = max|W[n, :]| / 127        Wq = clamp(round(W / s_w), -127, 127)   (int8, no zero point)
    per_token   s_x[t] = max|x[t, :]| / 127        xq = round(x / s_x) + 128               (uint8, zero point 128)
    per_tensor  ONNX DynamicQuantizeLinear: uint8, asymmetric over the whole tensor (range includes 0)
    output      y[t, n] = s_x * s_w[n] * sum_k (xq[t, k] - zero point) * Wq[n, k]

Activations are quantized in the graph at run time (lower_quant writes the nodes); the functions
here are their numpy/torch reference. The activation codes are uint8 because ONNX Runtime's
integer GEMM (MLAS) has its fast VNNI/AMX path for uint8 x int8; int8 x int8 runs a slow
reference loop there. A per-token zero point of 128 makes uint8 codes carry symmetric int8 values.

SmoothQuant (Xiao et al. 2023) migrates activation outliers into the weights before rounding:
    s[c] = max|x[:, c]|^alpha / max|W[:, c]|^(1 - alpha)
the RMSNorm before q/k/v (and before gate/up) divides its channel c by s[c], the Linears reading it
multiply their column c by s[c]: the float model is unchanged, the activations are flatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

QMAX = 127
MIN_SCALE = 1e-12  # an all-zero row (or token) still gets a finite, positive scale
ACT_ZERO_POINT = 128  # per-token activation codes: uint8 with a fixed zero point (symmetric int8 values)
Activations = Literal["per_token", "per_tensor"]


@dataclass
class Int8Weight:
    """One Linear weight in int8: codes [out, in], float32 scale per output row, and how its input is
    quantized at run time."""

    codes: np.ndarray  # int8 [out, in]
    scales: np.ndarray  # float32 [out]
    activations: Activations = "per_token"

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(self.codes.astype(np.float32) * self.scales[:, None])


def quantize_weight(w: torch.Tensor, activations: Activations = "per_token") -> Int8Weight:
    """Symmetric per-output-channel int8 (round half to even, as torch.round)."""
    w = w.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / QMAX).clamp(min=MIN_SCALE)
    q = torch.round(w / scale.view(-1, 1)).clamp(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(codes=q.numpy().copy(), scales=scale.numpy().astype(np.float32).copy(), activations=activations)


def quantize_per_token(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes [T, K] with zero point 128, float32 scales [T, 1]) as the graph computes them."""
    x = np.asarray(x, np.float32)
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True) * np.float32(1.0 / QMAX), np.float32(MIN_SCALE))
    q = np.clip(np.rint(x / scale) + ACT_ZERO_POINT, 0, 255).astype(np.uint8)
    return q, scale.astype(np.float32)


def quantize_per_tensor(x: np.ndarray) -> tuple[np.ndarray, np.float32, np.uint8]:
    """ONNX DynamicQuantizeLinear: (uint8 codes, scale, zero point) over the whole tensor."""
    x = np.asarray(x, np.float32)
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = np.float32((hi - lo) / 255.0) if hi > lo else np.float32(1.0)
    zp = np.uint8(np.clip(np.rint(np.float32(-lo) / scale), 0, 255))
    q = np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8)
    return q, scale, zp


def linear_reference(x: np.ndarray, w: Int8Weight) -> np.ndarray:
    """What the lowered int8 Linear computes (exact integer accumulation, then the float scales)."""
    wq = w.codes.astype(np.int64)
    if w.activations == "per_token":
        q, s = quantize_per_token(x)
        acc = (q.astype(np.int64) - ACT_ZERO_POINT) @ wq.T
        return (acc.astype(np.float32) * s) * w.scales[None, :]
    q, s, zp = quantize_per_tensor(x)
    acc = (q.astype(np.int64) - int(zp)) @ wq.T
    return acc.astype(np.float32) * (s * w.scales[None, :])


def smooth_scales(act_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float, floor: float = 1e-5) -> torch.Tensor:
    """SmoothQuant's per-input-channel migration scales (float32 [C]); a channel that never fires or
    whose weights are all zero keeps scale 1."""
    a = act_amax.to(torch.float64)
    w = w_amax.to(torch.float64)
    s = a.clamp(min=floor).pow(alpha) / w.clamp(min=floor).pow(1.0 - alpha)
    s = torch.where((a > 0) & (w > 0), s, torch.ones_like(s))
    return s.clamp(min=floor).to(torch.float32)
