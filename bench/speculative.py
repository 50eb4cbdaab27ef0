"""Speculative decoding on the demo model: batch-1 decode tokens/s, plain vs n-gram prompt lookup vs a draft model.

Workloads (greedy, ignore_eos, `--tokens` new tokens per request, one request at a time):
- code: code completion with repeated identifiers: snippets of the demo's held-out CPython code
  (models/pycode-llama-6m/eval.txt; offsets fixed below) cut mid-function, and one hand-written
  snippet that repeats long identifiers;
- text: English prose (written here, no download; the demo model was trained on code, so it
  continues prose with code-like text and rarely repeats the prompt).
Modes: plain, n-gram with k proposals per step (`--k`, default 2 4 6), and the draft model with k
proposals (`--draft-k`, default 2 4) when a draft artifact is found (`--draft`, default the one
recipes/demo-speculative.yaml builds: artifacts/pycode-llama-6m-spec-draft/1.0.0, the demo checkpoint's
first 2 of 6 layers, a truncated-layer copy, not trained or distilled). Decode tokens/s is
(tokens - 1) / (time of the last token - time of the first): the prefill is excluded. Rounds alternate
between the modes (machine noise hits all alike); the number per workload and mode is the median over
rounds of the sum over its prompts. Every speculative run's tokens are checked equal to the plain
run's (exact greedy). Acceptance: proposals verified / accepted, per draft position, from the engine's
counters. Prints a table, writes JSON (bench/results/speculative.json).

    python bench/speculative.py [--artifact artifacts/pycode-llama-6m/1.0.0] [--rounds 3] [--tokens 128]
        [--draft artifacts/pycode-llama-6m-spec-draft/1.0.0] [--draft-k 2 4]
    python bench/speculative.py --quick      # tiny settings: checks that everything runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CODE_OFFSETS = (3000, 20000, 45000, 70000)  # characters into eval.txt; each snippet ends at a line's end
CODE_CHARS = 1200
REPEATED = (
    "class RectangleGeometry:\n"
    "    def __init__(self, rectangle_width, rectangle_height):\n"
    "        self.rectangle_width = rectangle_width\n"
    "        self.rectangle_height = rectangle_height\n\n"
    "    def area(self):\n"
    "        return self.rectangle_width * self.rectangle_height\n\n"
    "    def perimeter(self):\n"
    "        return 2 * (self.rectangle_width + self.rectangle_height)\n\n"
    "    def scaled(self, factor):\n"
    "        return RectangleGeometry(self.rectangle_width * factor, "
)
PROSE = (
    "The history of the city begins with a small settlement on the river, where traders stopped on their "
    "way to the coast. Over the centuries the market grew into a town, and the town into a city with "
    "bridges, churches and a university. Today most visitors come in the summer, when the old streets "
    "are full of music and the evenings are long and warm. ",
    "Good soup starts with a good stock. Roast the bones until they are brown, then cover them with cold "
    "water, add an onion, a carrot and a few peppercorns, and let the pot simmer for several hours. Skim "
    "the surface now and then, and do not let it boil, or the stock will turn cloudy. ",
    "When the committee met again in the spring, the members agreed that the new library should open "
    "before the end of the year. The architect presented two designs: one with a large reading room "
    "under a glass roof, the other with several smaller rooms around a garden. ",
)


def code_prompts(quick: bool) -> list[str]:
    text = (ROOT / "models" / "pycode-llama-6m" / "eval.txt").read_text(encoding="utf-8")
    out = []
    for off in CODE_OFFSETS[: 1 if quick else None]:
        start = text.index("\n", off) + 1
        end = text.rindex("\n", start, start + CODE_CHARS)
        out.append(text[start:end + 1])
    return [*out, REPEATED]


def run_one(engine: Any, prompt: str, tokens: int, spec: Any) -> tuple[list[int], float]:
    """Tokens and decode seconds (first token to last) of one request alone in the engine."""
    from runtime.sampling import SamplingParams

    engine.add_request("bench", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                       speculative=spec if spec is not None else False)
    first = last = None
    ids: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            if out.finished:
                ids = out.token_ids
    assert first is not None and last is not None
    return ids, last - first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts" / "pycode-llama-6m" / "1.0.0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--draft", type=Path, default=ROOT / "artifacts" / "pycode-llama-6m-spec-draft" / "1.0.0",
                    help="draft artifact (same tokenizer); skipped when missing")
    ap.add_argument("--draft-k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.k, args.draft_k = 1, 16, [4], [4]

    from runtime.engine import LLMEngine
    from runtime.speculative import SpeculativeConfig

    if not args.artifact.is_dir():
        print(f"{args.artifact}: no artifact; build it first: optimize build --skip-existing recipes/demo.yaml")
        return 2
    draft = args.draft if args.draft.is_dir() else False
    if not draft:
        print(f"{args.draft}: no draft artifact, no draft column (optimize build recipes/demo-speculative.yaml)")
    engine = LLMEngine(args.artifact, threads=args.threads, draft=draft)
    workloads = {"code": code_prompts(args.quick), "text": list(PROSE[: 1 if args.quick else None])}
    modes: dict[str, SpeculativeConfig | None] = {"plain": None}
    modes.update({f"ngram k={k}": SpeculativeConfig(num_tokens=k) for k in args.k})
    if draft:
        modes.update({f"draft k={k}": SpeculativeConfig("draft", num_tokens=k) for k in args.draft_k})
    run_one(engine, PROSE[0], 8, None)  # warm-up: ONNX Runtime's first runs allocate

    seconds: dict[tuple[str, str], list[float]] = {}
    accept: dict[tuple[str, str], dict[str, Any]] = {}
    plain_ids: dict[tuple[str, int], list[int]] = {}
    for _ in range(args.rounds):
        for mode, spec in modes.items():
            for wl, prompts in workloads.items():
                before = {k: (list(v) if isinstance(v, list) else v) for k, v in engine.stats.items()}
                total = 0.0
                for i, prompt in enumerate(prompts):
                    ids, dt = run_one(engine, prompt, args.tokens, spec)
                    total += dt
                    if spec is None:
                        plain_ids[(wl, i)] = ids
                    elif (wl, i) in plain_ids and ids != plain_ids[(wl, i)]:
                        raise SystemExit(f"{mode} {wl} prompt {i}: tokens differ from plain greedy decoding")
                seconds.setdefault((wl, mode), []).append(total)
                st = engine.stats
                pos_n = [n - (before["spec_position_proposed"][j] if j < len(before["spec_position_proposed"]) else 0)
                         for j, n in enumerate(st["spec_position_proposed"])]
                pos_a = [n - (before["spec_position_accepted"][j] if j < len(before["spec_position_accepted"]) else 0)
                         for j, n in enumerate(st["spec_position_accepted"])]
                acc = accept.setdefault((wl, mode), {"proposed": 0, "accepted": 0, "steps": 0, "pos_n": [], "pos_a": []})
                acc["proposed"] += st["spec_proposed"] - before["spec_proposed"]
                acc["accepted"] += st["spec_accepted"] - before["spec_accepted"]
                acc["steps"] += st["steps"] - before["steps"]
                for key, vals in (("pos_n", pos_n), ("pos_a", pos_a)):
                    acc[key] += [0] * (len(vals) - len(acc[key]))
                    for j, v in enumerate(vals):
                        acc[key][j] += v

    decoded = {wl: (args.tokens - 1) * len(prompts) for wl, prompts in workloads.items()}
    rows = []
    for wl in workloads:
        base = decoded[wl] / statistics.median(seconds[(wl, "plain")])
        for mode in modes:
            tps = decoded[wl] / statistics.median(seconds[(wl, mode)])
            acc = accept[(wl, mode)]
            rate = acc["accepted"] / acc["proposed"] if acc["proposed"] else None
            per_pos = [a / n if n else None for n, a in zip(acc["pos_n"], acc["pos_a"], strict=True)]
            rows.append({"workload": wl, "mode": mode, "prompts": len(workloads[wl]), "decode_tokens_per_s": tps,
                         "speedup": tps / base, "proposed": acc["proposed"], "accepted": acc["accepted"],
                         "acceptance_rate": rate, "acceptance_per_position": per_pos,
                         "tokens_per_step": (decoded[wl] + len(workloads[wl])) * args.rounds / acc["steps"]
                         if acc["steps"] else None})
    print(f"batch 1, greedy, {args.tokens} tokens per request, median of {args.rounds} rounds, "
          f"{args.threads} ORT thread(s), artifact {args.artifact}")
    print(f"{'workload':<9}{'mode':<12}{'tok/s':>9}{'speedup':>9}{'accepted':>11}{'tok/step':>10}  per position")
    for r in rows:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        pos = " ".join("-" if p is None else f"{p:.2f}" for p in r["acceptance_per_position"])
        print(f"{r['workload']:<9}{r['mode']:<12}{r['decode_tokens_per_s']:>9.1f}{r['speedup']:>9.2f}"
              f"{rate:>11}{r['tokens_per_step']:>10.2f}  {pos}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "speculative.json"
    meta = {"artifact": str(args.artifact), "draft": str(args.draft) if draft else None, "rounds": args.rounds, "tokens": args.tokens, "threads": args.threads,
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "quick": args.quick}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
