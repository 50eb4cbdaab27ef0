"""Quantization methods on the demo model: quality with error bars, size, build time and decode speed.

Builds (or reuses, with --reuse) the demo recipe and each quantization recipe into one output folder.
Quality is measured on the whole of the demo's eval.txt (every 256-token chunk; --max-tokens for
fewer) through the runtime (ONNX Runtime CPU), the fp32 artifact scoring the same chunks: perplexity
and its change vs. fp32 with the standard error of the paired per-chunk differences and the 95 %
interval (runtime.evaluate.paired_delta; z = 1.96). The mean KL and greedy-token agreement come
from the build's quality gate (its manifest: the gate's own evaluation size). Also: the bytes of the
quantized Linear weights (with scales and zero points) against their fp32 bytes, the calibration
windows each quantize pass used, the build time from build.json, and decode tokens/s on ONNX
Runtime CPU with `runtime.LLM`: 8 prompts x 64 greedy tokens; decode rate = 8 x 63 / (time of 64
tokens - time of 1 token), median of --rounds, the rounds alternating between artifacts (as
bench/decode_throughput.py does; --rounds 0 skips it). Prints a table and writes JSON
(bench/results/quant.json by default).

    python bench/quant.py [--out /tmp/quant-bench] [--reuse] [--rounds 3] [--only "int4 gptq"]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import decode_throughput  # bench/ (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "fp32": "demo.yaml",  # without select_attention / fuse / plan_cuda_graphs, like the quantized recipes
    "int4 rtn": "demo-int4-rtn.yaml",
    "int4 awq": "demo-int4-awq.yaml",
    "int4 gptq": "demo-int4-gptq.yaml",
    "fp8 w+a": "demo-fp8.yaml",
    "int8 w8a8": "demo-int8.yaml",
    "kv int8": "demo-kv-int8.yaml",
}
PROMPTS = decode_throughput.PROMPTS  # the same 8 prompts as the decode-throughput bench


def unfused_demo(out: Path) -> Path:
    """recipes/demo.yaml without the select_attention, fuse and plan_cuda_graphs passes (the example
    quantization recipes do not run them), named pycode-llama-6m-fp32, written under `out`."""
    text = (ROOT / "recipes" / "demo.yaml").read_text(encoding="utf-8")
    keep = [ln for ln in text.splitlines()
            if not any(ln.strip().startswith(f"- name: {p}") for p in ("select_attention", "fuse", "plan_cuda_graphs"))]
    text = "\n".join(keep).replace("name: pycode-llama-6m\n", "name: pycode-llama-6m-fp32\n", 1)
    text = text.replace("../models/", f"{ROOT}/models/").replace("output: ../artifacts", f"output: {out}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "demo-fp32.yaml"
    path.write_text(text + "\n", encoding="utf-8")
    return path


def gate_subset(recipe: Path, out: Path, tokens: int) -> Path:
    """A copy of `recipe` under `out` (absolute paths) whose gate scores the first `tokens` eval tokens and
    has no perplexity-change bound: this bench measures the change on the whole file itself, and a
    subset's interval could not judge the example recipes' bounds (KL and agreement bounds stay)."""
    text = recipe.read_text(encoding="utf-8").replace("../models/", f"{ROOT}/models/")
    text = text.replace("output: ../artifacts", f"output: {out}")
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith(("max_perplexity_increase_pct:",
                                                                           "max_eval_tokens:"))]
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("eval_data:"))
    lines.insert(at + 1, f"  max_eval_tokens: {tokens}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gate-{tokens}-{recipe.name}"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def weight_bytes(artifact: Path) -> tuple[int, int]:
    """(bytes of the quantized Linear weights incl. scales/zeros, their fp32 bytes) from the manifest."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    for p in manifest["passes"]:
        if p["name"] == "lower_quant" and p.get("status") == "applied" and p["stats"].get("quantized_weights"):
            return p["stats"]["quantized_weight_bytes"], p["stats"]["quantized_weight_fp32_bytes"]
    return 0, 0


def whole_file_nll(artifact: Path, data: Path, max_tokens: int | None) -> Any:
    """The artifact's perplexity on `data` with per-chunk mean NLLs (runtime.evaluate, ONNX Runtime CPU)."""
    from runtime.engine import LLMEngine
    from runtime.evaluate import perplexity

    engine = LLMEngine(artifact, device="cpu")
    ids = engine.tokenizer.encode(data.read_text(encoding="utf-8"), add_special_tokens=False)
    return perplexity(engine.backend, ids, max_tokens=max_tokens)


def calibration_windows(manifest: dict[str, Any]) -> str:
    """'128 x 256' from the quantize pass's calibration record, '-' without one."""
    for p in manifest["passes"]:
        cal = (p.get("stats") or {}).get("calibration")
        if p["name"].startswith("quantize_") and cal:
            return f"{cal['num_samples']} x {cal['seq_len']}"
    return "-"


def decode_rates(artifacts: dict[str, Path], rounds: int) -> dict[str, float]:
    """Decode tokens/s of each artifact; rounds alternate between artifacts so machine noise hits all alike."""
    from runtime import LLM
    from runtime.sampling import SamplingParams

    llms = {k: LLM(a) for k, a in artifacts.items()}

    def run(llm: object, n: int) -> float:
        t = time.perf_counter()
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))  # type: ignore[attr-defined]
        dt = time.perf_counter() - t
        assert all(len(o.token_ids) == n for o in outs)
        return dt

    for llm in llms.values():
        run(llm, 4)  # warm-up
    rates: dict[str, list[float]] = {k: [] for k in llms}
    for _ in range(rounds):
        for k, llm in llms.items():
            long, short = run(llm, 64), run(llm, 1)
            rates[k].append(len(PROMPTS) * 63 / max(long - short, 1e-9))
    return {k: statistics.median(v) for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/optimize-quant-bench"))
    ap.add_argument("--reuse", action="store_true", help="reuse artifacts already built under --out")
    ap.add_argument("--rounds", type=int, default=5, help="decode-speed rounds (0: no decode measurement)")
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the first N eval tokens (default: all)")
    ap.add_argument("--gate-tokens", type=int, default=None,
                    help="build copies of the recipes whose gate scores N tokens, without its change bound "
                         "(faster builds; default: the recipes as they are)")
    ap.add_argument("--only", nargs="*", help="methods to run (names as in the table)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/quant.json")
    args = ap.parse_args()

    from compiler.build import build, plan
    from runtime.evaluate import paired_delta

    eval_data = ROOT / "models" / "pycode-llama-6m" / "eval.txt"
    rows = []
    artifacts: dict[str, Path] = {}
    reference = None
    for method, recipe_file in RECIPES.items():
        if args.only and method not in args.only and method != "fp32":  # fp32: the reference of every delta
            continue
        recipe = ROOT / "recipes" / recipe_file
        if recipe_file == "demo.yaml":  # the same pass list as the quantization recipes: no fusion
            recipe = unfused_demo(args.out)
        if args.gate_tokens:
            recipe = gate_subset(recipe, args.out, args.gate_tokens)
        p = plan(recipe)
        artifact = args.out / p.recipe.name / p.recipe.version
        if not (args.reuse and (artifact / "manifest.json").is_file()):
            artifact = build(recipe, progress=False, output=args.out)
        manifest = json.loads((artifact / "manifest.json").read_text())
        metrics = manifest["quality"]["metrics"]
        timings = json.loads((artifact / "build.json").read_text())["timings_s"]
        q, f = weight_bytes(artifact)
        whole = whole_file_nll(artifact, eval_data, args.max_tokens)
        if reference is None:
            reference = whole
        delta = paired_delta(whole.chunk_nll, reference.chunk_nll)
        lo, hi = delta.ci_pct
        row = {
            "method": method,
            "recipe": f"recipes/{recipe_file}",
            "calibration": calibration_windows(manifest),
            "perplexity": round(whole.perplexity, 4),
            "reference_perplexity": round(reference.perplexity, 4),
            "predictions": whole.predictions,
            "chunks": whole.chunks,
            "perplexity_increase_pct": round(delta.pct, 4),
            "perplexity_increase_se_pct": round(delta.se_pct, 4),
            "perplexity_increase_ci_pct": [round(lo, 4), round(hi, 4)],
            "gate_perplexity_increase_pct": metrics["perplexity_increase_pct"],
            "gate_eval_tokens": metrics["eval_tokens"],
            "kl_divergence": metrics["kl_divergence"],
            "token_agreement": metrics["token_agreement"],
            "decode_kl_divergence": metrics["decode_kl_divergence"],
            "quantized_weight_bytes": q,
            "fp32_weight_bytes": f,
            "artifact_weights_bytes": (artifact / "model.onnx.data").stat().st_size,
            "build_s": timings["total"],
            "quantize_s": sum(v for k, v in timings.items() if k.startswith("pass.quantize_")),
        }
        rows.append(row)
        artifacts[method] = artifact
        print(f"{method}: built, {whole.predictions} predictions scored", flush=True)
    rates = decode_rates(artifacts, args.rounds) if args.rounds > 0 else {}
    for row in rows:
        row["decode_tokens_per_s"] = round(rates[row["method"]], 1) if rates else None

    assert reference is not None
    print(f"whole eval.txt: {reference.predictions} predictions in {reference.chunks} chunks of 256; change vs. fp32 "
          "+- se of the paired chunk differences, 95% interval (z 1.96); KL and agreement from the build's gate")
    head = (f"{'method':<10} {'calib':>9} {'ppl':>8} {'vs fp32 +- se':>17} {'95% interval':>18} {'KL':>8} "
            f"{'agree':>6} {'quant W/fp32':>12} {'file MB':>8} {'build s':>8} {'quant s':>8} {'decode tok/s':>12}")
    print(head)
    print("-" * len(head))
    for r in rows:
        size = f"{r['quantized_weight_bytes'] / r['fp32_weight_bytes']:.1%}" if r["fp32_weight_bytes"] else "-"
        lo, hi = r["perplexity_increase_ci_pct"]
        rate = f"{r['decode_tokens_per_s']:12.1f}" if r["decode_tokens_per_s"] is not None else f"{'-':>12}"
        print(f"{r['method']:<10} {r['calibration']:>9} {r['perplexity']:8.4f} "
              f"{r['perplexity_increase_pct']:+7.3f}% +- {r['perplexity_increase_se_pct']:.3f} "
              f"[{lo:+.3f}, {hi:+.3f}]% {r['kl_divergence']:8.5f} {r['token_agreement']:6.3f} {size:>12} "
              f"{r['artifact_weights_bytes'] / 1e6:8.2f} {r['build_s']:8.1f} {r['quantize_s']:8.1f} {rate}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "eval_data": "models/pycode-llama-6m/eval.txt",
                                        "prompts": len(PROMPTS), "tokens": 64}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
