"""Where a step's time goes: ONNX Runtime's profiler per node type, on the peer benchmark's workloads.

Runs an onnxruntime/cpu artifact through LLMEngine on the shapes of ../shared/peers' workloads (token-id
prompts from a seeded generator, greedy, ignore_eos, prefix caching off), with ONNX Runtime's profiler on
(OPTIMIZE_ORT_PROFILE), and adds up the kernel time of every node by op type:

- W1 latency: 1 prompt of 128 tokens, 128 new tokens;
- W2 long prompt: 1 prompt of 1,024 tokens, 16 new tokens (the time to first token is mostly prefill);
- W3 throughput: 16 prompts of 128 tokens, 128 new tokens each, all added at once.

Each workload runs `--warmup` times first (default 1; the first run of a process pays one-time costs:
ONNX Runtime's allocations, page faults), and only the last run's events count. For each workload: wall
time, the time inside the session's runs (`model_run`), what is outside it (the
engine: scheduling, packing, sampling, Python), and per op type the kernel time, its share of the runs and
its node count per run. Prints one table per workload and writes JSON (default bench/results/profile.json).
The profiler's own cost is small against these kernels but not zero: compare shares, not these walls, with
bench/decode.py. `OPTIMIZE_CPU_ISA` pins the project's C ops to one code path, as in serving.

    python bench/profile_nodes.py ARTIFACT [--workloads W1,W2,W3] [--threads 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = {  # name: (number of prompts, prompt tokens, new tokens): the peer benchmark's shapes
    "W1": (1, 128, 128),
    "W2": (1, 1024, 16),
    "W3": (16, 128, 128),
}


def prompts(workload: str, vocab: int, seed: int = 0) -> list[list[int]]:
    n, length, _ = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, vocab, size=length - 1).tolist()] for _ in range(n)]


def summarize(trace: list[dict[str, Any]], since_us: float = 0.0) -> dict[str, Any]:
    """ONNX Runtime's profile events from `since_us` on (µs after the profiler started; earlier ones are
    the warm-up's) -> time inside runs and per op type (µs in the trace, ms here)."""
    trace = [e for e in trace if float(e.get("ts", 0)) >= since_us]
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    per_op: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "nodes": 0})
    for e in trace:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name", "?")
        per_op[op]["ms"] += e["dur"] / 1000
        per_op[op]["nodes"] += 1
    run_ms = sum(e["dur"] for e in runs) / 1000
    n_runs = max(len(runs), 1)
    ops = {op: {"ms": round(v["ms"], 3), "share": round(v["ms"] / run_ms, 4) if run_ms else 0.0,
                "nodes_per_run": round(v["nodes"] / n_runs, 1)}
           for op, v in sorted(per_op.items(), key=lambda kv: -kv[1]["ms"])}
    kernel_ms = sum(v["ms"] for v in per_op.values())
    return {"runs": len(runs), "run_ms": round(run_ms, 3), "kernel_ms": round(kernel_ms, 3), "ops": ops}


def _profiler_clock_us(start_ns: int) -> float:
    """Microseconds since ONNX Runtime's profiler started, on the trace's own clock: its start time is read
    from the system clock (the epoch) on Linux builds, although the docstring says time.monotonic_ns(); the
    one of the two that puts `start_ns` shortly in the past is the one."""
    for clock in (time.time_ns, time.monotonic_ns):
        delta = clock() - start_ns
        if 0 <= delta < 10**15:  # under ~12 days
            return delta / 1000
    raise RuntimeError(f"ONNX Runtime's profiling start time {start_ns} ns matches neither clock")


def profile_workload(artifact: Path, workload: str, threads: int, folder: Path, warmup: int = 1) -> dict[str, Any]:
    from runtime.engine import LLMEngine
    from runtime.sampling import SamplingParams

    os.environ["OPTIMIZE_ORT_PROFILE"] = str(folder / f"ort-{workload}")
    try:
        engine = LLMEngine(artifact, threads=threads, enable_prefix_caching=False)
    finally:
        del os.environ["OPTIMIZE_ORT_PROFILE"]
    if not hasattr(engine.backend, "end_profiling"):
        raise SystemExit(f"{artifact}: not an onnxruntime/cpu artifact (its backend has no ONNX Runtime profiler)")
    n_new = WORKLOADS[workload][2]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    since_us = 0.0
    for round_ in range(warmup + 1):  # the warm-up rounds' events are left out (first-run allocations, faults)
        if round_ == warmup:
            since_us = _profiler_clock_us(engine.backend.session.get_profiling_start_time_ns())
        t0 = time.perf_counter()
        try:
            for i, p in enumerate(prompts(workload, engine.vocab_size)):
                engine.add_request(f"{workload}-{round_}-{i}", p, params)
        except ValueError as e:  # e.g. W2's 1,024-token prompt on an artifact built for 1,024 tokens in all
            return {"workload": workload, "not_run": str(e)}
        first = None
        steps = 0
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            if first is None and any(o.new_token_ids for o in outs):
                first = time.perf_counter() - t0
        wall = time.perf_counter() - t0
    path = engine.backend.end_profiling()
    trace = json.loads(Path(path).read_text(encoding="utf-8"))
    summary = summarize(trace, since_us)
    n, length, _ = WORKLOADS[workload]
    return {"workload": workload, "warmup_rounds": warmup, "prompts": n, "prompt_tokens": length, "new_tokens": n_new,
            "steps": steps,
            "wall_ms": round(wall * 1000, 1), "ttft_ms": round((first or wall) * 1000, 1),
            "outside_runs_ms": round(wall * 1000 - summary["run_ms"], 1), **summary}


def table(r: dict[str, Any], top: int) -> str:
    lines = [f"{r['workload']}: {r['prompts']} x {r['prompt_tokens']} prompt tokens, {r['new_tokens']} new; "
             f"{r['steps']} steps, wall {r['wall_ms']:.0f} ms (TTFT {r['ttft_ms']:.0f} ms), in session runs "
             f"{r['run_ms']:.0f} ms, outside {r['outside_runs_ms']:.0f} ms",
             f"  {'op type':<28}{'ms':>10}{'share':>8}{'nodes/run':>11}"]
    for op, v in list(r["ops"].items())[:top]:
        lines.append(f"  {op:<28}{v['ms']:>10.1f}{100 * v['share']:>7.1f}%{v['nodes_per_run']:>11.1f}")
    rest = list(r["ops"].values())[top:]
    if rest:
        lines.append(f"  {'(other op types)':<28}{sum(v['ms'] for v in rest):>10.1f}"
                     f"{100 * sum(v['share'] for v in rest):>7.1f}%")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="op types per table (the rest in one row)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="rounds of each workload run first and left out of the profile (0: profile the first run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    from bench.isa import cpu_name
    from runtime.kernels.paged_attention_cpu import kernel_paths

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in names:
            r = profile_workload(args.artifact, w, args.threads, Path(tmp), args.warmup)
            print(f"{w}: not run: {r['not_run']}" if "not_run" in r else table(r, args.top), flush=True)
            results.append(r)
    paths = kernel_paths()
    out = {"artifact": str(args.artifact), "cpu": cpu_name(), "kernel_isa": paths["isa"],
           "kernel_isa_source": paths["source"], "cpu_features": paths["cpu_features"],
           "threads": args.threads, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
