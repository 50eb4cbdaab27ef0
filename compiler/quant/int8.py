"""INT8 W8A8 math: symmetric per-output-channel int8 weights, dynamic int8 activations, SmoothQuant.

    weights     s_w[n] = max|W[n, :]| / Q          Wq = clamp(round(W / s_w), -Q, Q)   (int8, no zero point)
                Q = 64 (weight_range "reduced", the default) or 127 ("full")
    per_token   s_x[t] = max|x[t, :]| / 127        xq = round(x / s_x) + 128               (uint8, zero point 128)
    per_tensor  ONNX DynamicQuantizeLinear: uint8, asymmetric over the whole tensor (range includes 0)
    output      y[t, n] = s_x * s_w[n] * sum_k (xq[t, k] - zero point) * Wq[n, k]

Activations are quantized in the graph at run time (lower_quant writes the nodes); the functions
here are their numpy/torch reference. The activation codes are uint8 because ONNX Runtime's
integer GEMM (MLAS) has its fast VNNI/AMX path for uint8 x int8; int8 x int8 runs a slow
reference loop there. A per-token zero point of 128 makes uint8 codes carry symmetric int8 values.

Why the weights use Q = 64 by default: MLAS's uint8 x int8 kernel for AVX2 without VNNI (vpmaddubsw)
adds the products of two adjacent k into a saturating int16 before widening; with activation codes up
to 255 and weight codes up to 127 a pair reaches 2 x 255 x 127 = 64770 > 32767 and is clipped, so the
GEMM is not the integer dot product (measured: ORT 1.32 on an AVX2 EPYC matches a saturating-pair model
bit for bit). With |Wq| <= 64 a pair is at most 2 x 255 x 64 = 32640: exact on every ISA (VNNI and AMX
accumulate in int32 anyway), so an artifact computes the same on the machine that serves it as on the
one that built it. "full" (Q = 127) halves the weights' rounding step but is exact only where MLAS has
VNNI or AMX (AVX512-VNNI, AVX-VNNI, AMX-INT8).

SmoothQuant (Xiao et al. 2023) migrates activation outliers into the weights before rounding:
    s[c] = max|x[:, c]|^alpha / max|W[:, c]|^(1 - alpha)
the RMSNorm before q/k/v (and before gate/up) divides its channel c by s[c], the Linears reading it
multiply their column c by s[c]: the float model is unchanged, the activations are flatter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from compiler.streamed import Deferred, as_torch, cached, spill

QMAX = 127  # activations: per-token codes in [-127, 127] around the zero point
WEIGHT_QMAX = {"reduced": 64, "full": 127}  # weights: largest |code| per weight_range (see above)
MIN_SCALE = 1e-12  # an all-zero row (or token) still gets a finite, positive scale
ACT_ZERO_POINT = 128  # per-token activation codes: uint8 with a fixed zero point (symmetric int8 values)
Activations = Literal["per_token", "per_tensor"]
WeightRange = Literal["reduced", "full"]


@dataclass
class Int8Weight:
    """One Linear weight in int8: codes [out, in], float32 scale per output row, and how its input is
    quantized at run time."""

    codes: np.ndarray  # int8 [out, in]
    scales: np.ndarray  # float32 [out]
    activations: Activations = "per_token"
    qmax: int = WEIGHT_QMAX["reduced"]  # the largest |code| the rounding allowed

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(self.codes.astype(np.float32) * self.scales[:, None])


def quantize_weight(w: torch.Tensor, activations: Activations = "per_token",
                    weight_range: WeightRange = "reduced") -> Int8Weight:
    """Symmetric per-output-channel int8 codes in [-Q, Q], Q = WEIGHT_QMAX[weight_range] (round half to
    even, as torch.round)."""
    if weight_range not in WEIGHT_QMAX:
        raise ValueError(f"weight_range must be one of {', '.join(WEIGHT_QMAX)}, got {weight_range!r}")
    qmax = WEIGHT_QMAX[weight_range]
    w = w.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / qmax).clamp(min=MIN_SCALE)
    q = torch.round(w / scale.view(-1, 1)).clamp(-qmax, qmax).to(torch.int8)
    return Int8Weight(codes=q.numpy().copy(), scales=scale.numpy().astype(np.float32).copy(), activations=activations,
                      qmax=qmax)


class StreamedInt8(Int8Weight):
    """INT8 of a weight that is not in memory (compiler/streamed.py): codes and scales are Deferreds of one
    `quantize_weight` of `source` (the checkpoint tensor's reader), run when the artifact is written."""

    def __init__(self, name: str, source: Deferred, activations: Activations, weight_range: WeightRange) -> None:
        n, k = source.shape
        self.key = ("int8", name, activations, weight_range)

        def run() -> Int8Weight:
            return quantize_weight(as_torch(source.compute()), activations, weight_range)

        def part(field: str) -> Callable[[], np.ndarray]:
            return lambda: getattr(cached(self.key, run), field)

        super().__init__(codes=Deferred((n, k), np.int8, part("codes"), group=self.key),  # type: ignore[arg-type]
                         scales=Deferred((n,), np.float32, part("scales"), group=self.key),  # type: ignore[arg-type]
                         activations=activations, qmax=WEIGHT_QMAX[weight_range])

    def dequantize(self) -> torch.Tensor:
        raise TypeError("a streamed INT8 weight is computed when the artifact is written, not dequantized")


class SpilledInt8(Int8Weight):
    """An INT8 weight computed during the build (SmoothQuant's scaled weights of one streamed decoder layer) and
    kept on disk, not in memory: codes and scales are written to the build's spill folder and read back when the
    artifact is written."""

    def __init__(self, q: Int8Weight) -> None:
        super().__init__(codes=spill(q.codes), scales=spill(q.scales),  # type: ignore[arg-type]
                         activations=q.activations, qmax=q.qmax)

    def dequantize(self) -> torch.Tensor:
        raise TypeError("a spilled INT8 weight is read back when the artifact is written, not dequantized")


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
    """What the lowered int8 Linear computes (exact integer accumulation, then the float scales): on every
    CPU with reduced-range weights, only with VNNI / AMX for full-range ones."""
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
