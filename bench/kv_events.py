"""Engine step time with KV-cache events on and off, at 64 running sequences, in one run.

Two engines on one artifact (the demo by default), identical but for `--kv-events`: in one the
scheduler logs its prefix-cache changes and every step's log goes to a real KVEventPublisher (ZeroMQ
PUB on 127.0.0.1, a subscriber connected and reading), as `optimize serve --kv-events` does; the
other logs nothing. Each holds 64 sequences in steady decode (prompts of 200-400 tokens from 8
shared prefixes, so blocks fill, get cached and are announced every few steps). Windows of steps
alternate between the two engines so machine noise hits both alike; the table shows median and mean
step times (full LLMEngine.step(): schedule, pack, forward, sample, update, plus the event drain)
and the ratio on / off. Then the core alone (C scheduler, 64 sequences of 1-2k tokens in steady
decode, block size 16): schedule + pack + update, plus kv_events() with events on, median per step,
where the difference is not lost in the forward's noise. Prints tables and writes JSON
(bench/results/kv_events.json).

    PYTHONPATH=. python bench/kv_events.py ARTIFACT [--windows 12] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from runtime.core import reference
from runtime.core._cwrap import Scheduler as CScheduler
from runtime.engine import LLMEngine
from runtime.kv_events import KVEventPublisher, free_port_pair
from runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
N = 64



def _engine(artifact: str, events: bool) -> tuple[LLMEngine, KVEventPublisher | None]:
    engine = LLMEngine(artifact, max_num_seqs=N, num_blocks=N * 40 + 64, max_num_batched_tokens=2048, threads=1)
    pub = None
    if events:
        engine.scheduler.enable_kv_events()
        pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port_pair()}", engine.scheduler_config.block_size)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, engine.vocab_size) for _ in range(160)] for _ in range(8)]
    for i in range(N):
        tail = [rng.randrange(3, engine.vocab_size) for _ in range(rng.randrange(40, 240))]
        engine.add_request(f"r{i}", prefixes[i % 8] + tail,
                           SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    while engine.scheduler.num_running < N or engine.scheduler.num_waiting:  # prefill everyone
        engine.step()
        if pub is not None:
            pub.put(engine.scheduler.kv_events())
    for _ in range(3):
        engine.step()
    return engine, pub


def _window(engine: LLMEngine, pub: KVEventPublisher | None, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        if pub is not None:
            pub.put(engine.scheduler.kv_events())  # what AsyncEngine does after every step
        out.append(time.perf_counter() - t0)
    return out


def core_step_us(events: bool, steps: int = 3000, seed: int = 0) -> float:
    """Median microseconds of schedule + pack + update (+ kv_events()) per decode step, 64 sequences."""
    rng = np.random.default_rng(seed)
    cfg = reference.SchedulerConfig(block_size=16, num_blocks=N * 132 + 64, max_num_seqs=N,
                                    max_num_batched_tokens=8192, max_model_len=4096, prefix_cache_seed=seed)
    s = CScheduler(cfg)
    if events:
        s.enable_kv_events()
    for i in range(N):
        s.add(i, rng.integers(0, 32000, int(rng.integers(1024, 2048))).tolist())
    while True:
        b = s.schedule()
        s.update(b, {e.seq_id: 7 for e in b.entries if e.needs_logits})
        s.kv_events()
        if all(e.num_tokens == 1 for e in b.entries) and len(b.entries) == N:
            break
    times = []
    nbytes = 0
    for k in range(steps):
        t0 = time.perf_counter_ns()
        b = s.schedule()
        s.pack(b)
        s.update(b, {i: 11 + (k + i) % 97 for i in range(N)})
        if events:
            nbytes += len(s.kv_events())
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv_events.json")
    args = ap.parse_args()
    off, _ = _engine(args.artifact, False)
    on, pub = _engine(args.artifact, True)
    assert pub is not None
    received = [0]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.pub_endpoint)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if sub.poll(50):
                sub.recv_multipart()
                received[0] += 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    times: dict[str, list[float]] = {"off": [], "on": []}
    published_before = pub.published
    for w in range(args.windows):
        order = (("off", off, None), ("on", on, pub)) if w % 2 == 0 else (("on", on, pub), ("off", off, None))
        for name, engine, p in order:
            times[name] += _window(engine, p, args.steps)
    time.sleep(0.5)
    stop.set()
    reader.join()
    sub.close(0)
    ctx.term()
    batches = pub.published - published_before
    pub.close()
    row = {name: {"median_ms": statistics.median(t) * 1e3, "mean_ms": statistics.fmean(t) * 1e3, "steps": len(t)}
           for name, t in times.items()}
    ratio_median = row["on"]["median_ms"] / row["off"]["median_ms"]
    ratio_mean = row["on"]["mean_ms"] / row["off"]["mean_ms"]
    print(f"{'events':8} {'median ms':>10} {'mean ms':>10} {'steps':>6}")
    for name in ("off", "on"):
        r = row[name]
        print(f"{name:8} {r['median_ms']:10.3f} {r['mean_ms']:10.3f} {r['steps']:6d}")
    print(f"on / off: median {ratio_median:.3f}, mean {ratio_mean:.3f}; {batches} event batches published "
          f"during the measured windows, {received[0]} received by the subscriber; "
          f"{N} running sequences; CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    core = {"off_us": [], "on_us": []}
    for _ in range(3):  # alternate, so noise hits both
        core["off_us"].append(core_step_us(False))
        core["on_us"].append(core_step_us(True))
    off_us, on_us = statistics.median(core["off_us"]), statistics.median(core["on_us"])
    print(f"core alone (C): schedule + pack + update per step {off_us:.1f} us, with the event log and its drain "
          f"{on_us:.1f} us ({on_us - off_us:+.1f} us, {(on_us - off_us) / (row['off']['median_ms'] * 1e3):+.4%} of "
          f"the measured engine step)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"running_sequences": N, "rows": row, "ratio_median": ratio_median,
                                    "ratio_mean": ratio_mean, "batches_published": batches,
                                    "core_off_us": off_us, "core_on_us": on_us,
                                    "cpu": platform.processor() or platform.machine(),
                                    "cores": os.cpu_count()}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
