"""GPU targets on the demo model: greedy tokens against the CPU artifact, decode speed with and without
CUDA graphs, time to first token at 512 prompt tokens. The table of tests/gpu/run.sh.

For each GPU target (torch/cuda float32, float16 and FP8 weights with the rule table's Triton paged
attention, float16 with the decomposed attention for comparison, onnxruntime/cuda float16 and INT4
weights, tensorrt/cuda float16) whose packages and GPU are present (runtime/gpu.py `missing_for`), the demo is built from a
recipe derived from recipes/demo-torch-cuda.yaml / demo-onnxruntime-cuda.yaml / demo-tensorrt.yaml
into --out; a target that cannot run here is a row with the reason.

- greedy: 8 prompts x 32 greedy tokens through the engine (`LLM.generate`), compared token by token
  with the CPU artifact (recipes/demo.yaml built with --no-autotune): "same" = identical sequences,
  "agree" = fraction of equal tokens up to the first difference of each sequence;
- decode b1/b8/b32: the backend's `forward` on hand-made decode batches (one new token per
  sequence, 512 past tokens each, distinct blocks), logits copied back to the host each step as the
  engine needs them; tokens/s = batch * steps / time, median of --rounds; once with the CUDA graphs
  of the manifest's plan ("graphs") and once eagerly ("eager"), the two alternating in each round;
- TTFT@512: one 512-token prompt, max_tokens=1, through the engine (scheduler, prefill, sampling);
  median of --rounds, in ms.

    python bench/gpu.py [--out DIR] [--rounds 5] [--steps 50]
    python bench/gpu.py --device cpu --rounds 1 --steps 2   # the torch rows on CPU ("graphs" = the padded
                                                            # static-shape path, no capture): checks the script
    python bench/gpu.py --shape 1b                          # a random Llama of a real shape instead (`scale`)
    python bench/gpu.py --shape 25m --device cpu --rounds 1 --steps 2   # that mode's script check
Writes DIR/gpu.json (with --shape, DIR/gpu-SHAPE.json) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.report import write_json  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    if", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n    print(", "    try:\n        return self.", "def main():\n    parser = ",
           "if __name__ == '__main__':\n", "    with open(path) as f:\n"]
TARGETS = [  # (label, backend, recipe, dtype, attention kernel forced in select_attention or None)
    ("torch/cuda fp32", "torch", "demo-torch-cuda.yaml", "float32", None),
    ("torch/cuda fp16", "torch", "demo-torch-cuda.yaml", "float16", None),
    ("torch/cuda fp16 decomposed attn", "torch", "demo-torch-cuda.yaml", "float16", "decomposed"),
    ("torch/cuda fp16 + fp8 weights", "torch", "demo-torch-cuda-fp8.yaml", "float16", None),
    ("torch/cuda fp16 + int4 awq weights", "torch", "demo-torch-cuda-int4-awq.yaml", "float16", None),
    ("onnxruntime/cuda fp16", "onnxruntime", "demo-onnxruntime-cuda.yaml", "float16", None),
    ("onnxruntime/cuda fp16 + int4", "onnxruntime", "demo-onnxruntime-cuda-int4.yaml", "float16", None),
    ("onnxruntime/cuda bf16", "onnxruntime", "demo-onnxruntime-cuda.yaml", "bfloat16", None),
    ("tensorrt fp16", "tensorrt", "demo-tensorrt.yaml", "float16", None),
]


def derived_recipe(src: Path, out: Path, dtype: str, tag: str, kernel: str | None = None,
                   batch: int = 32, context: int = 512, checkpoint: Path | None = None) -> Path:
    """The recipe with its dtype, name and output replaced (absolute paths: it is written elsewhere);
    with `kernel`, select_attention forced to that attention variant; with `checkpoint`, built from that
    checkpoint and without the quality gate (a random model has no meaningful perplexity). The runtime is
    widened to hold the largest timed decode batch: `batch` sequences of `context` tokens in the pool, and
    max_num_seqs (hence the largest CUDA-graph bucket) at least `batch`."""
    import yaml

    data = yaml.safe_load(src.read_text())
    rt = data["runtime"]
    rt["max_num_seqs"] = max(rt["max_num_seqs"], batch)
    rt["num_kv_blocks"] = max(rt["num_kv_blocks"], batch * -(-(context + 1) // rt["kv_block_size"]))
    data["name"] = f"{data['name']}-{tag}"
    data["target"]["dtype"] = dtype
    if kernel is not None:
        data["name"] += f"-{kernel}"
        for spec in data["passes"]:
            if spec["name"] == "select_attention":
                spec["options"] = {**(spec.get("options") or {}), "kernel": kernel}
    data["source"]["checkpoint"] = str(checkpoint or (src.parent / data["source"]["checkpoint"]).resolve())
    if data.get("calibration", {}).get("data"):
        data["calibration"]["data"] = str((src.parent / data["calibration"]["data"]).resolve())
    if DEVICE == "cpu" or checkpoint is not None:
        data.pop("quality", None)  # script check: no quality gate (float16 on CPU is slow)
    elif data.get("quality", {}).get("eval_data"):
        data["quality"]["eval_data"] = str((src.parent / data["quality"]["eval_data"]).resolve())
    data["output"] = str(out)
    path = out / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def build(recipe: Path) -> tuple[Path, float]:
    from compiler.build import build as build_artifact

    t = time.perf_counter()
    folder = build_artifact(recipe, progress=False, autotune=False)
    return folder, time.perf_counter() - t


DEVICE: str | None = None  # --device cpu: run the torch targets on CPU


def greedy(artifact: Path, **kw: Any) -> list[list[int]]:
    from runtime import LLM, SamplingParams

    kw.setdefault("device", DEVICE)
    llm = LLM(artifact, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0))
    return [list(o.token_ids) for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(identical sequences, prefix agreement)."""
    from runtime.evaluate import prefix_agreement

    return sum(x == y for x, y in zip(a, b, strict=True)), prefix_agreement(a, b)


def decode_batch(backend: Any, b: int, context: int) -> Any:
    from runtime.forward_batch import ForwardBatch

    bs = backend.block_size
    per_seq = -(-(context + 1) // bs)
    table = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
    return ForwardBatch(input_ids=np.arange(3, 3 + b, dtype=np.int64), positions=np.full(b, context, np.int64),
                        cu_seqlens=np.arange(b + 1, dtype=np.int32), past_lens=np.full(b, context, np.int32),
                        block_table=table, slot_mapping=table[:, context // bs].astype(np.int64) * bs + context % bs,
                        logits_index=np.arange(b, dtype=np.int64))


def rate(backend: Any, fb: Any, steps: int) -> float:
    backend.forward(fb)
    t = time.perf_counter()
    for _ in range(steps):
        backend.forward(fb)
    return fb.num_seqs * steps / (time.perf_counter() - t)


def ttft_ms(artifact: Path, rounds: int) -> float:
    from runtime import LLM, SamplingParams

    llm = LLM(artifact, device=DEVICE)
    prompt = list(np.arange(512) % 3000 + 10)
    times = []
    for _ in range(rounds + 1):
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times[1:])


def graphs_mode() -> str:
    """The engine's graph mode for the "graphs" columns: CUDA graphs, or on CPU the padded static-shape path."""
    return "padded" if DEVICE == "cpu" else "auto"


def measure(artifact: Path, rounds: int, steps: int, batches: list[int], context: int,
            graphs: Any = None) -> dict[str, Any]:
    """Decode tokens/s per batch with graphs ("auto_bN") and eagerly ("off_bN"), TTFT@512; `graphs`: an engine of
    the artifact already loaded in graphs_mode(), used instead of loading another."""
    from runtime.engine import LLMEngine

    engines = {"auto": graphs or LLMEngine(artifact, graphs=graphs_mode(), device=DEVICE),
               "off": LLMEngine(artifact, graphs="off", device=DEVICE)}
    graph_mode = getattr(engines["auto"].backend, "graph_mode", "off")
    samples: dict[str, list[float]] = {}
    fbs = {b: decode_batch(engines["auto"].backend, b, context) for b in batches}
    for _ in range(rounds):
        for mode, eng in engines.items():
            for b in batches:
                samples.setdefault(f"{mode}_b{b}", []).append(rate(eng.backend, fbs[b], steps))
    del engines
    out = {k: statistics.median(v) for k, v in samples.items()}
    out["graph_mode"] = graph_mode
    out["ttft_512_ms"] = ttft_ms(artifact, rounds)
    return out


def record(args: argparse.Namespace, env: dict[str, Any], rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The JSON of a run: host, GPU, settings, rows so far."""
    return {"host": {"machine": platform.machine(), "python": platform.python_version()}, "gpu": env, **extra,
            "context": args.context, "steps": args.steps, "rounds": args.rounds, "rows": rows}


def prefill_batch(num_tokens: int, block_size: int, vocab: int, seed: int = 0) -> Any:
    """One sequence of `num_tokens` random tokens, no past, logits at every position."""
    from runtime.forward_batch import ForwardBatch

    ids = np.random.default_rng(seed).integers(10, vocab, num_tokens).astype(np.int64)
    blocks = -(-num_tokens // block_size)
    return ForwardBatch(input_ids=ids, positions=np.arange(num_tokens, dtype=np.int64),
                        cu_seqlens=np.array([0, num_tokens], np.int32), past_lens=np.zeros(1, np.int32),
                        block_table=np.arange(blocks, dtype=np.int32)[None], slot_mapping=np.arange(num_tokens,
                                                                                                     dtype=np.int64),
                        logits_index=np.arange(num_tokens, dtype=np.int64))


def reference_logits(checkpoint: Path, ids: np.ndarray, device: str) -> np.ndarray:
    """transformers' float32 logits of `ids` at every position, on `device` (the model freed afterwards)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        out = model(torch.from_numpy(ids)[None].to(device)).logits[0].float().cpu().numpy()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def scale(args: argparse.Namespace, env: dict[str, Any]) -> None:
    """--shape: the torch/cuda target on a random Llama of a real shape (bench/build_scale.py SHAPES, e.g. 1b,
    3b, 8b; written once into --out), in each of --dtypes: build and load time, device memory after load
    and at the peak of the timed decode, logits of a 128-token prefill against transformers in float32 on
    the same device (max abs error over the reference's standard deviation, and how often the argmax agrees:
    random weights give small margins, so this is a number to watch, not a bound), decode tokens/s with and
    without CUDA graphs, TTFT@512."""
    import torch

    from bench.build_scale import write_random_llama
    from runtime.engine import LLMEngine

    device = DEVICE or "cuda"
    ckpt = write_random_llama(args.out / f"ckpt-{args.shape}", args.shape)
    batches = [1, 8, 32]
    rows: list[dict[str, Any]] = []
    fb = None
    reference = None
    for dtype in args.dtypes.split(","):
        row: dict[str, Any] = {"target": f"torch/{device} {args.shape} {dtype}"}
        rows.append(row)
        try:
            artifact, row["build_s"] = build(derived_recipe(ROOT / "recipes" / "demo-torch-cuda.yaml", args.out,
                                                            dtype, f"{args.shape}-{dtype}", None, max(batches),
                                                            args.context, checkpoint=ckpt))
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            engine = LLMEngine(artifact, graphs=graphs_mode(), device=DEVICE)
            row["load_s"] = round(time.perf_counter() - t, 1)
            if device == "cuda":
                row["device_gib_loaded"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            backend = engine.backend
            if fb is None:
                vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
                fb = prefill_batch(128, backend.block_size, vocab)
                reference = reference_logits(ckpt, fb.input_ids, device)
            got = np.asarray(backend.forward(fb), dtype=np.float32)
            row["logits_err_over_std"] = round(float(np.abs(got - reference).max() / reference.std()), 4)
            row["argmax_agree"] = round(float((got.argmax(-1) == reference.argmax(-1)).mean()), 4)
            del backend
            row.update(measure(artifact, args.rounds, args.steps, batches, args.context, graphs=engine))
            del engine
            if device == "cuda":
                row["device_gib_peak"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        except Exception as e:  # one dtype failing must not hide the other
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        write_json(args.out / f"gpu-{args.shape}.json", record(args, env, rows, shape=args.shape))
    head = ["target", "build s", "load s", "logits err/std", "argmax =", *[f"b{b} graphs/eager tok/s" for b in batches],
            "TTFT@512 ms", "GiB loaded/peak"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        if "error" in r:
            print(f"| {r['target']} | error: {r['error']} |")
            continue
        cells = [f"{r['auto_b' + str(b)]:.0f} / {r['off_b' + str(b)]:.0f}" for b in batches]
        print(f"| {r['target']} | {r['build_s']:.1f} | {r['load_s']} | {r['logits_err_over_std']} | {r['argmax_agree']} | "
              + " | ".join(cells) + f" | {r['ttft_512_ms']:.1f} | {r.get('device_gib_loaded', '-')} / "
              f"{r.get('device_gib_peak', '-')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--device", choices=["cpu"], default=None, help="run the torch targets on CPU (script check)")
    ap.add_argument("--only", default=None, help="run only the rows whose label contains this text")
    ap.add_argument("--shape", default=None, help="instead of the demo: the torch/cuda target on a random Llama of "
                    "this shape (bench/build_scale.py SHAPES: 1b, 3b, 8b, ...)")
    ap.add_argument("--dtypes", default="float16,bfloat16", help="with --shape: the target dtypes, comma-separated")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    from runtime.gpu import describe, missing_for

    env = describe()
    print(f"GPU: {env['devices'] or env['driver']}; packages: {env['packages']}", flush=True)
    if args.shape:
        problem = None if DEVICE == "cpu" else missing_for("torch")
        if problem is not None:
            raise SystemExit(f"--shape {args.shape}: {problem}")
        scale(args, env)
        return
    batches = [1, 8, 32]
    cpu_recipe = derived_recipe(ROOT / "recipes" / "demo.yaml", args.out, "float32", "cpu",
                                batch=max(batches), context=args.context)
    cpu_artifact, cpu_s = build(cpu_recipe)
    reference = greedy(cpu_artifact, device="cpu")
    print(f"cpu reference artifact built in {cpu_s:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []

    def write() -> None:
        write_json(args.out / "gpu.json", record(args, env, rows))

    for label, backend, recipe_name, dtype, kernel in TARGETS:
        if args.only and args.only not in label:
            continue
        row: dict[str, Any] = {"target": label}
        rows.append(row)
        recipe = ROOT / "recipes" / recipe_name
        problem = missing_for(backend)
        if DEVICE == "cpu":
            problem = None if backend == "torch" else "--device cpu runs the torch targets only"
        if problem is not None or not recipe.exists():
            row["skipped"] = problem or f"no {recipe_name}"
            print(f"{label}: skipped: {row['skipped']}", flush=True)
            continue
        try:
            artifact, seconds = build(derived_recipe(recipe, args.out, dtype, dtype, kernel, max(batches),
                                                     args.context))
            row["build_s"] = round(seconds, 1)
            same, agree = agreement(reference, greedy(artifact))
            row.update(greedy_same=f"{same}/{len(PROMPTS)}", greedy_agree=round(agree, 4))
            row.update(measure(artifact, args.rounds, args.steps, batches, args.context))
        except Exception as e:  # one target failing must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        write()  # after every row: a run stopped at its time limit keeps what it measured
    write()
    head = ["target", "greedy =CPU", "agree", *[f"b{b} graphs/eager tok/s" for b in batches], "TTFT@512 ms"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        if "skipped" in r or "error" in r:
            print(f"| {r['target']} | " + (f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}")
                  + " |" * (len(head) - 1))
            continue
        cells = [f"{r['auto_b' + str(b)]:.0f} / {r['off_b' + str(b)]:.0f} ({r['auto_b' + str(b)] / r['off_b' + str(b)]:.2f}x)"
                 for b in batches]
        print(f"| {r['target']} | {r['greedy_same']} | {r['greedy_agree']} | " + " | ".join(cells)
              + f" | {r['ttft_512_ms']:.1f} |")


if __name__ == "__main__":
    main()
