"""The CPU backend's memory modes side by side: ONNX Runtime's arena (the default) vs OPTIMIZE_ORT_ARENA=0.

With the arena a step's activation buffers are carved from memory the process keeps; without it they
are malloc'd per step, and those above glibc's mmap threshold (fixed at 1 MiB by the backend) are
fresh mappings whose every page faults on first touch. This bench runs the peer benchmark's workloads
(bench/profile_nodes.py's shapes: W1 1 x 128 prompt + 128 new, decode tok/s; W2 1 x 1,024 prompt, TTFT;
W3 16 x 128 prompt + 128 new, tok/s) through LLMEngine:

- speed: both modes in one process, interleaved rounds (order alternating, so drift hits both alike),
  per-round ratios and their median, and the minor page faults per run of each mode (the no-arena
  engine fixes glibc's mmap threshold for the whole process, as it does in serving, so the arena
  engine's own large numpy buffers follow it here too);
- peak RSS: one subprocess per mode running W2 then W3 (ru_maxrss, which a process cannot reset).

Prints a table and writes JSON (default bench/results/arena.json). `OPTIMIZE_CPU_ISA` pins the C ops'
code path as in serving.

    python bench/arena.py ARTIFACT [--rounds 6] [--workloads W1,W2,W3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.profile_nodes import WORKLOADS, prompts  # noqa: E402
from bench.report import write_json  # noqa: E402

MODES = {"arena": "1", "no arena": "0"}  # name: OPTIMIZE_ORT_ARENA


def _engine(artifact: Path, env: str, threads: int) -> Any:
    from runtime.engine import LLMEngine

    os.environ["OPTIMIZE_ORT_ARENA"] = env
    try:
        return LLMEngine(artifact, threads=threads, enable_prefix_caching=False)
    finally:
        del os.environ["OPTIMIZE_ORT_ARENA"]


def run_workload(engine: Any, workload: str, tag: str) -> tuple[float, int]:
    """One run: (W1 decode tok/s | W2 TTFT ms | W3 tok/s, minor page faults during it)."""
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=WORKLOADS[workload][2], temperature=0.0, ignore_eos=True)
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(workload, engine.vocab_size)):
        engine.add_request(f"{tag}-{i}", p, params)
    first = None
    tokens = 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens += len(o.new_token_ids)
            if first is None and o.new_token_ids:
                first = time.perf_counter()
    t1 = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    assert first is not None
    if workload == "W2":
        return (first - t0) * 1e3, faults
    if workload == "W1":
        return (tokens - 1) / (t1 - first), faults
    return tokens / (t1 - t0), faults


def speed(artifact: Path, workloads: list[str], rounds: int, threads: int) -> dict[str, Any]:
    engines = {name: _engine(artifact, env, threads) for name, env in MODES.items()}
    names = list(engines)
    values: dict[str, dict[str, list[float]]] = {w: {n: [] for n in names} for w in workloads}
    faults: dict[str, dict[str, list[int]]] = {w: {n: [] for n in names} for w in workloads}
    for r in range(rounds + 1):  # round 0 warms both up (first-run allocations) and is left out
        for w in workloads:
            for name in (names if r % 2 == 0 else names[::-1]):
                v, f = run_workload(engines[name], w, f"{w}-{r}-{name}")
                if r:
                    values[w][name].append(v)
                    faults[w][name].append(f)
    out = {}
    for w in workloads:
        a, b = values[w]["arena"], values[w]["no arena"]
        out[w] = {"unit": "ms TTFT" if w == "W2" else "tok/s",
                  "arena": a, "no_arena": b,
                  "median_arena": statistics.median(a), "median_no_arena": statistics.median(b),
                  "paired_ratio_arena_over_no_arena": statistics.median([x / y for x, y in zip(a, b, strict=True)]),
                  "faults_per_run_arena": statistics.median(faults[w]["arena"]),
                  "faults_per_run_no_arena": statistics.median(faults[w]["no arena"])}
    return out


def peak_rss(artifact: Path, env: str, threads: int) -> dict[str, float]:
    """In a subprocess: W2 then W3 in mode `env`; ru_maxrss after each (MB)."""
    code = (
        "import json, resource, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from bench.arena import _engine, run_workload\n"
        f"e = _engine({str(artifact)!r}, {env!r}, {threads})\n"
        "out = {}\n"
        "for w in ('W2', 'W3'):\n"
        "    run_workload(e, w, w)\n"
        "    out[w] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "arena.json")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    rss = {name: peak_rss(args.artifact, env, args.threads) for name, env in MODES.items()}
    result = {"artifact": str(args.artifact), "cpu_isa": os.environ.get("OPTIMIZE_CPU_ISA", "widest"),
              "threads": args.threads, "rounds": args.rounds,
              "speed": speed(args.artifact, workloads, args.rounds, args.threads), "peak_rss_mb": rss}
    print(f"{'workload':<10}{'arena':>12}{'no arena':>12}{'paired ratio':>14}{'faults/run':>22}")
    for w, v in result["speed"].items():
        print(f"{w + ' ' + v['unit']:<18}{v['median_arena']:>8.1f}{v['median_no_arena']:>12.1f}"
              f"{v['paired_ratio_arena_over_no_arena']:>12.3f}"
              f"{v['faults_per_run_arena']:>12.0f} / {v['faults_per_run_no_arena']:.0f}")
    for name, r in rss.items():
        print(f"peak RSS {name}: after W2 {r['W2']:.0f} MB, after W3 {r['W3']:.0f} MB")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
