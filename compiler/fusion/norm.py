"""RMSNorm -> SimplifiedLayerNormalization, residual Add + RMSNorm -> SkipSimplifiedLayerNormalization.

Both use onnxscript's ONNX Runtime fusions (`onnxscript.rewriter.ort_fusions`), applied on an
`onnx_ir` model as `fuse_xformers` does:

- `rms_norm`: `rms_normalization.fuse_rms_normalization` as is. Our lowered RMSNorm is
  Pow(x, 2) -> ReduceMean([-1]) -> Add(eps) -> Sqrt -> Reciprocal -> Mul(x, .) -> Mul(weight, .),
  which its rule matches; it emits SimplifiedLayerNormalization (ONNX Runtime registers that op in
  the default domain, version 1), axis -1, stash_type float.
- `skip_rms_norm`: onnxscript's `skip_normalization.SkipRmsNormFusion` pattern (Add(input, skip)
  -> SimplifiedLayerNormalization, the sum also used elsewhere -> com.microsoft
  SkipSimplifiedLayerNormalization with the sum as output 3). Its `check` requires rank-3
  [B, S, D] activations; our model packs tokens without padding, so the residual stream is rank 2
  [T, D]: `PackedSkipRmsNormFusion` keeps the pattern and rewrite and only widens the shape check
  to [T, D] (ONNX Runtime's kernel takes any rank >= 2: it normalises the last axis). The plain
  library rule (rank 3) is tried as well.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
from onnxscript.rewriter.ort_fusions.skip_normalization import SkipRmsNormFusion, fuse_skip_rms_normalization


class PackedSkipRmsNormFusion(SkipRmsNormFusion):
    """onnxscript's SkipRmsNorm rule (no bias) with the shape check widened to packed [T, D] tokens."""

    def check(self, op: Any, input: ir.Value, skip: ir.Value, gamma: ir.Value, bias: ir.Value,  # noqa: A002
              simplified_layer_norm: ir.Value, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        shapes = [v.shape for v in (input, skip, gamma)]
        if any(s is None for s in shapes):
            return result.fail("input, skip or gamma has no known shape")
        s_in, s_skip, s_gamma = shapes
        if len(s_in) != 2 or len(s_skip) != 2 or len(s_gamma) != 1:
            return result.fail(f"ranks {len(s_in)}, {len(s_skip)}, {len(s_gamma)} are not [T, D], [T, D], [D]")
        d = s_gamma[0]
        if not isinstance(d, int) or s_in[1] != d or s_skip[1] != d:
            return result.fail(f"last dims {s_in[1]}, {s_skip[1]} differ from gamma's {d}")
        node = simplified_layer_norm.producer()
        if node.attributes.get_int("stash_type", 1) != 1:
            return result.fail("stash_type is not float")
        if node.attributes.get_int("axis", -1) not in (-1, 1):
            return result.fail("normalises an axis other than the last")
        return result


_packed_skip_rules = pattern.RewriteRuleSet([PackedSkipRmsNormFusion.rule("SkipRmsNormPacked", has_bias=False)])


def fuse_rms(model: ir.Model) -> int:
    return int(fuse_rms_normalization(model))


def fuse_skip_rms(model: ir.Model) -> int:
    """Library rule (rank 3) first, then the packed-token variant (rank 2)."""
    return int(fuse_skip_rms_normalization(model)) + int(_packed_skip_rules.apply_to_model(model))
