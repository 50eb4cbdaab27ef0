"""KV-cache quantization: INT8 or FP8 E4M3 pools with one scale per (layer, KV head) from calibration.

The scales are the absolute maximum of each head's keys (after RoPE and any q/k norm: what the
pool stores) and values over the calibration tokens, / 127 (int8, symmetric) or / 448 (E4M3),
measured with the weights as quantized by any earlier pass. lower_quant writes the pool reads
(dequantize per head after the row gather) and the new K/V outputs (QuantizeLinear per head) into
the graph; the runtime allocates its pools in the stored type (runtime.json kv_cache.dtype).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from compiler.passes.base import BuildContext, QuantizePass
from runtime.ort_releases import FP8_KV_CACHE, missing

log = logging.getLogger(__name__)

E4M3_MAX = 448.0  # compiler.quant.fp8.E4M3_MAX (not imported here: that module needs torch)
DTYPES = {"int8": ("int8", 127.0), "fp8": ("float8_e4m3fn", E4M3_MAX)}


@dataclass(frozen=True)
class KvCacheOptions:
    dtype: Literal["int8", "fp8"] = "int8"


class QuantizeKvCachePass(QuantizePass):
    """KV cache in INT8 or FP8 E4M3 with per-head scales from calibration."""

    name: ClassVar[str] = "quantize_kv_cache"
    Config = KvCacheOptions
    summary = "KV cache INT8 / FP8 E4M3, per-head scales from calibration"
    quant_kind = "kv_cache"

    def kv_bytes_per_element(self) -> int:
        return 1

    def check_environment(self, recipe: Any) -> str | None:
        if self.config.dtype != "fp8" or recipe.target.backend != "onnxruntime":
            return None
        return missing(FP8_KV_CACHE)

    def needs_calibration(self) -> bool:
        return True

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        import torch

        from compiler.quant.calibration import LayerRunner, load_calibration
        from compiler.quant.fp8 import MIN_SCALE
        from compiler.quant.state import KvCacheQuant, start_quantize

        q = start_quantize(ctx, self.name, weights=False)
        dtype, qmax = DTYPES[self.config.dtype]
        cal = load_calibration(ctx, self.name)
        runner = LayerRunner(q.model, cal.samples)
        cfg = q.model.cfg
        k_amax = np.zeros((cfg.num_layers, cfg.num_kv_heads), np.float32)
        v_amax = np.zeros_like(k_amax)
        with torch.no_grad():
            for i, layer, _ in q.layers("kv-cache calibration", read=False):  # the cache's build never streams
                for b, x in enumerate(runner.hidden):
                    k, v = runner.attention_kv(layer, q.model.attention_input(layer, x), b)  # [T, kvh, d]
                    k_amax[i] = np.maximum(k_amax[i], k.abs().amax(dim=(0, 2)).numpy())
                    v_amax[i] = np.maximum(v_amax[i], v.abs().amax(dim=(0, 2)).numpy())
                runner.advance(i)
        k_scales = np.maximum(k_amax / qmax, MIN_SCALE).astype(np.float32)
        v_scales = np.maximum(v_amax / qmax, MIN_SCALE).astype(np.float32)
        q.st.kv_cache = KvCacheQuant(dtype, k_scales, v_scales)  # type: ignore[arg-type]
        return {
            "dtype": dtype, "granularity": "per layer and KV head", "symmetric": True,
            "weights_quantized_by": q.st.weight_method, "calibration": cal.record,
            "k_scales": [[float(f"{s:.6g}") for s in row] for row in k_scales],
            "v_scales": [[float(f"{s:.6g}") for s in row] for row in v_scales],
        }
