"""Two configurations of the peer benchmark head to head, in paired rounds that alternate their order.

On a small shared machine the speed of every engine drifts by up to a third from one minute to the
next, and `run_peers.py run` runs its configurations one after another, so two of them in one run can
land on different sides of a drift. This bench calls `../shared/peers/run_peers.py run` once per
configuration per round, A then B in even rounds and B then A in odd ones, and reports both series,
their medians and the median of the per-round ratios A/B (each ratio compares runs a minute apart).
Prints a table and writes JSON (default bench/results/peers_paired.json).

A side is `engine:precision` or `engine:precision:variant` as run_peers.py names them (`optimize:int8`,
`openvino:int4`, `llama.cpp:f32`, `openvino:fp32:f32`). The environment is run_peers.py's (PEERS_HOME,
OPTIMIZE_PY, OPTIMIZE_BIN, OPTIMIZE_RECIPES, OV_PY, ...); `OPTIMIZE_CPU_ISA` reaches our engine through it.
A side named without a variant runs every variant run_peers.py has for that engine and precision
(`openvino:fp32` also runs `openvino:fp32:f32`); only the side's own result is read.

    python bench/peers_paired.py W2 optimize:int8 openvino:int4 [--rounds 10] [--model llama-110m]
        [--peers ../shared/peers]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_json  # noqa: E402

METRIC = {"W1": ("decode_tok_s", 1.0, "decode tok/s"), "W2": ("ttft_s", 1e3, "TTFT ms"),
          "W3": ("throughput_tok_s", 1.0, "tok/s")}


def parse_side(spec: str) -> dict[str, str]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise SystemExit(f"{spec!r}: a side is engine:precision or engine:precision:variant")
    return {"engine": parts[0], "precision": parts[1], "variant": parts[2] if len(parts) == 3 else ""}


def run_once(peers: Path, side: dict[str, str], model: str, workload: str, folder: Path, tag: str) -> float:
    """One run_peers.py run of one configuration; its workload metric (W2 in ms)."""
    out = folder / f"{tag}.json"
    env = dict(os.environ)
    if side["engine"] == "optimize":  # run_peers.py takes our precisions from the environment
        env["OPTIMIZE_PRECISIONS"] = side["precision"]
    engine = side["engine"] + (f"-{side['variant']}" if side["variant"] else "")
    cmd = [sys.executable, "run_peers.py", "run", "--models", model, "--engines", engine,
           "--precisions", side["precision"], "--workloads", workload, "--out", str(out)]
    res = subprocess.run(cmd, cwd=peers, env=env, capture_output=True, text=True)
    if res.returncode != 0 or not out.is_file():
        raise SystemExit(f"run_peers.py failed for {side}: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    key, scale, _ = METRIC[workload]
    for r in json.loads(out.read_text(encoding="utf-8"))["results"]:
        if (r.get("ok") and r["engine"] == side["engine"] and r["precision"] == side["precision"]
                and r.get("variant", "") == side["variant"] and r["workload"] == workload):
            return float(r[key]) * scale
    raise SystemExit(f"no successful {workload} result for {side} in {out}")


def paired(peers: Path, a: dict[str, str], b: dict[str, str], model: str, workload: str, rounds: int,
           folder: Path) -> dict[str, Any]:
    values: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(rounds):
        for name in (("a", "b") if r % 2 == 0 else ("b", "a")):
            side = a if name == "a" else b
            values[name].append(run_once(peers, side, model, workload, folder, f"{name}-{r}"))
    ratios = [x / y for x, y in zip(values["a"], values["b"], strict=True)]
    return {"a": values["a"], "b": values["b"], "median_a": statistics.median(values["a"]),
            "median_b": statistics.median(values["b"]), "ratios_a_over_b": ratios,
            "median_ratio_a_over_b": statistics.median(ratios)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(METRIC))
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--model", default="llama-110m")
    ap.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "peers_paired.json")
    args = ap.parse_args()
    if not (args.peers / "run_peers.py").is_file():
        raise SystemExit(f"{args.peers}: no run_peers.py (pass --peers)")
    a, b = parse_side(args.a), parse_side(args.b)
    with tempfile.TemporaryDirectory(prefix="peers-paired-") as tmp:
        result = paired(args.peers.resolve(), a, b, args.model, args.workload, args.rounds, Path(tmp))
    unit = METRIC[args.workload][2]
    result = {"workload": args.workload, "unit": unit, "model": args.model, "a_side": args.a, "b_side": args.b,
              "rounds": args.rounds, "cpu_isa": os.environ.get("OPTIMIZE_CPU_ISA", "widest"), **result}
    print(f"{args.workload} {unit}, {args.rounds} paired rounds (order alternating)")
    print(f"{'round':<8}{args.a:>24}{args.b:>24}{'A/B':>8}")
    for i, (x, y, q) in enumerate(zip(result["a"], result["b"], result["ratios_a_over_b"], strict=True)):
        print(f"{i:<8}{x:>24.1f}{y:>24.1f}{q:>8.3f}")
    print(f"{'median':<8}{result['median_a']:>24.1f}{result['median_b']:>24.1f}{result['median_ratio_a_over_b']:>8.3f}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
