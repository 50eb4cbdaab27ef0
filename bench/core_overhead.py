"""Per-step overhead of the engine core, C vs. the Python twin, in one run.

1. Scheduler: 16 / 64 / 256 running sequences, each with a 1-2k-token context (prompts of random
   length in [1024, 2048), prefilled first), in steady decode. Per step: schedule() + pack() (the
   target: < 100 us at 256 sequences, C >= 10x the twin), and update() separately. Prefix caching
   on (the default), so update() also hashes the blocks that fill up.
2. Sampler: logits float32 [B, V] (normal, sd 3) for V = 32k and 152k, B = 1 and 64; greedy;
   temperature 0.8 with top-k 50; temperature 0.8 with top-p 0.95 (a full softmax, a sort of the
   nucleus - a few thousand tokens with these logits - one draw per row).

Medians over repeated steps/calls. Prints a table and writes JSON
(bench/results/core_overhead.json by default). Run it on a quiet machine.

    python bench/core_overhead.py [--out bench/results/core_overhead.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from runtime.core import reference
from runtime.core._cwrap import Scheduler as CScheduler
from runtime.sampling import Sampler, SamplingParams, make_generator

ROOT = Path(__file__).resolve().parents[1]


def _prepared(cls, n: int, seed: int):
    """A scheduler with n sequences of 1-2k prompt tokens, all prefilled and decoding."""
    rng = np.random.default_rng(seed)
    cfg = reference.SchedulerConfig(block_size=16, num_blocks=n * 132 + 64, max_num_seqs=n,
                                    max_num_batched_tokens=8192, max_model_len=4096, prefix_cache_seed=seed)
    s = cls(cfg)
    for i in range(n):
        s.add(i, rng.integers(0, 32000, int(rng.integers(1024, 2048))).tolist())
    while True:
        b = s.schedule()
        s.update(b, {e.seq_id: 7 for e in b.entries if e.needs_logits})
        if all(e.num_tokens == 1 for e in b.entries) and len(b.entries) == n:
            return s


def bench_scheduler(n: int, steps: int, seed: int = 0) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, cls in (("c", CScheduler), ("python", reference.Scheduler)):
        s = _prepared(cls, n, seed)
        tokens = {i: 11 for i in range(n)}
        k = steps if name == "c" else max(5, steps // 20)
        sp, up = [], []
        for i in range(k + 5):
            t0 = time.perf_counter_ns()
            b = s.schedule()
            fb = s.pack(b)
            t1 = time.perf_counter_ns()
            s.update(b, tokens)
            t2 = time.perf_counter_ns()
            if fb.num_seqs != n or fb.num_tokens != n:
                raise RuntimeError(f"expected a decode step of {n} sequences, got {fb.num_seqs} / {fb.num_tokens} tokens")
            if i >= 5:
                sp.append((t1 - t0) / 1e3)
                up.append((t2 - t1) / 1e3)
        out[f"{name}_schedule_pack_us"] = statistics.median(sp)
        out[f"{name}_update_us"] = statistics.median(up)
        out[f"{name}_steps_timed"] = k
        ctx = [len(s.seq_tokens(i)) for i in range(n)]
        out["context_min"], out["context_max"] = min(ctx), max(ctx)
    out["speedup_schedule_pack"] = out["python_schedule_pack_us"] / out["c_schedule_pack_us"]
    return out


MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "t=0.8 top_k=50": SamplingParams(temperature=0.8, top_k=50),
    "t=0.8 top_p=.95": SamplingParams(temperature=0.8, top_p=0.95),
}


def bench_sampler(vocab: int, batch: int, mode: str, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(vocab + batch)
    logits = (rng.normal(size=(batch, vocab)) * 3).astype(np.float32)
    params = MODES[mode]
    out: dict[str, float] = {}
    tokens = {}
    for name in ("c", "python"):
        sampler = Sampler(name)
        gens = [make_generator(i) for i in range(batch)]
        k = reps if name == "c" else max(2, reps // 10)
        times = []
        for i in range(k + 1):
            t0 = time.perf_counter_ns()
            tok = sampler.sample(logits, [params] * batch, gens)
            dt = (time.perf_counter_ns() - t0) / 1e3
            if i:
                times.append(dt)
            else:
                tokens[name] = tok
        out[f"{name}_us"] = statistics.median(times)
    if not np.array_equal(tokens["c"], tokens["python"]):
        raise RuntimeError("C and twin sampled different tokens")
    out["speedup"] = out["python_us"] / out["c_us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/core_overhead.json")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = ap.parse_args()
    steps = 40 if args.quick else 400
    result: dict[str, object] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "load_avg_at_start": os.getloadavg()},
        "scheduler": [], "sampler": [],
    }
    print("schedule + pack per step (steady decode, block_size 16, prefix caching on)")
    print(f"{'seqs':>5} {'context':>11} {'C us':>8} {'twin us':>9} {'x':>6} {'C update':>9} {'twin update':>12}")
    for n in (16, 64, 256):
        r = bench_scheduler(n, steps)
        result["scheduler"].append({"seqs": n, **r})  # type: ignore[union-attr]
        print(f"{n:>5} {r['context_min']:>5}-{r['context_max']:<5} {r['c_schedule_pack_us']:>8.1f} "
              f"{r['python_schedule_pack_us']:>9.1f} {r['speedup_schedule_pack']:>6.1f} {r['c_update_us']:>9.1f} "
              f"{r['python_update_us']:>12.1f}")
    print("\nsampling per call (float32 logits)")
    print(f"{'vocab':>7} {'batch':>5} {'mode':>14} {'C us':>10} {'twin us':>11} {'x':>6}")
    for vocab in (32000, 152064):
        for batch in (1, 64):
            for mode in MODES:
                reps = (30 if batch == 1 else 8) if not args.quick else 3
                r = bench_sampler(vocab, batch, mode, reps)
                result["sampler"].append({"vocab": vocab, "batch": batch, "mode": mode, **r})  # type: ignore[union-attr]
                print(f"{vocab:>7} {batch:>5} {mode:>14} {r['c_us']:>10.1f} {r['python_us']:>11.1f} {r['speedup']:>6.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
