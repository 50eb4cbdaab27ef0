"""The C ops on each CPU code path this machine runs (avx512 / avx2 / baseline), and bf16 against float32.

For every path the CPU has (runtime/kernels/paged_attention_cpu.py `select_paths`; a path the CPU lacks is
listed as not measured, with the missing features), side by side in one run, rounds alternating between
the paths so load from other processes falls on all of them alike (median over rounds):

- ops, each in its own one-node ONNX Runtime session (threads: --threads): PagedAttention decode (8
  sequences x 1 token, 1024 past, 12 heads / 4 KV heads, head dim 64) and prefill (512 tokens, no past);
  SiluMul, QuantizeRows and SkipNormQuantize (beside the Mul + SkipSimplifiedLayerNormalization + QuantizeRows
  it replaces) on 1 and 512 rows; MatMulBf16 at M = 1 and 64 on a 4096 x 11008 weight (a 7B
  model's MLP shape: 180 MB in float32, 90 MB in bfloat16, both larger than a server CPU's last-level cache
  per core complex, so M = 1 reads from memory as a real model's decode does), beside ONNX Runtime's own
  float32 MatMul on the same weight (MLAS; the same for every path);
- the demo model (models/pycode-llama-6m) built with recipes/demo.yaml (float32) and recipes/demo-bf16.yaml
  (target.matmul: bfloat16), one batch-1 decode step at 256 past tokens, per path.

Prints one table per path and a ratio table, writes JSON to bench/results/isa.json, and exits 1 when a
bfloat16 row is more than 10% slower than its float32 row on any path (MatMulBf16 M = 1 against the
float32 MatMul, and the demo's bf16 decode step against its float32 step): batch-1 decode reads half the
weight bytes in bf16, so it must not be slower. Timings on a loaded machine are noisy: run it on a quiet
one, and read the ratios, which are measured in the same rounds.

    python bench/isa.py [--rounds 7] [--threads 2] [--out bench/results] [--no-demo]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MARGIN = 1.10  # bf16 may be at most this much slower than float32 before the run fails
BF16_SHAPE = (4096, 11008)  # MatMulBf16's weight: larger than the last-level cache in bf16 as in float32


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _session(model: Any, threads: int, isa: str | None) -> Any:
    import onnxruntime as ort

    from runtime.kernels import paged_attention_cpu as pk

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_cpu_mem_arena = False
    if isa is not None:
        pk.register(so, isa=isa)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any] | None = None) -> Any:
    from onnx import helper

    graph = helper.make_graph(nodes, "bench", inputs, outputs, inits or [])
    # IR 10: what every supported ONNX Runtime (>= 1.20) reads; make_model would write the installed onnx's newest
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("optimize", 1), helper.make_opsetid("com.microsoft", 1)])


def op_cases(rng: np.random.Generator) -> dict[str, tuple[Any, dict[str, np.ndarray], bool]]:
    """name -> (one-node model, feeds, uses the package's ops)."""
    from onnx import TensorProto, helper, numpy_helper

    from compiler.fusion.matmul_bf16 import pack_bf16

    f = helper.make_tensor_value_info
    out: dict[str, tuple[Any, dict[str, np.ndarray], bool]] = {}
    h, kvh, d, bs = 12, 4, 64, 16
    for name, b, past, new in (("attention decode b8 ctx1024", 8, 1024, 1), ("attention prefill 512", 1, 0, 512)):
        per_seq = -(-(past + new) // bs)
        nb = b * per_seq
        node = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "cu", "past", "bt"], ["o"],
                                domain="optimize", num_heads=h, kv_num_heads=kvh, scale=d ** -0.5,
                                local_window_size=-1)
        inputs = [f("q", TensorProto.FLOAT, ["T", h * d]), f("k", TensorProto.FLOAT, ["T", kvh * d]),
                  f("v", TensorProto.FLOAT, ["T", kvh * d]), f("kc", TensorProto.FLOAT, [nb, bs, kvh, d]),
                  f("vc", TensorProto.FLOAT, [nb, bs, kvh, d]), f("cu", TensorProto.INT32, [b + 1]),
                  f("past", TensorProto.INT32, [b]), f("bt", TensorProto.INT32, [b, per_seq])]
        t = b * new
        feeds = {"q": rng.standard_normal((t, h * d), dtype=np.float32),
                 "k": rng.standard_normal((t, kvh * d), dtype=np.float32),
                 "v": rng.standard_normal((t, kvh * d), dtype=np.float32),
                 "kc": rng.standard_normal((nb, bs, kvh, d), dtype=np.float32),
                 "vc": rng.standard_normal((nb, bs, kvh, d), dtype=np.float32),
                 "cu": (np.arange(b + 1) * new).astype(np.int32), "past": np.full(b, past, np.int32),
                 "bt": np.arange(nb, dtype=np.int32).reshape(b, per_seq)}
        out[name] = (_model([node], inputs, [f("o", TensorProto.FLOAT, [t, h * d])]), feeds, True)
    for rows in (1, 512):
        x = rng.standard_normal((rows, 2 * 2048), dtype=np.float32)
        node = helper.make_node("SiluMul", ["x"], ["y"], domain="optimize")
        out[f"SiluMul {rows} x 2048"] = (_model([node], [f("x", TensorProto.FLOAT, [rows, 4096])],
                                                [f("y", TensorProto.FLOAT, [rows, 2048])]), {"x": x}, True)
        x = rng.standard_normal((rows, 2048), dtype=np.float32)
        node = helper.make_node("QuantizeRows", ["x"], ["q", "s"], domain="optimize")
        out[f"QuantizeRows {rows} x 2048"] = (_model([node], [f("x", TensorProto.FLOAT, [rows, 2048])],
                                                     [f("q", TensorProto.UINT8, [rows, 2048]),
                                                      f("s", TensorProto.FLOAT, [rows, 1])]), {"x": x}, True)
        feeds = {"x": x, "skip": rng.standard_normal((rows, 2048), dtype=np.float32),
                 "gamma": rng.standard_normal(2048, dtype=np.float32),
                 "s": np.abs(rng.standard_normal((rows, 1), dtype=np.float32)) / 127}
        ins = [f("x", TensorProto.FLOAT, [rows, 2048]), f("skip", TensorProto.FLOAT, [rows, 2048]),
               f("gamma", TensorProto.FLOAT, [2048]), f("s", TensorProto.FLOAT, [rows, 1])]
        outs = [f("q", TensorProto.UINT8, [rows, 2048]), f("scale", TensorProto.FLOAT, [rows, 1]),
                f("sum", TensorProto.FLOAT, [rows, 2048])]
        node = helper.make_node("SkipNormQuantize", ["x", "skip", "gamma", "s"], ["q", "scale", "sum"],
                                domain="optimize", epsilon=1e-5)
        out[f"SkipNormQuantize {rows} x 2048"] = (_model([node], ins, outs), feeds, True)
        three = [helper.make_node("Mul", ["x", "s"], ["xs"]),
                 helper.make_node("SkipSimplifiedLayerNormalization", ["xs", "skip", "gamma"], ["n", "", "", "sum"],
                                  domain="com.microsoft", epsilon=1e-5),
                 helper.make_node("QuantizeRows", ["n"], ["q", "scale"], domain="optimize")]
        out[f"Mul + SkipSimplifiedLayerNorm + QuantizeRows {rows} x 2048"] = (_model(three, ins, outs), feeds, True)
    k, n = BF16_SHAPE
    w = (rng.standard_normal((k, n), dtype=np.float32) * 0.02).astype(np.float32)
    packed = pack_bf16(w)
    wt = TensorProto(name="w", data_type=TensorProto.BFLOAT16, dims=list(packed.shape))
    wt.raw_data = packed.tobytes()
    for m in (1, 64):
        a = rng.standard_normal((m, k), dtype=np.float32)
        node = helper.make_node("MatMulBf16", ["a", "w"], ["y"], domain="optimize", n=n)
        out[f"MatMulBf16 M{m} {k}x{n}"] = (_model([node], [f("a", TensorProto.FLOAT, [m, k])],
                                                  [f("y", TensorProto.FLOAT, [m, n])], [wt]), {"a": a}, True)
        node = helper.make_node("MatMul", ["a", "w32"], ["y"])
        out[f"MatMul float32 M{m} {k}x{n}"] = (_model([node], [f("a", TensorProto.FLOAT, [m, k])],
                                                      [f("y", TensorProto.FLOAT, [m, n])],
                                                      [numpy_helper.from_array(w, "w32")]), {"a": a}, False)
    return out


def _time_run(fn: Any, min_s: float = 0.2, min_runs: int = 3) -> float:
    """Median seconds of one call, over at least min_runs calls and min_s seconds."""
    fn()  # warm-up
    runs: list[float] = []
    start = time.perf_counter()
    while len(runs) < min_runs or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def build_demo(folder: Path) -> dict[str, Path]:
    """recipes/demo.yaml and recipes/demo-bf16.yaml built into folder (no autotune: the rule table)."""
    from compiler.build import build

    return {dtype: build(ROOT / "recipes" / recipe, progress=False, output=folder, autotune=False)
            for dtype, recipe in (("float32", "demo.yaml"), ("bfloat16", "demo-bf16.yaml"))}


def demo_runners(artifacts: dict[str, Path], paths: list[str], threads: int) -> dict[tuple[str, str], Any]:
    from runtime.artifact import Artifact
    from runtime.backends.onnxruntime import OnnxRuntimeBackend
    from runtime.forward_batch import ForwardBatch

    past, bs = 256, 16
    per_seq = -(-(past + 1) // bs)
    table = np.arange(per_seq, dtype=np.int32)[None, :]
    fb = ForwardBatch(input_ids=np.array([5], np.int64), positions=np.array([past], np.int64),
                      cu_seqlens=np.array([0, 1], np.int32), past_lens=np.array([past], np.int32), block_table=table,
                      slot_mapping=np.array([table[0, past // bs] * bs + past % bs], np.int64),
                      logits_index=np.array([0], np.int64))
    out = {}
    for dtype, path in artifacts.items():
        art = Artifact.open(path, verify=False)
        for isa in paths:
            backend = OnnxRuntimeBackend(art.model_path, art.runtime_config, num_blocks=per_seq + 1,
                                         intra_op_threads=threads, cpu_isa=isa)
            out[(dtype, isa)] = (lambda b=backend: b.forward(fb))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--no-demo", action="store_true", help="ops only (no demo builds)")
    args = ap.parse_args()

    from runtime.kernels import paged_attention_cpu as pk

    host = pk.select_paths()  # the CPU's own choice
    paths = list(host["available"])
    lacking = {}
    for isa in pk.ISA_PATHS:
        if isa not in paths:
            try:
                pk.select_paths(isa)
            except pk.KernelLibraryError as e:
                lacking[isa] = str(e).split("lacks ", 1)[-1]
    print(f"CPU: {cpu_name()}; features {', '.join(host['cpu_features'])}; "
          f"paths measured: {', '.join(paths)}; default {host['isa']}", flush=True)
    for isa, why in lacking.items():
        print(f"  {isa}: not measured, this CPU lacks {why}")

    rng = np.random.default_rng(0)
    cases = op_cases(rng)
    calls: dict[tuple[str, str], Any] = {}
    for name, (model, feeds, ours) in cases.items():
        for isa in (paths if ours else [None]):
            sess = _session(model, args.threads, isa)
            calls[(name, isa or "-")] = (lambda s=sess, fd=feeds: s.run(None, fd))
    demo: dict[tuple[str, str], Any] = {}
    tmp = tempfile.TemporaryDirectory(prefix="optimize-bench-isa-")
    if not args.no_demo:
        print("building the demo (float32 and bfloat16) ...", flush=True)
        demo = demo_runners(build_demo(Path(tmp.name)), paths, args.threads)

    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for key, fn in list(calls.items()) + [((f"demo decode step {d}", isa), fn) for (d, isa), fn in demo.items()]:
            samples.setdefault(key, []).append(_time_run(fn))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    ms = {key: 1000 * statistics.median(v) for key, v in samples.items()}
    tmp.cleanup()

    names = list(dict.fromkeys(k[0] for k in ms))
    cols = paths + ["-"]
    print(f"\nms per call (median of {args.rounds} rounds; threads {args.threads}; '-': ONNX Runtime's own op)")
    print(f"{'op':36s}" + "".join(f"{c:>12s}" for c in cols))
    for n in names:
        print(f"{n:36s}" + "".join(f"{ms[(n, c)]:12.3f}" if (n, c) in ms else f"{'':12s}" for c in cols))

    checks = []
    k, nn = BF16_SHAPE
    for isa in paths:
        checks.append({"path": isa, "what": f"MatMulBf16 M1 vs float32 MatMul M1 ({k}x{nn})",
                       "bf16_ms": ms[(f"MatMulBf16 M1 {k}x{nn}", isa)], "fp32_ms": ms[(f"MatMul float32 M1 {k}x{nn}", "-")]})
        if demo:
            checks.append({"path": isa, "what": "demo decode step, batch 1, 256 past",
                           "bf16_ms": ms[("demo decode step bfloat16", isa)],
                           "fp32_ms": ms[("demo decode step float32", isa)]})
    print(f"\nbf16 / float32 time (fails above {MARGIN:.2f})")
    failed = False
    for c in checks:
        c["ratio"] = round(c["bf16_ms"] / c["fp32_ms"], 3)
        c["ok"] = c["ratio"] <= MARGIN
        failed |= not c["ok"]
        print(f"  {c['path']:9s} {c['what']:52s} {c['bf16_ms']:9.3f} / {c['fp32_ms']:9.3f} ms = {c['ratio']:.2f}"
              f"{'' if c['ok'] else '  SLOWER'}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu_name(), "cpu_features": host["cpu_features"],
              "paths": paths, "not_measured": lacking, "default": host["isa"], "threads": args.threads,
              "rounds": args.rounds, "ms": {f"{n} [{c}]": round(v, 4) for (n, c), v in ms.items()},
              "bf16_vs_fp32": checks, "margin": MARGIN}
    (args.out / "isa.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'isa.json'}")
    if failed:
        print(f"FAILED: a bfloat16 row is more than {100 * (MARGIN - 1):.0f}% slower than float32", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
