"""Three `optimize serve` replicas behind vllm-router: round-robin vs cache-aware vs kv-aware routing on
a multi-tenant workload with shared system prompts, in one run.

Workload (the same for every policy, seeded): 8 tenants, each with its own ~400-token system prompt;
200 requests = a tenant's system prompt + a short question of its own, arriving as a Poisson process
(--rate requests/s), streamed, greedy, 32 output tokens. Each replica gets a KV pool smaller than
all 8 system prompts together (--num-kv-blocks, 120 blocks of 16 tokens by default: about 4.5
prompts), the regime where routing decides whether a prompt is still cached where it lands.

For each policy, the replicas start afresh (empty caches) and a vllm-router with that policy in front
of them (kv_aware reads the replicas' --kv-events); then the workload runs through the router.
Reported per policy: prefix-cache hit rate (prompt tokens served from cache / prompt tokens, summed
over the replicas' /metrics), TTFT p50/p99 (client side, first streamed token), throughput (output
tokens/s over the run), and per-replica load (requests each replica finished; max/mean). Prints a
table and writes JSON (bench/results/replicas.json). Numbers are comparable within one run only.

    PYTHONPATH=. python bench/replicas.py ARTIFACT [--requests 200] [--rate 4] [--num-kv-blocks 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Tokenizer

from runtime.kv_events import free_port_pair
from runtime.metrics import parse_prometheus

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("round_robin", "cache_aware", "kv_aware")
WORDS = ("parse", "render", "token", "buffer", "stream", "config", "handler", "cache", "block", "queue",
         "worker", "schedule", "request", "reply", "tensor", "layer", "weight", "shape", "index", "batch")



def system_prompt(tenant: int, tok: Tokenizer, target: int = 400) -> str:
    rng = random.Random(1000 + tenant)
    lines = [f"# Tenant {tenant} assistant. House rules follow.\n"]
    while len(tok.encode("".join(lines)).ids) < target:
        lines.append(f"# rule {len(lines)}: {' '.join(rng.choice(WORDS) for _ in range(8))}\n")
    return "".join(lines)


def workload(n: int, rate: float, tok: Tokenizer, seed: int = 0) -> list[tuple[float, int, str]]:
    """(arrival s, tenant, prompt) for n requests, Poisson arrivals."""
    rng = random.Random(seed)
    systems = [system_prompt(t, tok) for t in range(8)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tenant = rng.randrange(8)
        question = f"def {rng.choice(WORDS)}_{i}({rng.choice(WORDS)}, {rng.choice(WORDS)}):\n"
        out.append((t, tenant, systems[tenant] + question))
    return out


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def wait_for(url: str, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if get(url)[0] == 200:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout} s")


class Replicas:
    def __init__(self, artifact: str, n: int, num_kv_blocks: int) -> None:
        self.artifact, self.num_kv_blocks = artifact, num_kv_blocks
        self.ports = [free_port_pair() for _ in range(n)]
        self.kv_ports = [free_port_pair() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "compiler.cli", "serve", self.artifact, "--port", str(p), "--threads", "1",
             "--num-kv-blocks", str(self.num_kv_blocks), "--kv-events", f"tcp://127.0.0.1:{k}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for p, k in zip(self.ports, self.kv_ports,
                                                                                          strict=True)]
        for url, proc in zip(self.urls, self.procs, strict=True):
            wait_for(url + "/ready", proc, f"replica {url}")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def counters(self) -> list[dict[str, float]]:
        out = []
        for url in self.urls:
            flat = {k.split("{")[0] + ("{" + k.split("{")[1].split(",")[0] + "}" if "finish_reason" in k else ""): v
                    for k, v in parse_prometheus(get(url + "/metrics")[1]).items() if k.startswith("optimize_")}
            out.append({"hits": flat.get("optimize_prefix_cache_hits_total", 0.0),
                        "queries": flat.get("optimize_prefix_cache_queries_total", 0.0),
                        "requests": flat.get("optimize_e2e_request_latency_seconds_count", 0.0)})
        return out


def start_router(policy: str, reps: Replicas, model: str) -> tuple[subprocess.Popen, int]:
    port, prom = free_port_pair(), free_port_pair()
    cmd = [shutil.which("vllm-router") or "vllm-router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *reps.urls, "--policy", policy, "--prometheus-port", str(prom),
           "--health-check-interval-secs", "1", "--log-level", "warning"]
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", model]
        for url, k in zip(reps.urls, reps.kv_ports, strict=True):
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{k}",
                    "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{k + 1}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(f"http://127.0.0.1:{port}/v1/models", proc, f"vllm-router ({policy})")
    return proc, port


async def one(session: aiohttp.ClientSession, port: int, model: str, prompt: str, delay: float,
              t0: float) -> tuple[float | None, int]:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True,
            "ignore_eos": True}
    ttft, tokens = None, 0
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return None, 0
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    return None, tokens
                if event["choices"] and event["choices"][0].get("text"):
                    tokens += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
    return ttft, tokens


async def drive(port: int, model: str, work: list[tuple[float, int, str]]) -> tuple[list[Any], float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(s, port, model, p, at, t0) for at, _, p in work))
        return list(results), time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--num-kv-blocks", type=int, default=120, help="KV blocks per replica")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "replicas.json")
    args = ap.parse_args()
    manifest = json.loads((Path(args.artifact) / "manifest.json").read_text(encoding="utf-8"))
    model = str(manifest["name"])
    tok = Tokenizer.from_file(str(Path(args.artifact) / "tokenizer" / "tokenizer.json"))
    work = workload(args.requests, args.rate, tok)
    reps = Replicas(args.artifact, args.replicas, args.num_kv_blocks)
    rows: dict[str, dict[str, Any]] = {}
    for policy in args.policies.split(","):
        reps.start()
        router, port = start_router(policy, reps, model)
        try:
            before = reps.counters()
            results, wall = asyncio.run(drive(port, model, work))
            after = reps.counters()
        finally:
            router.terminate()
            router.wait(10)
            reps.stop()
        ttfts = [t for t, _ in results if t is not None]
        hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
        queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
        load = [int(a["requests"] - b["requests"]) for a, b in zip(after, before, strict=True)]
        rows[policy] = {"ok": len(ttfts), "failed": len(results) - len(ttfts),
                        "prefix_hit_rate": hits / queries if queries else 0.0,
                        "ttft_p50_ms": statistics.median(ttfts) * 1e3 if ttfts else None,
                        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3 if ttfts else None,
                        "throughput_tok_s": sum(n for _, n in results) / wall, "wall_s": wall,
                        "per_replica_requests": load,
                        "load_max_over_mean": max(load) / statistics.fmean(load) if any(load) else None}
        r = rows[policy]
        print(f"{policy}: done ({r['ok']} ok, {r['failed']} failed, {wall:.1f} s)", file=sys.stderr)
    base = rows.get("round_robin")
    print(f"{'policy':12} {'ok':>4} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} "
          f"{'per replica':>14} {'max/mean':>8}  vs round_robin (hit, TTFT p50)")
    for policy, r in rows.items():
        rel = ""
        if base and base["prefix_hit_rate"] and base["ttft_p50_ms"] and r["ttft_p50_ms"]:
            rel = f"{r['prefix_hit_rate'] / base['prefix_hit_rate']:.2f}x, {r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x"
        print(f"{policy:12} {r['ok']:4d} {r['prefix_hit_rate']:9.3f} {r['ttft_p50_ms'] or 0:8.1f}ms "
              f"{r['ttft_p99_ms'] or 0:8.1f}ms {r['throughput_tok_s']:7.1f} {str(r['per_replica_requests']):>14} "
              f"{r['load_max_over_mean'] or 0:8.2f}  {rel}")
    print(f"{args.replicas} replicas x {args.num_kv_blocks} KV blocks, {args.requests} requests at {args.rate}/s, "
          f"8 tenants; CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows,
                                    "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                                   indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
