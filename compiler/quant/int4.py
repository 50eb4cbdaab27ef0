"""Asymmetric INT4 weight quantization with groups along the input dimension.

A Linear weight W [out, in] is cut along `in` into groups of `group_size` columns; the last group
is shorter when `in` is not a multiple (the demo's down_proj: 704 = 5 x 128 + 64). Each (row,
group) has a float32 scale and an integer zero point in [0, 15]:

    code = clamp(round(w / scale) + zero, 0, 15)        w' = (code - zero) * scale

which is exactly ONNX DequantizeLinear on uint4 (blocked, axis=1) and ORT MatMulNBits. Codes are
kept unpacked (uint8, one code per byte) until lowering packs them. Scales come from the group's
min and max (optionally clipped to `max_val`), widened to contain 0.

Symmetric (`symmetric=True`, as GPTQ's `sym`): the zero point is 8 in every group and
scale = 2 * max|w| / 15, so code - 8 is a signed int4 in [-8, 7]: the form TensorRT dequantizes
(signed int4, zero point 0), and still plain uint4 + zero point for MatMulNBits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from compiler.streamed import Deferred, as_torch, cached, spill

try:  # the C loops of quantize_rtn and pack_matmulnbits, built by `pip install -e .` (setup.py)
    from compiler.quant import _int4
except ImportError:  # pragma: no cover - a source tree whose extensions were not built
    _int4 = None
    logging.getLogger(__name__).warning(
        "compiler.quant._int4 is not built (run `pip install -e .`): INT4 quantization and packing run the "
        "torch/numpy reference, about 10x slower, with the same bits")

MAXQ = 15  # 4 bits, unsigned codes
SYMMETRIC_ZERO = 8  # the zero point of symmetric INT4: code - 8 is the signed value


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    """[in] -> the group of each input column."""
    return torch.arange(in_features) // group_size


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (padded view [out, G, gs], valid mask [1, G, gs]); padding is 0 and masked."""
    out, cols = w.shape
    g = num_groups(cols, group_size)
    pad = g * group_size - cols
    wp = torch.nn.functional.pad(w, (0, pad)).view(out, g, group_size)
    valid = (torch.arange(g * group_size) < cols).view(1, g, group_size)
    return wp, valid


def group_minmax(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group) min and max over the real columns: two [out, G] tensors."""
    out, cols = w.shape
    if cols % group_size == 0:  # whole groups: a view, no padded copy or mask
        groups = w.reshape(out, cols // group_size, group_size)
        if w.requires_grad:  # AWQ's fit: torch 2.11 has no derivative for aminmax (amin/amax share its formula)
            return groups.amin(-1), groups.amax(-1)
        return torch.aminmax(groups, dim=-1)
    wp, valid = _grouped(w, group_size)
    wmin = torch.where(valid, wp, torch.full((), float("inf"), dtype=w.dtype)).amin(-1)
    wmax = torch.where(valid, wp, torch.full((), float("-inf"), dtype=w.dtype)).amax(-1)
    return wmin, wmax


def params_from_range(wmin: torch.Tensor, wmax: torch.Tensor, symmetric: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float32, zero float32 holding integers 0..15) from a per-group range.

    The range is widened to contain 0 (as GPTQ's quantizer does): with an integer zero point in
    [0, 15], a group entirely above or below 0 could not be represented otherwise. Symmetric: the
    range is [-max|w|, max|w|] and the zero point 8."""
    if symmetric:
        amax = torch.maximum(wmin.abs(), wmax.abs()).to(torch.float32)
        scale = (2 * amax).clamp(min=1e-5) / MAXQ
        return scale, torch.full_like(scale, float(SYMMETRIC_ZERO))
    wmin = torch.clamp(wmin, max=0)
    wmax = torch.clamp(wmax, min=0)
    scale = ((wmax - wmin).clamp(min=1e-5) / MAXQ).to(torch.float32)
    zero = torch.clamp(torch.round(-wmin.to(torch.float32) / scale), 0, MAXQ)
    return scale, zero


def search_range(w: torch.Tensor, symmetric: bool = False, grid: int = 100, max_shrink: float = 0.8,
                 norm: float = 2.4) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [rows] of one group's weights w [rows, n]: the range [p min, p max] for p = 1 - i / grid,
    i < max_shrink * grid, with the least sum |Q(w) - w|^norm per row (GPTQ's `mse` quantizer; the
    widening to 0 and the zero point as in params_from_range)."""
    wmin, wmax = w.amin(1), w.amax(1)
    best = torch.full((w.shape[0],), float("inf"), dtype=torch.float64)
    scale, zero = params_from_range(wmin, wmax, symmetric)
    for i in range(max(1, int(max_shrink * grid))):
        p = 1 - i / grid
        s1, z1 = params_from_range(p * wmin, p * wmax, symmetric)
        s64, z64 = s1.to(w.dtype).unsqueeze(1), z1.to(w.dtype).unsqueeze(1)
        err = (dequantize_codes(quantize_codes(w, s64, z64), s64, z64) - w).abs().pow(norm).sum(1).to(torch.float64)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s1, scale)
        zero = torch.where(better, z1, zero)
    return scale, zero


def group_params(w: torch.Tensor, group_size: int, max_val: torch.Tensor | None = None, symmetric: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point [out, G] of each group; `max_val` [out, G] clips the range to +-max_val."""
    wmin, wmax = group_minmax(w, group_size)
    if max_val is not None:
        wmin = torch.maximum(wmin, -max_val)
        wmax = torch.minimum(wmax, max_val)
    return params_from_range(wmin, wmax, symmetric)


def expand(t: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor:
    """[out, G] per-group values -> [out, in] per column."""
    return t[:, group_index(in_features, group_size)]


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes (float tensor of integers 0..15) for w with broadcastable scale/zero."""
    return torch.clamp(torch.round(w / scale) + zero, 0, MAXQ)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes - zero) * scale


def fake_quantize(w: torch.Tensor, group_size: int, max_val: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize of W [out, in] (float32 result)."""
    w = w.to(torch.float32)
    scale, zero = group_params(w, group_size, max_val)
    s, z = expand(scale, w.shape[1], group_size), expand(zero, w.shape[1], group_size)
    return dequantize_codes(quantize_codes(w, s, z), s, z)


@dataclass
class Int4Weight:
    """One Linear weight in INT4: what lowering writes and what the torch model holds dequantized."""

    codes: np.ndarray  # uint8 [out, in], values 0..15 (unpacked)
    scales: np.ndarray  # float32 [out, G]
    zeros: np.ndarray  # uint8 [out, G], values 0..15
    group_size: int
    symmetric: bool = False  # every zero point is 8 (codes - 8: signed int4)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> torch.Tensor:
        cols, gs = self.codes.shape[1], self.group_size
        s = expand(torch.from_numpy(self.scales), cols, gs)
        z = expand(torch.from_numpy(self.zeros).to(torch.float32), cols, gs)
        return dequantize_codes(torch.from_numpy(self.codes).to(torch.float32), s, z)


class StreamedInt4(Int4Weight):
    """Round-to-nearest INT4 of a weight that is not in memory (compiler/streamed.py): codes, scales and
    zero points are Deferreds of one quantization of `source`, run when the artifact is written."""

    def __init__(self, name: str, source: Deferred, group_size: int, symmetric: bool = False) -> None:
        n, k = source.shape
        g = num_groups(k, group_size)
        self.key = ("rtn", name, group_size, symmetric)

        def run() -> Int4Weight:
            return quantize_rtn(as_torch(source.compute()), group_size, symmetric=symmetric)

        def part(field: str) -> Callable[[], np.ndarray]:
            return lambda: getattr(cached(self.key, run), field)

        self._run: Callable[[], Int4Weight] | None = run
        group = self.key
        super().__init__(codes=Deferred((n, k), np.uint8, part("codes"), group=group),  # type: ignore[arg-type]
                         scales=Deferred((n, g), np.float32, part("scales"), group=group),  # type: ignore[arg-type]
                         zeros=Deferred((n, g), np.uint8, part("zeros"), group=group),  # type: ignore[arg-type]
                         group_size=group_size, symmetric=symmetric)

    def computed(self) -> Int4Weight:
        return Int4Weight(self.codes.compute(), self.scales.compute(), self.zeros.compute(),  # type: ignore[attr-defined]
                          self.group_size, self.symmetric)

    def computed_once(self) -> Int4Weight:
        """computed(), without caching the unpacked codes where this weight is quantized on the spot (its packed
        form is what is cached and written)."""
        return self._run() if self._run is not None else self.computed()

    def dequantize(self) -> torch.Tensor:
        raise TypeError("a streamed INT4 weight is computed when the artifact is written, not dequantized")


class SpilledInt4(StreamedInt4):
    """An INT4 weight computed during the build (GPTQ of one streamed decoder layer) and kept on disk, not in
    memory: codes, scales and zero points are written to the build's spill folder (compiler/streamed.py
    `spill`) and read back when the artifact is written."""

    def __init__(self, name: str, q: Int4Weight) -> None:
        self.key = ("spilled", name, q.group_size, q.symmetric)
        self._run = None
        Int4Weight.__init__(self, codes=spill(q.codes), scales=spill(q.scales),  # type: ignore[arg-type]
                            zeros=spill(q.zeros), group_size=q.group_size, symmetric=q.symmetric)


def quantize_rtn(w: torch.Tensor, group_size: int, max_val: torch.Tensor | None = None, symmetric: bool = False
                 ) -> Int4Weight:
    """Round-to-nearest INT4 of W [out, in] (optionally with per-group clipping). Without clipping, a finite
    float32 weight on the CPU goes through the C loop (compiler/quant/_int4.c: one pass per group, the same
    bits as quantize_rtn_reference, its twin); the rest through the reference."""
    w = w.detach().to(torch.float32)
    if max_val is None and _int4 is not None and w.device.type == "cpu" and w.ndim == 2:
        x = w.contiguous().numpy()
        out, cols = x.shape
        g = num_groups(cols, group_size)
        codes = np.empty((out, cols), np.uint8)
        scales = np.empty((out, g), np.float32)
        zeros = np.empty((out, g), np.uint8)
        if _int4.rtn_int4(x, group_size, symmetric, codes, scales, zeros):
            return Int4Weight(codes, scales, zeros, group_size, symmetric)
    return quantize_rtn_reference(w, group_size, max_val, symmetric)


def quantize_rtn_reference(w: torch.Tensor, group_size: int, max_val: torch.Tensor | None = None,
                           symmetric: bool = False) -> Int4Weight:
    """quantize_rtn in torch: the definition (and the C loop's twin), and the path for clipping and non-finite
    weights."""
    w = w.detach().to(torch.float32)
    scale, zero = group_params(w, group_size, max_val, symmetric)
    out, cols = w.shape
    if cols % group_size == 0:  # whole groups: quantize_codes' arithmetic in place, per-group values broadcast
        q = w.reshape(out, cols // group_size, group_size) / scale.unsqueeze(-1)
        q.round_().add_(zero.unsqueeze(-1)).clamp_(0, MAXQ)
        return from_codes(q.reshape(out, cols), scale, zero, group_size, symmetric)
    codes = quantize_codes(w, expand(scale, cols, group_size), expand(zero, cols, group_size))
    return from_codes(codes, scale, zero, group_size, symmetric)


def from_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
               symmetric: bool = False) -> Int4Weight:
    return Int4Weight(
        codes=codes.to(torch.uint8).numpy(),
        scales=scale.to(torch.float32).contiguous().numpy(),
        zeros=zero.to(torch.uint8).contiguous().numpy(),
        group_size=group_size,
        symmetric=symmetric,
    )


# ------------------------------------------------------------------------------ packing


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pairs of 4-bit values along the last axis -> bytes (first value in the low nibble)."""
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    packed = codes[..., 0::2] & 0x0F  # (x & 0x0F) << 4 is x << 4 in uint8: the high bits fall off
    return np.bitwise_or(packed, np.left_shift(codes[..., 1::2], 4, dtype=np.uint8), out=packed)


def pack_matmulnbits(q: Int4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B uint8 [N, k_blocks, block_size/2], scales float32 [N * k_blocks], zero_points uint8
    [N * ceil(k_blocks / 2)]) as com.microsoft.MatMulNBits (bits=4) reads them.

    The padding columns of the last block hold the zero point, so they dequantize to 0.
    """
    n, k = q.shape
    bs = q.group_size
    kb = num_groups(k, bs)
    if isinstance(q, StreamedInt4):
        key = ("nbits", *q.key)
        src = q

        def part(i: int) -> Callable[[], np.ndarray]:
            return lambda: cached(key, lambda: pack_matmulnbits(src.computed_once()))[i]

        return (Deferred((n, kb, bs // 2), np.uint8, part(0), group=key),  # type: ignore[return-value]
                Deferred((n * kb,), np.float32, part(1), group=key),
                Deferred((n * ((kb + 1) // 2),), np.uint8, part(2), group=key))
    scales = np.ascontiguousarray(q.scales.reshape(-1))
    if _int4 is not None and bs % 2 == 0:  # the C loop (compiler/quant/_int4.c), the reference's bits
        codes, zeros = np.ascontiguousarray(q.codes, np.uint8), np.ascontiguousarray(q.zeros, np.uint8)
        b = np.empty((n, kb * (bs // 2)), np.uint8)
        zp = np.empty((n, (kb + 1) // 2), np.uint8)
        _int4.pack_nbits(codes, zeros, bs, b, zp)
        return b.reshape(n, kb, bs // 2), scales, zp.reshape(-1)
    return pack_matmulnbits_reference(q)


def pack_matmulnbits_reference(q: Int4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pack_matmulnbits in numpy (the C loop's twin) for an Int4Weight in memory."""
    n, k = q.shape
    bs = q.group_size
    kb = num_groups(k, bs)
    padded = np.repeat(q.zeros, bs, axis=1)  # zero point everywhere, then the real codes
    padded[:, :k] = q.codes
    b = pack_nibbles(padded).reshape(n, kb, bs // 2)
    zp = pack_nibbles(q.zeros).reshape(-1)
    return np.ascontiguousarray(b), np.ascontiguousarray(q.scales.reshape(-1)), np.ascontiguousarray(zp)
