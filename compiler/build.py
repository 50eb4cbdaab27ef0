"""The build driver: recipe -> plan -> passes -> quality gate -> artifact (manifest last).

`plan()` checks the recipe, the checkpoint and the architecture without reading a weight (the
dry run). `build()` runs the recipe's passes in order into a staging folder, evaluates the
result against the recipe's quality bounds, writes manifest.json (deterministic) and build.json
(timings, host), and only then moves the folder to `<output>/<name>/<version>`. A failed build
leaves no artifact behind. A recipe with quality bounds whose gate cannot run on the build machine
(an onnxruntime/cuda or tensorrt target without a GPU) fails before any pass, naming what is
missing, unless it sets `quality.allow_unevaluated: true`; the manifest then records the gate as not
evaluated, with the reason.

A recipe with a `speculative:` section first builds its draft model (a checkpoint folder, or a
truncated-layer copy of the source written to a temporary folder: compiler/draft.py) with the same
target, passes and runtime settings and no quality gate, into `<output>/<name>-draft/<version>`; the
target's manifest records it under `speculative.draft` (name, version, path relative to the target,
manifest sha256), after checking the two share the tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from compiler.attention import KERNELS
from compiler.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    inspect_checkpoint,
    load_weights,
    source_sha256,
)
from compiler.disk import check_disk
from compiler.draft import truncate_checkpoint
from compiler.memory import (
    RssSampler,
    check_memory,
    estimate_pass_peaks,
    release_torch_model,
    return_freed_memory,
    status_kb,
    streaming_reason,
    trim_heap,
)
from compiler.passes import PASSES, BuildContext, BuildError, Pass, pass_options
from compiler.quant.common import module_of
from compiler.recipe import Recipe, RecipeError, load_recipe
from compiler.streamed import reset as reset_streamed
from compiler.streamed import use_spill_folder
from compiler.targets import supported, target_for
from runtime.artifact import (
    Artifact,
    ArtifactError,
    check_version_unused,
    read_manifest,
    sha256_file,
    write_build_info,
    write_manifest,
)
from runtime.backends import load_backend
from runtime.draft import check_pairing
from runtime.evaluate import PerplexityResult, chunk_tokens, paired_delta, perplexity
from runtime.forward_batch import ForwardBatch
from runtime.gpu import missing_for
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TOOL_VERSION = "0.1.0"
# The attention kernel of a build without a select_attention pass (the model definition's default).
ATTENTION_KERNEL = {**KERNELS["decomposed"], "variant": "decomposed", "selected_by": "default (no select_attention pass)"}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Plan:
    recipe: Recipe
    checkpoint: CheckpointInfo
    passes: list[Pass]
    estimates: dict[str, int] = field(default_factory=dict)
    pass_peaks: dict[str, int] = field(default_factory=dict)  # estimated peak RSS per pass (compiler/memory.py)
    # whether the weights stream (compiler/streamed.py) and, when they do not, why the whole model is loaded
    streamed: bool = False
    loads_model_because: str | None = None


def _estimates(recipe: Recipe, info: CheckpointInfo, passes: list[Pass] | None = None,
               streamed: bool = False) -> dict[str, int]:
    cfg = info.config
    rt = recipe.runtime
    nbytes = _DTYPE_BYTES[recipe.target.dtype]
    weights = info.num_parameters * nbytes
    sizers = [ps for ps in passes or [] if hasattr(ps, "estimated_bytes")]
    bf16 = recipe.target.matmul == "bfloat16"
    if sizers or bf16:  # quantized weights: what the quantize pass stores for each tensor
        weights = 0
        for name, (_dtype, shape) in info.tensors.items():
            module, kind = module_of(name, shape)
            stored = next((b for ps in sizers if (b := ps.estimated_bytes(module, shape, kind)) is not None), None)
            if stored is None and bf16 and kind == "linear":  # float weight matrices: bfloat16 products
                stored = math.prod(shape) * 2
            weights += stored if stored is not None else math.prod(shape) * nbytes
    kv_elem = next((ps.kv_bytes_per_element() for ps in passes or [] if hasattr(ps, "kv_bytes_per_element")), nbytes)
    kv = 2 * cfg.num_layers * rt.num_kv_blocks * rt.kv_block_size * cfg.num_kv_heads * cfg.head_dim * kv_elem
    # Peak activations of one step at the scheduler's limits: the per-token gather of past K/V and
    # the attention scores of one layer dominate (see docs/architecture.md, "Attention").
    t = rt.max_num_batched_tokens
    lp = rt.max_model_len
    gather = 2 * t * lp * cfg.num_kv_heads * cfg.head_dim * nbytes
    scores = 2 * t * cfg.num_heads * (lp + t) * 4
    mlp = t * (cfg.hidden_size * 4 + cfg.intermediate_size * 3) * nbytes
    logits = rt.max_num_seqs * cfg.vocab_size * 4
    activations = gather + scores + mlp + logits
    return {
        "parameters": info.num_parameters,
        "artifact_bytes": weights,
        "runtime_weights_bytes": weights,
        "runtime_kv_cache_bytes": kv,
        "runtime_activation_bytes": activations,
        "runtime_total_bytes": weights + kv + activations,
        # the largest of the passes' estimates (compiler/memory.py)
        "build_peak_bytes": max(estimate_pass_peaks(recipe, info, passes or [], streamed).values(), default=0),
    }


def plan(recipe_path: str | Path) -> Plan:
    """Check recipe + checkpoint + pass order without loading weights; RecipeError on any problem."""
    recipe = load_recipe(recipe_path, pass_options())
    try:
        info = inspect_checkpoint(recipe.checkpoint, recipe.runtime.max_model_len)
    except CheckpointError as e:
        raise recipe.error("source.checkpoint", str(e)) from e
    t = recipe.target
    target = target_for(t.backend, t.device)
    if target is None:
        raise recipe.error("target.backend", f"target {t.backend}/{t.device} cannot be built by this version; "
                           f"supported: {supported()}")
    if t.dtype not in target.dtypes:
        raise recipe.error("target.dtype", f"dtype {t.dtype} is not supported for {t.backend}/{t.device}; "
                           f"use {' or '.join(target.dtypes)}")
    names = [spec.name for spec in recipe.passes]
    if t.matmul not in (None, t.dtype):
        if (t.backend, t.device, t.dtype, t.matmul) != ("onnxruntime", "cpu", "float32", "bfloat16"):
            raise recipe.error("target.matmul", f"matmul {t.matmul} applies to onnxruntime/cpu with dtype float32 "
                               "(bfloat16 weight products); elsewhere the dtype sets the products' precision")
        if "fuse" not in names:
            raise recipe.error("target.matmul", "matmul bfloat16 is written by the fuse pass: add 'fuse' after "
                               "lower_onnx")
    if target.passes is not None:  # the torch targets: the artifact is the captured program
        for i, name in enumerate(names):
            if name not in target.passes:
                raise recipe.error(f"passes[{i}].name", f"pass {name!r} does not apply to the {t.backend} target "
                                   f"(its artifact is the torch.export program); passes for it: "
                                   f"{', '.join(target.passes)}")
    elif "lower_onnx" not in names:
        raise recipe.error("passes", f"target {t.backend}/{t.device} needs 'lower_onnx' in the pass list")
    passes: list[Pass] = []
    seen: set[str] = set()
    for i, spec in enumerate(recipe.passes):
        cls = PASSES[spec.name]
        missing = [r for r in cls.requires if r not in seen]
        if missing:
            raise recipe.error(f"passes[{i}].name", f"pass {spec.name!r} needs {', '.join(missing)} earlier in the list")
        if spec.name in seen:
            raise recipe.error(f"passes[{i}].name", f"pass {spec.name!r} is listed twice")
        seen.add(spec.name)
        passes.append(cls(cls.Config(**spec.options)))
    if "package" not in seen:
        raise recipe.error("passes", "the pass list must end with 'package' (nothing would be written)")
    _check_quantization_order(recipe)
    streamed, because = _weights_mode(recipe, info, passes)
    for i, ps in enumerate(passes):
        problem = ps.check_recipe(recipe)
        if problem is not None:
            raise recipe.error(f"passes[{i}].{problem[0]}", problem[1])
        needs = getattr(ps, "needs_calibration", None)
        if needs is not None and needs() and recipe.calibration is None:
            raise recipe.error(f"passes[{i}].name", f"pass {ps.name!r} needs calibration data: add a 'calibration:' "
                               "section (data: a local .txt or .jsonl file; num_samples, seq_len, seed)")
    return Plan(recipe, info, passes, _estimates(recipe, info, passes, streamed),
                estimate_pass_peaks(recipe, info, passes, streamed), streamed, because)


def _weights_mode(recipe: Recipe, info: CheckpointInfo, passes: list[Pass]) -> tuple[bool, str | None]:
    """(streamed, why not) from capture's `weights` option and what the recipe allows (streaming_reason)."""
    i, capture = next(((i, ps) for i, ps in enumerate(passes) if ps.name == "capture"), (-1, None))
    mode = getattr(capture.config, "weights", "load") if capture is not None else "load"
    if mode == "load":
        return False, "capture's weights: load"
    reason = streaming_reason(recipe, info, passes)
    if reason is not None and mode == "stream":
        raise recipe.error(f"passes[{i}].options.weights", f"weights: stream does not apply to this recipe: {reason}")
    return reason is None, reason


def _check_quantization_order(recipe: Recipe) -> None:
    """Quantize passes change the weights lower_onnx lowers and need lower_quant after it to be stored
    quantized; one weight quantization method per recipe."""
    names = [spec.name for spec in recipe.passes]
    kinds: dict[str, str] = {}
    for i, name in enumerate(names):
        kind = getattr(PASSES[name], "quant_kind", None)
        if kind is None:
            continue
        if kind in kinds:
            raise recipe.error(f"passes[{i}].name", f"pass {name!r} quantizes the {kind.replace('_', ' ')} "
                               f"that {kinds[kind]!r} already quantizes; use one of them")
        kinds[kind] = name
        if "lower_onnx" in names[:i]:
            raise recipe.error(f"passes[{i}].name", f"pass {name!r} must come before lower_onnx "
                               "(it changes the weights that are lowered)")
        lowering = "lower_quant_torch" if recipe.target.backend == "torch" else "lower_quant"
        if lowering not in names[i + 1:]:
            where = "" if lowering == "lower_quant_torch" else " (after lower_onnx)"
            raise recipe.error(f"passes[{i}].name", f"pass {name!r} needs {lowering!r} later in the list{where}, "
                               "or the artifact would hold float weights")


def _tool_versions() -> dict[str, str]:
    versions = {"optimize": TOOL_VERSION, "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for mod in ("torch", "onnx", "onnxruntime", "onnxscript", "transformers", "tokenizers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:  # pragma: no cover
            versions[mod] = "not installed"
    return versions


def _round(x: float, digits: int = 6) -> float:
    """Round to significant digits so the manifest does not carry last-bit noise."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


class QualityGateError(BuildError):
    """The built artifact missed a bound of the recipe; `table` holds measured vs. allowed."""

    def __init__(self, message: str, table: list[tuple[str, float, float, bool]]) -> None:
        super().__init__(message)
        self.table = table


# The gate's evaluation size when the recipe leaves quality.max_eval_tokens unset ("auto"): a pilot of
# PILOT_CHUNKS chunks (8,192 tokens), then as many chunks as make the standard error of the perplexity
# change at most bound / (TARGET_HALF_WIDTHS * z), i.e. the 95 % interval's half-width a quarter of the
# bound (Stein's two-stage rule: the pilot's sd sizes the sample), up to the whole eval text.
CHUNK_LEN = 256
PILOT_CHUNKS = 32
TARGET_HALF_WIDTHS = 4


def quality_gate(ctx: BuildContext) -> dict[str, Any]:
    """Evaluate the staged artifact on the recipe's held-out text; raise when a bound is missed.

    Perplexity of the artifact (through the runtime); against the unoptimised model definition
    (torch, fp32, before any quantize pass) on the same chunks: its perplexity, the change of
    perplexity with a standard error from the paired per-chunk differences and a 95 % interval
    (runtime.evaluate.paired_delta), the mean KL divergence of the next-token distributions, and
    greedy-token agreement over fixed prompts, decoded step by step through the runtime's KV cache
    along the unoptimised model's greedy continuation.

    The perplexity-change bound is decided on the interval (`decide_interval`): within when the
    whole interval is at or below the bound, exceeded when all of it is above, and otherwise not
    judged with the data given, which fails the build too (the artifact is not shown to meet it).
    The other bounds compare point values.
    """
    q = ctx.recipe.quality
    eval_data = ctx.recipe.as_dict().get("quality", {}).get("eval_data")
    if q.eval_data is None:  # (the schema requires eval_data for any bound)
        return {"evaluated": False, "eval_data": None, "bounds": {},
                "reason": "the recipe names no quality.eval_data and sets no bounds: nothing to gate"}
    device, why_not = _evaluation_device(ctx.recipe)
    if device is None:
        return _not_evaluated(ctx.recipe, eval_data, why_not)
    if device != ctx.recipe.target.device:
        log.info("quality gate on %s: %s", device, _missing_for_target(ctx.recipe))
    backend, tokenizer = _open_staged(ctx.staging, device)
    reference = _fp32_reference(ctx)
    if reference is None and (q.max_perplexity_increase_pct is not None or q.max_kl_divergence is not None
                              or q.min_token_agreement is not None):
        raise BuildError("quality gate: the recipe bounds a comparison with the unoptimised model, "
                         "but no pass produced it (capture)")
    ids = tokenizer.encode(Path(q.eval_data).read_text(encoding="utf-8"), add_special_tokens=False)
    compare = _Comparison(backend, reference)
    sizing = _score_eval_text(compare, ids, q.max_eval_tokens,
                              q.max_perplexity_increase_pct if reference is not None else None)
    result = compare.result(min(len(ids), compare.chunks * CHUNK_LEN))
    metrics: dict[str, Any] = {
        "eval_data": eval_data,
        "perplexity": _round(result.perplexity),
        "mean_nll": _round(result.mean_nll),
        "eval_tokens": result.chunks * CHUNK_LEN,
        "eval_chunks": result.chunks,
        "predictions": result.predictions,
        "eval_size": {k: _round(v) if isinstance(v, float) else v for k, v in sizing.items()},
    }
    bounds: dict[str, float] = {}
    table: list[tuple[str, float, float, bool]] = []
    notes: dict[str, str] = {}
    if q.max_perplexity is not None:
        bounds["max_perplexity"] = q.max_perplexity
        table.append(("perplexity", result.perplexity, q.max_perplexity, result.perplexity <= q.max_perplexity))
    if reference is not None:
        prompts = _agreement_prompts(q, tokenizer, ids)
        agreement, decode_kl = token_agreement(backend, reference, prompts, q.agreement_tokens)
        _judge_against_reference(q, compare, agreement, decode_kl, len(prompts), metrics, bounds, table, notes)
    passed = all(ok for *_, ok in table)
    out = {"evaluated": True, "device": device, "metrics": metrics, "bounds": bounds, "passed": passed}
    if not passed:
        rows = "\n".join(f"  {name:<24} measured {_fmt(m)}  allowed {_fmt(a)}  {'ok' if ok else 'FAILED'}"
                         + (f"  {notes[name]}" if name in notes else "")
                         for name, m, a, ok in table)
        raise QualityGateError(f"quality gate failed:\n{rows}", table)
    return out


def _not_evaluated(recipe: Recipe, eval_data: Any, why_not: str) -> dict[str, Any]:
    """The gate's record where no device here runs the artifact (bounds only with quality.allow_unevaluated)."""
    q = recipe.quality
    check_gate_can_run(recipe)  # (build() ran it before any pass): bounds need allow_unevaluated
    record = {"evaluated": False, "eval_data": eval_data, "bounds": q.bounds, "reason": why_not}
    if q.bounds:
        record["allowed_by"] = "quality.allow_unevaluated"
        log.warning("quality: not evaluated (%s); bounds not checked: %s", why_not,
                    ", ".join(f"{k} {v:g}" for k, v in q.bounds.items()))
    return record


def _open_staged(staging: Path, device: str) -> tuple[Any, Any]:
    """The staged artifact's backend on `device` (its KV pool as runtime.json sizes it) and its tokenizer:
    the runtime's own loading (files verified, runtime.json checked), without an engine around it."""
    artifact = Artifact.open(staging, verify=True)
    artifact.check_runtime(device=device)
    return load_backend(artifact, None, None, device), Tokenizer(artifact.tokenizer_dir)


def _score_eval_text(compare: _Comparison, ids: list[int], max_eval_tokens: int | None,
                     bound: float | None) -> dict[str, Any]:
    """Score the eval text's chunks: all of quality.max_eval_tokens, else a pilot and then as many chunks as
    the perplexity-change bound needs (eval_size); returns how the size was chosen."""
    chunks = chunk_tokens(ids, CHUNK_LEN, max_eval_tokens)
    if not chunks:
        raise BuildError(f"quality gate: the eval text has {len(ids)} tokens, fewer than one chunk of {CHUNK_LEN}")
    if max_eval_tokens is not None:
        compare.score(chunks)
        return {"rule": "recipe: quality.max_eval_tokens", "chunks": len(chunks)}
    compare.score(chunks[:PILOT_CHUNKS])
    n, sizing = eval_size(compare.delta() if compare.model is not None else None, bound, len(chunks))
    compare.score(chunks[PILOT_CHUNKS:n])
    return sizing


def _judge_against_reference(q: Any, compare: _Comparison, agreement: float, decode_kl: float, prompts: int,
                             metrics: dict[str, Any], bounds: dict[str, float],
                             table: list[tuple[str, float, float, bool]], notes: dict[str, str]) -> None:
    """The comparisons with the unoptimised model: their metrics, and a row of `table` per bound set."""
    ref = compare.reference_perplexity()
    delta = compare.delta()
    lo, hi = delta.ci_pct
    kl = compare.mean_kl()
    metrics.update({
        "reference_perplexity": _round(ref),
        "perplexity_increase_pct": _round(delta.pct, 4),
        "perplexity_increase_se_pct": _round(delta.se_pct, 4),
        "perplexity_increase_ci_pct": [_round(lo, 4), _round(hi, 4)],
        "perplexity_increase_z": round(delta.z, 4),
        "kl_divergence": _round(kl, 4),
        "token_agreement": _round(agreement, 6),
        "decode_kl_divergence": _round(decode_kl, 4),
        "agreement_prompts": prompts,
        "agreement_tokens": q.agreement_tokens,
    })
    bound = q.max_perplexity_increase_pct
    if bound is not None:
        bounds["max_perplexity_increase_pct"] = bound
        verdict = decide_interval(lo, hi, bound)
        metrics["perplexity_increase_verdict"] = verdict
        notes["perplexity increase %"] = (f"{delta.pct:+.4f} +- {delta.se_pct:.4f} (se), 95% interval "
                                          f"[{lo:+.4f}, {hi:+.4f}]: {VERDICTS[verdict]}")
        table.append(("perplexity increase %", delta.pct, bound, verdict == "within"))
    if q.max_kl_divergence is not None:
        bounds["max_kl_divergence"] = q.max_kl_divergence
        table.append(("KL divergence", kl, q.max_kl_divergence, kl <= q.max_kl_divergence))
    if q.min_token_agreement is not None:
        bounds["min_token_agreement"] = q.min_token_agreement
        table.append(("token agreement (min)", agreement, q.min_token_agreement,
                      agreement >= q.min_token_agreement))


VERDICTS = {
    "within": "the whole interval is within the bound",
    "exceeded": "the whole interval is above the bound",
    "undecided": "the interval contains the bound: it cannot be judged with the data given "
                 "(evaluate more tokens: quality.max_eval_tokens, or a longer eval text)",
}


def decide_interval(low: float, high: float, bound: float) -> str:
    """The gate's rule for an upper bound on a measured change with interval [low, high]: "within" when
    high <= bound (passes), "exceeded" when low > bound, else "undecided" (fails: not shown within)."""
    if high <= bound:
        return "within"
    if low > bound:
        return "exceeded"
    return "undecided"


def eval_size(pilot: Any, bound: float | None, available: int) -> tuple[int, dict[str, Any]]:
    """Chunks the gate evaluates when the recipe does not fix quality.max_eval_tokens.

    `pilot` is the PairedDelta of the first min(PILOT_CHUNKS, available) chunks (None without a
    reference). With a perplexity-change bound B > 0: the standard error aimed at is
    B / (TARGET_HALF_WIDTHS z) and the chunks needed (sd_pilot / target)^2, at least the pilot and at
    most `available`; when more are needed than the text has, the record says so (the gate then
    decides with the se it has). Without a bound: the pilot alone."""
    first = min(PILOT_CHUNKS, available)
    if pilot is None or bound is None:
        return first, {"rule": f"auto: {first} chunks (no perplexity-change bound to size against)",
                       "chunks": first, "available_chunks": available}
    record: dict[str, Any] = {"rule": f"auto: se of the change <= bound / ({TARGET_HALF_WIDTHS} z)",
                              "pilot_chunks": first, "available_chunks": available}
    sd_pct = pilot.se_pct * math.sqrt(pilot.chunks)
    if bound <= 0 or not math.isfinite(sd_pct):
        needed = available + 1 if bound <= 0 or first < 2 else first
    else:
        target = bound / (TARGET_HALF_WIDTHS * pilot.z)
        record.update(target_se_pct=target, pilot_sd_pct=sd_pct)
        needed = max(first, math.ceil((sd_pct / target) ** 2))
    n = min(available, needed)
    record.update(needed_chunks=needed, chunks=n)
    if needed > available:
        record["note"] = (f"the eval text has {available} chunks of {CHUNK_LEN}; the target se needs {needed}: "
                          "the bound is judged with a larger se")
        log.warning("quality gate: %s", record["note"])
    return n, record


def _missing_for_target(recipe: Recipe) -> str | None:
    """What this machine lacks to run the recipe's target (runtime.gpu.missing_for); None: nothing."""
    if recipe.target.device == "cpu":
        return None
    return missing_for(recipe.target.backend)


def _evaluation_device(recipe: Recipe) -> tuple[str | None, str]:
    """Where the gate runs the staged artifact: its own device when this machine has it; a torch/cuda
    artifact on CPU otherwise (the same program); (None, reason) when it cannot run here at all (the
    reason: what the machine lacks)."""
    problem = _missing_for_target(recipe)
    if problem is None:
        return recipe.target.device, ""
    if recipe.target.backend == "torch":
        return "cpu", ""
    return None, problem


def check_gate_can_run(recipe: Recipe) -> None:
    """BuildError (naming the recipe's quality field and what the machine lacks) when the recipe sets
    quality bounds that cannot be checked on this machine and does not say quality.allow_unevaluated:
    true. Called before any pass runs."""
    q = recipe.quality
    if not q.bounds or q.allow_unevaluated:
        return
    device, why_not = _evaluation_device(recipe)
    if device is None:
        bounds = ", ".join(f"{k} {v:g}" for k, v in q.bounds.items())
        raise BuildError(str(recipe.error("quality", (
            f"the quality gate cannot run on this machine, so its bounds ({bounds}) cannot be checked: {why_not}. "
            "Build on a machine that runs the target, or set quality.allow_unevaluated: true to build an "
            "artifact whose manifest records the gate as not evaluated"))))


def _fp32_reference(ctx: BuildContext) -> Any:
    """The unoptimised model definition in float32 (the gate's reference): capture's model when the target
    is float32, else a float32 copy loaded from the checkpoint."""
    reference = ctx.artifacts.get("reference_model", ctx.artifacts.get("model"))
    if reference is None or ctx.recipe.target.dtype == "float32":
        return reference
    import torch

    from compiler.models.llama import LlamaForwardBatchModel

    model = LlamaForwardBatchModel(ctx.checkpoint.config, ctx.recipe.runtime.kv_block_size)
    model.load_hf_state_dict(load_weights(ctx.checkpoint), torch.float32)
    return model.eval()


def _fmt(x: float) -> str:
    return f"{x:10.4f}" if abs(x) >= 0.01 or x == 0 else f"{x:10.6f}"


class _Comparison:
    """The artifact's perplexity (runtime.evaluate, through its backend) and, on the same batches, the
    unoptimised model's (torch) next-token NLL and KL(reference || artifact) at the scored positions,
    both kept per chunk for the paired difference.

    Chunks go in groups: the artifact scores a group (its logits kept), then torch scores it. Running
    the two alternately per chunk doubled the time (ONNX Runtime's spinning threads and torch's fight
    for the same cores)."""

    def __init__(self, backend: Any, model: Any | None, group: int = 8, chunk_len: int = CHUNK_LEN) -> None:
        self.backend = backend
        self.model = model
        self.block_size = backend.block_size
        self.num_blocks = backend.num_blocks
        self.group = group
        self.chunk_len = chunk_len
        self._batches: list[tuple[Any, Any]] = []
        self._chunk_nll: list[float] = []  # the artifact's mean NLL per chunk
        self._ref_chunk_nll: list[float] = []  # the reference's, same chunks
        self._kl = 0.0
        self._count = 0

    @property
    def chunks(self) -> int:
        return len(self._chunk_nll)

    def forward(self, fb: Any) -> Any:
        logits = self.backend.forward(fb)
        if self.model is not None:
            self._batches.append((fb, logits))
        return logits

    def score(self, chunks: list[list[int]]) -> None:
        """Score more chunks (each `chunk_len` tokens) with the artifact and the reference."""
        for c0 in range(0, len(chunks), self.group):
            part = [t for c in chunks[c0:c0 + self.group] for t in c]
            r = perplexity(self, part, self.chunk_len)
            self._chunk_nll += r.chunk_nll
            self._score_reference()

    def result(self, tokens: int) -> Any:
        """The artifact's perplexity over the chunks scored so far (`tokens`: of the text read)."""
        mean = sum(self._chunk_nll) / len(self._chunk_nll)  # chunks of equal length: the mean over tokens
        return PerplexityResult(math.exp(mean), mean, tokens, len(self._chunk_nll),
                                len(self._chunk_nll) * (self.chunk_len - 1), tuple(self._chunk_nll))

    def perplexity(self, ids: list[int], max_tokens: int | None) -> Any:
        """Score the chunks of the first `max_tokens` tokens of `ids` (None: all); the artifact's perplexity."""
        chunks = chunk_tokens(ids, self.chunk_len, max_tokens)
        if not chunks:
            raise BuildError(f"quality gate: the eval text has {len(ids)} tokens, fewer than one chunk of "
                             f"{self.chunk_len}")
        self.score(chunks)
        return self.result(min(len(ids), max_tokens or len(ids)))

    def _score_reference(self) -> None:
        import torch

        for fb, logits in self._batches:
            ref = _torch_forward(self.model, fb)
            lp_a = torch.log_softmax(torch.from_numpy(np.asarray(logits)).double(), -1)
            lp_r = torch.log_softmax(ref.double(), -1)
            ids = torch.from_numpy(fb.input_ids)
            if not np.array_equal(fb.logits_index, np.arange(len(fb.input_ids))):
                raise BuildError("quality gate: the comparison needs logits of every token")
            cu = fb.cu_seqlens.tolist()
            for b in range(len(cu) - 1):  # positions that predict a next token of the same sequence
                rows_t = torch.arange(cu[b], cu[b + 1] - 1, dtype=torch.int64)
                nll = -lp_r[rows_t].gather(1, ids[rows_t + 1, None])
                self._ref_chunk_nll.append(float(nll.mean()))
                self._kl += float((lp_r[rows_t].exp() * (lp_r[rows_t] - lp_a[rows_t])).sum())
                self._count += len(rows_t)
        self._batches.clear()

    def reference_perplexity(self) -> float:
        return math.exp(sum(self._ref_chunk_nll) / len(self._ref_chunk_nll))

    def delta(self) -> Any:
        """The paired perplexity change (runtime.evaluate.PairedDelta) over the chunks scored so far."""
        return paired_delta(self._chunk_nll, self._ref_chunk_nll)

    def mean_kl(self) -> float:
        return self._kl / self._count


def _torch_forward(model: Any, fb: Any) -> Any:
    """Logits of our model definition for a ForwardBatch without past tokens (fresh zero KV pools)."""
    import torch

    if int(fb.past_lens.max(initial=0)) != 0:
        raise BuildError("quality gate: the reference runs batches without past tokens only")
    cfg = model.cfg
    # no past: one zero block stands for the pool (the model reads the table only for past tokens)
    kv = [torch.zeros(1, model.block_size, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    table = torch.zeros(len(fb.cu_seqlens) - 1, 1, dtype=torch.int32)
    with torch.no_grad():
        out = model(torch.from_numpy(fb.input_ids), torch.from_numpy(fb.positions), torch.from_numpy(fb.cu_seqlens),
                    torch.from_numpy(fb.past_lens), table, torch.from_numpy(fb.logits_index), *kv)
    return out[0]


def _agreement_prompts(q: Any, tokenizer: Any, eval_ids: list[int], count: int = 8, length: int = 32
                       ) -> list[list[int]]:
    """The recipe's prompts (tokenized as the runtime does), else `count` windows of `length` tokens
    at evenly spaced offsets of the eval text."""
    if q.agreement_prompts:
        return [tokenizer.encode(p) for p in q.agreement_prompts]
    span = max(1, len(eval_ids) - length)
    return [eval_ids[i * span // count:i * span // count + length] for i in range(count)]


def token_agreement(backend: Any, model: Any, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """Greedy-token agreement with the unoptimised model, and the mean KL at those steps.

    The reference greedily continues each prompt by n tokens (torch, recomputing the whole sequence
    each step). The artifact prefills the prompts, then decodes one token per step through its KV
    cache, fed the reference's tokens (teacher forcing), so every step is compared on the same
    context; agreement = fraction of steps whose argmax equals the reference's token.
    """
    import torch

    b = len(prompts)
    bs = backend.block_size
    lens = [len(p) for p in prompts]
    per_seq = -(-(max(lens) + n) // bs)
    if b * per_seq > backend.num_blocks:
        raise BuildError(f"quality gate: {b} agreement prompts of up to {max(lens)} + {n} tokens need "
                         f"{b * per_seq} KV blocks; the artifact has {backend.num_blocks}")
    seqs = [list(p) for p in prompts]
    ref_tokens = np.zeros((b, n), np.int64)
    ref_logp = []
    for step in range(n):
        ids = np.array([t for s in seqs for t in s], np.int64)
        cu = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int32)
        fb = ForwardBatch(input_ids=ids, positions=np.concatenate([np.arange(len(s)) for s in seqs]).astype(np.int64),
                          cu_seqlens=cu, past_lens=np.zeros(b, np.int32), block_table=np.zeros((b, 1), np.int32),
                          slot_mapping=np.zeros(len(ids), np.int64), logits_index=(cu[1:] - 1).astype(np.int64))
        lp = torch.log_softmax(_torch_forward(model, fb).double(), -1)
        ref_logp.append(lp)
        ref_tokens[:, step] = lp.argmax(-1).numpy()
        for i in range(b):
            seqs[i].append(int(ref_tokens[i, step]))
    table = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)

    def slots(seq: int, positions: np.ndarray) -> np.ndarray:
        return table[seq, positions // bs].astype(np.int64) * bs + positions % bs

    agree, kl = 0, 0.0
    for step in range(n):
        if step == 0:
            ids = np.array([t for p in prompts for t in p], np.int64)
            pos = [np.arange(ln, dtype=np.int64) for ln in lens]
            cu = np.cumsum([0] + lens).astype(np.int32)
            past = np.zeros(b, np.int32)
            index = (cu[1:] - 1).astype(np.int64)
        else:
            ids = ref_tokens[:, step - 1].copy()
            pos = [np.array([ln + step - 1], np.int64) for ln in lens]
            cu = np.arange(b + 1, dtype=np.int32)
            past = np.array([ln + step - 1 for ln in lens], np.int32)
            index = np.arange(b, dtype=np.int64)
        fb = ForwardBatch(input_ids=ids, positions=np.concatenate(pos), cu_seqlens=cu, past_lens=past,
                          block_table=table, slot_mapping=np.concatenate([slots(i, p) for i, p in enumerate(pos)]),
                          logits_index=index)
        logits = backend.forward(fb)
        agree += int((np.argmax(logits, axis=-1) == ref_tokens[:, step]).sum())
        lp_a = torch.log_softmax(torch.from_numpy(np.asarray(logits)).double(), -1)
        lp_r = ref_logp[step]
        kl += float((lp_r.exp() * (lp_r - lp_a)).sum())
    return agree / (b * n), kl / (b * n)


def build(recipe_path: str | Path, progress: bool = True, output: str | Path | None = None,
          autotune: bool = True, force: bool = False) -> Path:
    """Run the recipe; returns the artifact folder. Raises RecipeError/BuildError and leaves nothing.

    `output` overrides the recipe's output folder (the artifact goes to <output>/<name>/<version>).
    `autotune=False` makes passes that measure candidates on this machine use their fixed rule
    tables instead, so the build is deterministic (byte-reproducible). A build whose estimated peak memory
    exceeds MemAvailable, or whose estimated artifact exceeds the free disk space at the output, is refused
    before any work unless `force` (compiler/memory.py, compiler/disk.py).
    """
    t0 = time.perf_counter()
    p = plan(recipe_path)
    recipe = p.recipe
    out_root = Path(output).resolve() if output is not None else recipe.output
    final = _refuse_before_work(p, out_root, force)
    draft: Path | None = None
    if recipe.speculative is not None:
        draft = _build_draft(recipe, out_root, autotune, force)
    staging = final.parent / f".{recipe.version}.staging-{os.getpid()}"
    created_parent = not final.parent.exists()
    _remove_stale_staging(final.parent, recipe.version)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    ctx = BuildContext(recipe=recipe, checkpoint=p.checkpoint, staging=staging)
    ctx.artifacts["no_autotune"] = not autotune
    ctx.artifacts["streamed"] = p.streamed
    use_spill_folder(final.parent / f".{recipe.version}.spill-{os.getpid()}")  # arrays computed before package
    timings: dict[str, float] = {}
    memory: dict[str, int] = {}
    sampler = RssSampler()
    return_freed_memory()
    stop_hashing = threading.Event()  # set when the build ends: a failed build does not wait for the hash
    try:
        # the checkpoint's hash for the manifest, on a second thread beside the passes (hashlib and file reads
        # release the GIL), joined before the manifest is written
        hashing = ThreadPoolExecutor(1, thread_name_prefix="hash-source")
        src_hash = hashing.submit(_timed_source_sha256, p.checkpoint, stop_hashing)
        hashing.shutdown(wait=False)
        pass_records = []
        with _progress(progress) as bar, sampler:
            task = bar.add_task("build", total=len(p.passes) + 1) if bar else None
            ctx.artifacts["progress"] = bar  # passes with long loops add a task of their own (None: off)
            for ps in p.passes:
                if bar:
                    bar.update(task, description=f"pass {ps.name}")
                pass_records.append(_run_pass(ps, ctx, p.passes, sampler, timings, memory))
                if bar:
                    bar.advance(task)
            src_sha, timings["hash_source"] = src_hash.result()
            manifest = _manifest(ctx, src_sha, pass_records)
            if draft is not None:
                manifest["speculative"] = _pairing(recipe, staging, manifest, draft, final)
            write_manifest(staging, manifest)  # provisional: lets the runtime verify and load it
            if bar:
                bar.update(task, description="quality gate")
            t = time.perf_counter()
            manifest["quality"] = quality_gate(ctx)
            timings["quality_gate"] = time.perf_counter() - t
            memory["quality_gate"] = sampler.take()
            if bar:
                bar.advance(task)
        write_manifest(staging, manifest)
        timings["total"] = time.perf_counter() - t0
        _write_build_info(ctx, p, Path(recipe_path), timings, memory)
        if final.exists():
            final.rmdir()  # check_version_unused allowed only an empty folder
        staging.rename(final)
        reset_streamed()
    except BaseException:
        stop_hashing.set()
        reset_streamed()
        _remove_partial(staging, draft, final.parent if created_parent else None)
        raise
    log.info("built %s in %.1f s", final, timings["total"])
    return final


def _refuse_before_work(p: Plan, out_root: Path, force: bool) -> Path:
    """The artifact's folder, after every check that can refuse the build before any work: the memory and disk
    estimates (unless `force`), the GPU packages and devices the passes need, the quality gate, the version."""
    too_big = check_memory(p.pass_peaks, force)
    if too_big is not None:
        raise BuildError(too_big)
    for ps in p.passes:  # GPU packages / devices a pass needs: fail before any work, saying what is missing
        problem = ps.check_environment(p.recipe)
        if problem is not None:
            raise BuildError(f"pass {ps.name!r}: {problem}")
    check_gate_can_run(p.recipe)
    final = check_version_unused(out_root, p.recipe.name, p.recipe.version)
    no_room = check_disk(final, p.estimates["artifact_bytes"], force)
    if no_room is not None:
        raise BuildError(no_room)
    return final


def _run_pass(ps: Pass, ctx: BuildContext, passes: list[Pass], sampler: RssSampler, timings: dict[str, float],
              memory: dict[str, int]) -> dict[str, Any]:
    """Run (or skip, saying why) one pass; its manifest record. Records its time and peak memory, then frees
    what no later pass reads."""
    t = time.perf_counter()
    reason = ps.skip_reason(ctx)
    record: dict[str, Any] = {"name": ps.name, "config": dataclasses.asdict(ps.config)}
    if reason:
        log.info("pass %s does not apply: %s", ps.name, reason)
        record.update(status="skipped", reason=reason)
    else:
        log.info("pass %s ...", ps.name)
        record.update(status="applied", stats=ps.run(ctx))
    ctx.completed.append(ps.name)
    timings[f"pass.{ps.name}"] = time.perf_counter() - t
    memory[f"pass.{ps.name}"] = sampler.take()
    later = [q.name for q in passes[len(ctx.completed):]]
    if release_torch_model(ctx.recipe, ctx.artifacts, later):
        log.info("released the torch model after %s (nothing later reads it)", ps.name)
    trim_heap()
    return record


def _write_build_info(ctx: BuildContext, p: Plan, recipe_path: Path, timings: dict[str, float],
                      memory: dict[str, int]) -> None:
    """build_info.json: the run-to-run facts kept out of the manifest (timings, host, estimates, memory)."""
    write_build_info(ctx.staging, {
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "host": {"machine": platform.machine(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "recipe_path": str(recipe_path.resolve()),
        "checkpoint_path": str(p.recipe.checkpoint),
        "estimates": {**p.estimates, "build_peak_by_pass": p.pass_peaks},
        "weights": "streamed" if p.streamed else f"loaded ({p.loads_model_because})",
        # peak resident set per pass (sampled every 20 ms) and the process's high-water mark
        "memory": {**memory, "peak_rss_bytes": status_kb("VmHWM") * 1024},
        **ctx.build_info,  # run-to-run facts of the passes (e.g. autotune timings)
    })


def _remove_partial(staging: Path, draft: Path | None, created_parent: Path | None) -> None:
    """After a failed build: the staging folder, the draft built for it, and a <name>/ folder it created."""
    shutil.rmtree(staging, ignore_errors=True)
    if draft is not None:
        shutil.rmtree(draft, ignore_errors=True)
        try:
            draft.parent.rmdir()
        except OSError:
            pass
    if created_parent is not None:
        try:
            created_parent.rmdir()  # leave no empty <name>/ folder behind either
        except OSError:
            pass


def _timed_source_sha256(info: CheckpointInfo, stop: threading.Event) -> tuple[str, float]:
    """(source_sha256 of the checkpoint, seconds it took); stops early (HashStopped) once `stop` is set."""
    t = time.perf_counter()
    return source_sha256(info, stop), time.perf_counter() - t


def _remove_stale_staging(parent: Path, version: str) -> None:
    """Remove the staging and spill folders of builds of this version that were killed (their process is gone)."""
    for stale in [*parent.glob(f".{version}.staging-*"), *parent.glob(f".{version}.spill-*")]:
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            log.info("removing %s (the build that wrote it was killed)", stale)
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:  # another user's live process
            continue


def _build_draft(recipe: Recipe, out_root: Path, autotune: bool, force: bool = False) -> Path:
    """Build the recipe's draft model (module doc) into <out_root>/<name>-draft/<version>."""
    spec = recipe.speculative
    assert spec is not None
    check_version_unused(out_root, f"{recipe.name}-draft", recipe.version)
    data = yaml.safe_load(recipe.text)
    base = recipe.path.resolve().parent
    with tempfile.TemporaryDirectory(prefix="optimize-draft-") as tmp:
        if spec.truncate_layers is not None:
            try:
                ckpt = truncate_checkpoint(recipe.checkpoint, Path(tmp) / "checkpoint", spec.truncate_layers)
            except (OSError, ValueError, KeyError) as exc:
                raise recipe.error("speculative.draft.truncate_layers", f"cannot truncate the checkpoint: {exc}") \
                    from exc
        else:
            assert spec.checkpoint is not None
            ckpt = spec.checkpoint
        data["name"] = f"{recipe.name}-draft"
        data["source"] = {**data["source"], "checkpoint": str(ckpt)}
        if "calibration" in data:
            data["calibration"]["data"] = str((base / data["calibration"]["data"]).resolve())
        for key in ("quality", "speculative", "output"):
            data.pop(key, None)
        path = Path(tmp) / f"{data['name']}.yaml"
        path.write_text(f"# The draft model of {recipe.path.name} (its speculative: section)\n"
                        + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        log.info("building the draft model %s from %s", data["name"], ckpt)
        try:
            return build(path, progress=False, output=out_root, autotune=autotune, force=force)
        except RecipeError as exc:
            raise BuildError(f"the draft model of {recipe.path}: {exc}") from exc


def _pairing(recipe: Recipe, staging: Path, manifest: dict[str, Any], draft: Path, final: Path) -> dict[str, Any]:
    """The target manifest's `speculative` record; BuildError when the draft's tokenizer is not the target's."""
    spec = recipe.speculative
    assert spec is not None
    try:
        check_pairing(Artifact(root=staging, manifest=manifest), Artifact(root=draft, manifest=read_manifest(draft)))
    except ArtifactError as exc:
        raise BuildError(f"speculative.draft: {exc}") from exc
    dm = read_manifest(draft)
    source = (f"the first {spec.truncate_layers} layers of source.checkpoint" if spec.truncate_layers is not None
              else recipe.as_dict()["speculative"]["draft"]["checkpoint"])
    return {"num_tokens": spec.num_tokens,
            "draft": {"name": dm["name"], "version": dm["version"], "path": os.path.relpath(draft, final),
                      "manifest_sha256": sha256_file(draft / "manifest.json"), "source": source,
                      "num_layers": Artifact(root=draft, manifest=dm).runtime_config["model"].get("num_layers")}}


def _manifest(ctx: BuildContext, src_sha: str, pass_records: list[dict[str, Any]]) -> dict[str, Any]:
    recipe = ctx.recipe
    cfg = ctx.checkpoint.config
    return {
        "name": recipe.name,
        "version": recipe.version,
        "created_by": _tool_versions(),
        "source": {
            "checkpoint": recipe.as_dict()["source"]["checkpoint"],
            "sha256": src_sha,
            "architecture": cfg.architecture,
            "config": cfg.to_dict(),
            "parameters": ctx.checkpoint.num_parameters,
        },
        "recipe": {"text": recipe.text, "sha256": recipe.sha256, "parsed": recipe.as_dict()},
        "target": {"backend": recipe.target.backend, "device": recipe.target.device, "dtype": recipe.target.dtype,
                   "matmul": recipe.target.matmul or recipe.target.dtype,
                   "kv_cache_dtype": ctx.artifacts.get("kv_cache_dtype", recipe.target.dtype)},
        "passes": pass_records,
        **({"tokenizer": ctx.artifacts["tokenizer"]} if "tokenizer" in ctx.artifacts else {}),
        "kernels": {"attention": ctx.artifacts.get("attention_kernel") or ATTENTION_KERNEL},
        **({"engine": ctx.artifacts["engine_record"]} if "engine_record" in ctx.artifacts else {}),
        "cuda_graphs": ctx.artifacts.get("cuda_graphs") or {
            "applies": False, "reason": f"{recipe.target.device} target: no CUDA graphs (no plan_cuda_graphs pass)"},
    }


def _progress(enabled: bool) -> Any:
    if not enabled:
        return nullcontext(None)
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    transient=True)


__all__ = ["Plan", "QualityGateError", "RecipeError", "build", "decide_interval", "eval_size", "plan", "quality_gate"]
