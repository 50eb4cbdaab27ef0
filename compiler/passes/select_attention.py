"""Attention-variant selection: choose the attention implementation the model is captured with.

Runs before `capture`. The candidates (compiler/attention/) are checked for the model's attention
kind (MHA/GQA/MQA, sliding window, q/k norm) and the target; among the valid ones the pass picks:

- `kernel: <variant>` (forced): that variant, or a build error naming why it is invalid;
- `kernel: auto` with autotune (default): each valid candidate is measured on this machine
  (compiler/attention/autotune.py: a one-layer model with the real dimensions, decode at batch 1/8/32
  with a 1k context and a 512-token prefill, through the runtime's backend) and the fastest total
  wins; a candidate whose logits differ from the decomposed path's is invalid;
- `kernel: auto` without autotune (`autotune: false`, or the build driver's `no_autotune`), or for a
  target the autotuner cannot time here (it measures through ONNX Runtime on CPU; `TIMED_TARGETS`):
  the fixed rule table `RULES`, so the build is deterministic (a variant in `RULE_NEEDS` is taken only
  where its package is installed on the build machine: FlashInfer for torch/cuda).

The choice goes to ctx.artifacts["attention"] (read by capture and lower_onnx) and the kernel facts
to ctx.artifacts["attention_kernel"]; the stats (manifest) hold the attention kind, every candidate
with valid/invalid and why, the choice and the reason, and, when the candidates were timed, the CPU code
path of the package's C ops they ran on (`measured_on`: isa, per-op paths, CPU features); timings go to
ctx.build_info["attention_autotune"].
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from compiler.attention import KERNELS, Candidate, attention_kind, candidates
from compiler.attention.autotune import autotune
from compiler.passes.base import BuildContext, BuildError, Pass
from compiler.passes.quantize_kv_cache import KvCacheOptions

log = logging.getLogger(__name__)

# Autotune off: the first valid variant of the target's list. On CPU the C kernel (paged_cpu) reads the
# pools in place and scores no token against another sequence's. The autotuner's one-layer model, on a
# quiet 2-core machine, scored (ms per request) 22.9 against 25.6 (decomposed) and 28.2
# (GroupQueryAttention, which also copies the gathered past into its present output) on the demo, and
# 141 against 154 and 160 on llama-110m's dimensions; on the same machine loaded by other processes 114
# against 180 and 258 (demo). It is valid only where the package built its library; then the
# decomposed path (what a build without this pass gets). On CUDA the paged kernels read the pool in place (the decomposed path
# gathers every token's whole padded past: [T, kv_heads, max_blocks * block_size, head_dim] per layer).
RULES: dict[tuple[str, str], tuple[str, ...]] = {
    ("onnxruntime", "cpu"): ("paged_cpu", "decomposed", "gqa"),
    ("onnxruntime", "cuda"): ("paged_attention", "gqa", "decomposed"),
    ("torch", "cuda"): ("flashinfer", "triton", "decomposed"),
}

# Variants the rule table takes only where their package is installed on the build machine (the machine
# that builds a GPU target is normally the image that serves it); `kernel: <variant>` forces them anyway.
RULE_NEEDS = {"flashinfer": "flashinfer"}

# Targets whose candidates the autotuner can time on the build machine: it runs them through the ONNX
# Runtime CPU backend. Elsewhere `kernel: auto` takes the rule table.
TIMED_TARGETS = {("onnxruntime", "cpu")}


@dataclass(frozen=True)
class SelectAttentionOptions:
    kernel: Literal["auto", "decomposed", "gqa", "paged_cpu", "paged_attention", "triton", "flashinfer"] = "auto"
    autotune: bool = True  # measure the valid candidates (kernel: auto); false: the rule table


class SelectAttentionPass(Pass):
    """Choose the attention variant (decomposed / GroupQueryAttention / PagedAttention) for the target."""

    name: ClassVar[str] = "select_attention"
    Config = SelectAttentionOptions
    summary = "choose the attention implementation: forced, rule table, or measured on this machine"

    def check_recipe(self, recipe: Any) -> tuple[str, str] | None:
        names = [spec.name for spec in recipe.passes]
        if "capture" in names and names.index("capture") < names.index(self.name):
            return ("name", "select_attention must come before capture (capture builds the chosen variant)")
        return None

    def run(self, ctx: BuildContext) -> dict[str, Any]:
        if "capture" in ctx.completed:
            raise BuildError("select_attention must come before capture (capture builds the chosen variant)")
        cfg = ctx.checkpoint.config
        t = ctx.recipe.target
        names = [p.name for p in ctx.recipe.passes]
        kv = next((KvCacheOptions(**p.options).dtype for p in ctx.recipe.passes if p.name == "quantize_kv_cache"), None)
        cands = candidates(cfg, t.backend, t.device, t.dtype, names, kv_cache_dtype=kv)
        valid = [c.variant for c in cands if c.valid]
        kernel = self.config.kernel
        autotune_on = self.config.autotune and not ctx.artifacts.get("no_autotune")
        stats: dict[str, Any] = {
            "attention_kind": attention_kind(cfg),
            "target": f"{t.backend}/{t.device}/{t.dtype}",
            "kernel": kernel,
            "autotune": bool(autotune_on and kernel == "auto" and len(valid) > 1
                             and (t.backend, t.device) in TIMED_TARGETS),
        }
        if kernel != "auto":
            cand = next(c for c in cands if c.variant == kernel)
            if not cand.valid:
                raise BuildError(f"select_attention: kernel {kernel!r} cannot run this model on "
                                 f"{stats['target']}: {cand.reason}")
            choice, why = kernel, "forced"
        elif not valid:
            raise BuildError("select_attention: no attention variant is valid: "
                             + "; ".join(f"{c.variant}: {c.reason}" for c in cands))
        elif stats["autotune"]:
            choice, why = self._autotune(ctx, valid, cands)
            measured = ctx.build_info["attention_autotune"].get("cpu_paths")
            if measured:  # the runtime warns when it serves on another code path (runtime/cpu_check.py)
                stats["measured_on"] = {k: measured[k] for k in ("isa", "ops", "cpu_features")}
        else:
            order = RULES.get((t.backend, t.device), ("decomposed",))
            absent = [v for v in order if v in valid and v in RULE_NEEDS
                      and importlib.util.find_spec(RULE_NEEDS[v]) is None]
            choice = next((v for v in order if v in valid and v not in absent), valid[0])
            why = "rule"
            stats["rule"] = f"{t.backend}/{t.device}: first valid of {', '.join(order)}" + "".join(
                f"; {v} skipped: its package ({RULE_NEEDS[v]}) is not installed here" for v in absent)
        stats["candidates"] = [c.record() for c in cands]
        stats["choice"] = choice
        stats["reason"] = why
        stats["implementation"] = KERNELS[choice]["implementation"]
        ctx.artifacts["attention"] = {"variant": choice, "reason": why}
        ctx.artifacts["attention_kernel"] = {**KERNELS[choice], "variant": choice, "selected_by": why}
        log.info("attention: %s (%s)", choice, why)
        return stats

    def _autotune(self, ctx: BuildContext, valid: list[str], cands: list[Any]) -> tuple[str, str]:
        rt = ctx.recipe.runtime
        cfg = ctx.checkpoint.config
        order = ["decomposed"] + [v for v in valid if v != "decomposed"]  # the reference for the numeric check
        result = autotune(cfg, rt.kv_block_size, ctx.max_model_len, order)
        ctx.build_info["attention_autotune"] = result
        for i, c in enumerate(cands):
            r = result["results"].get(c.variant)
            if r is not None and not r["valid"]:
                cands[i] = Candidate(c.variant, False, r["reason"])
        if result["fastest"] is None:
            raise BuildError("select_attention: no candidate passed the numeric check")
        return result["fastest"], "autotune"
