"""The build driver: recipe -> plan -> passes -> quality gate -> artifact (manifest last).

`plan()` checks the recipe, the checkpoint and the architecture without reading a weight (the
dry run). `build()` runs the recipe's passes in order into a staging folder, evaluates the
result against the recipe's quality bounds, writes manifest.json (deterministic) and build.json
(timings, host), and only then moves the folder to `<output>/<name>/<version>`. A failed build
leaves no artifact behind.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from compiler.passes import PASSES, BuildContext, BuildError, Pass, pass_options
from compiler.recipe import Recipe, RecipeError, load_recipe
from runtime.artifact import check_version_unused, write_build_info, write_manifest

log = logging.getLogger(__name__)

TOOL_VERSION = "0.1.0"
ATTENTION_KERNEL = {
    "implementation": "paged_attention_standard_ops",
    "description": "per-token gather of past K/V through block_table + this step's K/V, masked softmax; "
                   "plain ONNX ops (Gather, Einsum, Softmax)",
    "variants": "MHA/GQA/MQA, sliding window, qk-norm",
}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Plan:
    recipe: Recipe
    checkpoint: CheckpointInfo
    passes: list[Pass]
    estimates: dict[str, int] = field(default_factory=dict)


def _estimates(recipe: Recipe, info: CheckpointInfo) -> dict[str, int]:
    cfg = info.config
    rt = recipe.runtime
    nbytes = _DTYPE_BYTES[recipe.target.dtype]
    weights = info.num_parameters * nbytes
    kv = 2 * cfg.num_layers * rt.num_kv_blocks * rt.kv_block_size * cfg.num_kv_heads * cfg.head_dim * nbytes
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
        # checkpoint tensors + our model + the ONNX proto and its serialisation, plus the tracer
        "build_peak_bytes": info.weight_bytes + 3 * weights + 256 * 1024 * 1024,
    }


def plan(recipe_path: str | Path) -> Plan:
    """Check recipe + checkpoint + pass order without loading weights; RecipeError on any problem."""
    recipe = load_recipe(recipe_path, pass_options())
    try:
        info = inspect_checkpoint(recipe.checkpoint)
    except CheckpointError as e:
        raise recipe.error("source.checkpoint", str(e)) from e
    t = recipe.target
    if (t.backend, t.device) != ("onnxruntime", "cpu"):
        raise recipe.error("target.backend", f"target {t.backend}/{t.device} cannot be built by this version; "
                           "supported: onnxruntime/cpu")
    if t.dtype != "float32":
        raise recipe.error("target.dtype", f"dtype {t.dtype} is not supported for onnxruntime/cpu yet; use float32")
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
    return Plan(recipe, info, passes, _estimates(recipe, info))


def _tool_versions() -> dict[str, str]:
    versions = {"optimize": TOOL_VERSION, "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for mod in ("torch", "onnx", "onnxruntime", "onnxscript"):
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


def quality_gate(ctx: BuildContext) -> dict[str, Any]:
    """Evaluate the staged artifact on the recipe's held-out text; raise when a bound is missed."""
    q = ctx.recipe.quality
    if q.eval_data is None:
        return {"evaluated": False, "reason": "the recipe names no quality.eval_data"}
    from runtime.engine import LLMEngine
    from runtime.evaluate import text_perplexity

    engine = LLMEngine(ctx.staging, verify=True)
    result = text_perplexity(engine, q.eval_data, max_tokens=q.max_eval_tokens)
    metrics: dict[str, Any] = {
        "eval_data": ctx.recipe.as_dict().get("quality", {}).get("eval_data"),
        "perplexity": _round(result.perplexity),
        "mean_nll": _round(result.mean_nll),
        "eval_tokens": result.tokens,
        "predictions": result.predictions,
    }
    bounds: dict[str, float] = {}
    table: list[tuple[str, float, float, bool]] = []
    if q.max_perplexity is not None:
        bounds["max_perplexity"] = q.max_perplexity
        table.append(("perplexity", result.perplexity, q.max_perplexity, result.perplexity <= q.max_perplexity))
    if q.max_perplexity_increase_pct is not None:
        ref = reference_perplexity(ctx, engine.tokenizer, q.eval_data, q.max_eval_tokens)
        inc = 100.0 * (result.perplexity / ref - 1.0)
        metrics["reference_perplexity"] = _round(ref)
        metrics["perplexity_increase_pct"] = _round(inc, 4)
        bounds["max_perplexity_increase_pct"] = q.max_perplexity_increase_pct
        table.append(("perplexity increase %", inc, q.max_perplexity_increase_pct,
                      inc <= q.max_perplexity_increase_pct))
    passed = all(ok for *_, ok in table)
    out = {"evaluated": True, "metrics": metrics, "bounds": bounds, "passed": passed}
    if not passed:
        rows = "\n".join(f"  {name:<24} measured {m:10.4f}  allowed {a:10.4f}  {'ok' if ok else 'FAILED'}"
                         for name, m, a, ok in table)
        raise QualityGateError(f"quality gate failed:\n{rows}", table)
    return out


def reference_perplexity(ctx: BuildContext, tokenizer: Any, path: Path, max_tokens: int) -> float:
    """Perplexity of the unoptimised model definition (torch, fp32) on the same chunks."""
    import torch

    from runtime.evaluate import chunk_tokens

    model = ctx.require("model", "quality gate")
    ids = tokenizer.encode(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)
    chunks = chunk_tokens(ids, 256, max_tokens)
    model = model.float()
    nll, count = 0.0, 0
    bs = model.block_size
    per_seq = -(-256 // bs)
    kv = [torch.zeros(per_seq, bs, model.cfg.num_kv_heads, model.cfg.head_dim) for _ in range(2 * model.cfg.num_layers)]
    with torch.no_grad():
        for chunk in chunks:
            x = torch.tensor(chunk)
            out = model(x, torch.arange(256), torch.tensor([0, 256], dtype=torch.int32),
                        torch.zeros(1, dtype=torch.int32), torch.arange(per_seq, dtype=torch.int32)[None],
                        torch.arange(256), *kv)
            logp = torch.log_softmax(out[0].double(), -1)
            nll -= float(logp[:-1].gather(1, x[1:, None]).sum())
            count += 255
    return math.exp(nll / count)


def build(recipe_path: str | Path, progress: bool = True, output: str | Path | None = None) -> Path:
    """Run the recipe; returns the artifact folder. Raises RecipeError/BuildError and leaves nothing.

    `output` overrides the recipe's output folder (the artifact goes to <output>/<name>/<version>).
    """
    t0 = time.perf_counter()
    p = plan(recipe_path)
    recipe = p.recipe
    out_root = Path(output).resolve() if output is not None else recipe.output
    final = check_version_unused(out_root, recipe.name, recipe.version)
    staging = final.parent / f".{recipe.version}.staging-{os.getpid()}"
    created_parent = not final.parent.exists()
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    ctx = BuildContext(recipe=recipe, checkpoint=p.checkpoint, staging=staging)
    timings: dict[str, float] = {}
    try:
        from compiler.checkpoint import source_sha256

        t = time.perf_counter()
        src_sha = source_sha256(p.checkpoint)
        timings["hash_source"] = time.perf_counter() - t
        pass_records = []
        with _progress(progress) as bar:
            task = bar.add_task("build", total=len(p.passes) + 1) if bar else None
            for ps in p.passes:
                if bar:
                    bar.update(task, description=f"pass {ps.name}")
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
                pass_records.append(record)
                if bar:
                    bar.advance(task)
            manifest = _manifest(ctx, src_sha, pass_records)
            write_manifest(staging, manifest)  # provisional: lets the runtime verify and load it
            if bar:
                bar.update(task, description="quality gate")
            t = time.perf_counter()
            manifest["quality"] = quality_gate(ctx)
            timings["quality_gate"] = time.perf_counter() - t
            if bar:
                bar.advance(task)
        write_manifest(staging, manifest)
        timings["total"] = time.perf_counter() - t0
        write_build_info(staging, {
            "timings_s": {k: round(v, 3) for k, v in timings.items()},
            "host": {"machine": platform.machine(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
            "recipe_path": str(Path(recipe_path).resolve()),
            "checkpoint_path": str(recipe.checkpoint),
            "estimates": p.estimates,
        })
        if final.exists():
            final.rmdir()  # check_version_unused allowed only an empty folder
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created_parent:
            try:
                final.parent.rmdir()  # leave no empty <name>/ folder behind either
            except OSError:
                pass
        raise
    log.info("built %s in %.1f s", final, timings["total"])
    return final


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
                   "kv_cache_dtype": recipe.target.dtype},
        "passes": pass_records,
        "kernels": {"attention": ATTENTION_KERNEL},
        "cuda_graphs": {"applies": False, "reason": f"{recipe.target.device} target: no CUDA graphs"},
    }


def _progress(enabled: bool) -> Any:
    if not enabled:
        return nullcontext(None)
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    transient=True)


__all__ = ["Plan", "QualityGateError", "RecipeError", "build", "plan", "quality_gate"]
