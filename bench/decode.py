"""Decode and prefill throughput of the same model built with and without the `fuse` pass.

Models: (a) the demo (models/pycode-llama-6m), (b) a random Llama of about 100M parameters (hidden
768, 12 layers, 12 heads / 4 KV heads, intermediate 2048, the demo tokenizer's vocabulary), saved
with transformers into the output folder with the demo tokenizer files copied in.

Each model is built once by a recipe with `- name: fuse` after lower_onnx; the graph the fuse pass
receives is saved as the unfused artifact (so both come from one capture/export, and "unfused" is
exactly what the build writes without the pass). With `--attention KIND ...` each KIND is also
built with `select_attention` (`kernel: KIND`) before capture; when that pass is not registered
(compiler/passes/__init__.py) or the build refuses the kind, those rows are skipped with the reason.

Measured through the runtime's backend directly (runtime/backends/onnxruntime.py `forward` on
hand-made ForwardBatch arrays with a block table; no scheduler or sampler in the timing):
- decode: batch B (1, 8, 32) of one new token each, every sequence with `context` past tokens
  (1024, or max_model_len - 1 when that is smaller) in distinct KV blocks; tokens/s = B * steps / time;
- prefill: one 512-token prompt, no past; tokens/s = 512 / time.
Rounds alternate between the fused and the unfused artifact (machine noise hits both alike); each
number is the median over rounds. Prints a table, writes JSON (bench/results/decode.json).

    python bench/decode.py [--attention decomposed gqa] [--rounds 5] [--threads N] [--out DIR]
    python bench/decode.py --quick      # tiny settings: checks that everything runs (numbers meaningless)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "models" / "pycode-llama-6m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_llama_100m(folder: Path, quick: bool) -> Path:
    """Random Llama (~82M parameters with the 4096-token demo vocabulary; --quick: a tiny one)."""
    import tokenizers
    import torch
    import transformers

    if (folder / "config.json").exists():
        return folder
    vocab = tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json")).get_vocab_size()
    size = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=256) if quick else \
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048)
    cfg = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=2048, rope_theta=10000.0,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False, **size)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(DEMO / f, folder / f)
    return folder


def write_recipe(folder: Path, checkpoint: Path, name: str, attention: str | None, max_model_len: int,
                 num_blocks: int) -> Path:
    select = f"  - name: select_attention\n    options: {{kernel: {attention}}}\n" if attention else ""
    text = (f"name: {name}\nversion: 1.0.0\nsource:\n  checkpoint: {checkpoint}\n"
            "target:\n  backend: onnxruntime\n  device: cpu\n  dtype: float32\n"
            f"passes:\n{select}  - name: capture\n  - name: lower_onnx\n  - name: fuse\n  - name: package\n"
            f"runtime:\n  kv_block_size: 16\n  num_kv_blocks: {num_blocks}\n  max_num_seqs: 32\n"
            f"  max_num_batched_tokens: 512\n  max_model_len: {max_model_len}\n"
            f"output: {folder / 'artifacts'}\n")
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def build_pair(recipe: Path, unfused: Path) -> tuple[Path, Path, dict[str, Any]]:
    """Build `recipe` (with fuse); the graph the fuse pass received becomes the unfused artifact."""
    import onnx

    import compiler.fusion as fusion
    from compiler.build import build

    seen: list[onnx.ModelProto] = []
    real = fusion.fuse_model

    def spy(model: onnx.ModelProto, rules: list[str], rope_cache_rows: int) -> Any:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        seen.append(copy)
        return real(model, rules, rope_cache_rows=rope_cache_rows)

    fusion.fuse_model = spy  # type: ignore[assignment]
    try:
        fused = build(recipe, progress=False)
    finally:
        fusion.fuse_model = real  # type: ignore[assignment]
    shutil.copytree(fused, unfused)
    for f in ("model.onnx", "model.onnx.data"):
        (unfused / f).unlink()
    onnx.save_model(seen[0], str(unfused / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024, convert_attribute=False)
    manifest = json.loads((fused / "manifest.json").read_text())
    stats = next(p["stats"] for p in manifest["passes"] if p["name"] == "fuse")
    return unfused, fused, stats


class Runner:
    """One artifact's backend plus the ForwardBatch arrays of each measurement."""

    def __init__(self, artifact: Path, num_blocks: int, threads: int) -> None:
        from runtime.artifact import Artifact
        from runtime.backends.onnxruntime import OnnxRuntimeBackend

        art = Artifact.open(artifact, verify=False)
        self.backend = OnnxRuntimeBackend(art.model_path, art.runtime_config,
                                          num_blocks=num_blocks, intra_op_threads=threads or None)

    def decode_batch(self, b: int, context: int) -> Any:
        from runtime.forward_batch import ForwardBatch

        bs = self.backend.block_size
        per_seq = -(-(context + 1) // bs)
        table = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
        pos = np.full(b, context, np.int64)
        return ForwardBatch(input_ids=np.arange(3, 3 + b, dtype=np.int64) % 4000, positions=pos,
                            cu_seqlens=np.arange(b + 1, dtype=np.int32), past_lens=np.full(b, context, np.int32),
                            block_table=table, slot_mapping=table[:, context // bs].astype(np.int64) * bs + context % bs,
                            logits_index=np.arange(b, dtype=np.int64))

    def prefill_batch(self, n: int) -> Any:
        from runtime.forward_batch import ForwardBatch

        bs = self.backend.block_size
        table = np.arange(-(-n // bs), dtype=np.int32)[None, :]
        pos = np.arange(n, dtype=np.int64)
        return ForwardBatch(input_ids=(pos % 4000 + 3).astype(np.int64), positions=pos,
                            cu_seqlens=np.array([0, n], np.int32), past_lens=np.zeros(1, np.int32), block_table=table,
                            slot_mapping=table[0, pos // bs].astype(np.int64) * bs + pos % bs,
                            logits_index=np.array([n - 1], np.int64))

    def time(self, fb: Any, steps: int) -> float:
        self.backend.forward(fb)  # warm-up (allocations, first-run kernels)
        t = time.perf_counter()
        for _ in range(steps):
            self.backend.forward(fb)
        return time.perf_counter() - t


def measure(pair: dict[str, Path], batches: list[int], context: int, prompt: int, steps: int, rounds: int,
            threads: int) -> dict[str, dict[str, float]]:
    bs = 16
    num_blocks = max(max(batches) * -(-(context + 1) // bs), -(-prompt // bs)) + 1
    runners = {k: Runner(a, num_blocks, threads) for k, a in pair.items()}
    batches_fb = {k: {b: r.decode_batch(b, context) for b in batches} for k, r in runners.items()}
    prefill_fb = {k: r.prefill_batch(prompt) for k, r in runners.items()}
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in runners}
    for _ in range(rounds):
        for k, r in runners.items():  # alternate artifacts within each round
            for b in batches:
                dt = r.time(batches_fb[k][b], steps)
                samples[k].setdefault(f"decode_b{b}", []).append(b * steps / dt)
            dt = r.time(prefill_fb[k], max(1, steps // 4))
            samples[k].setdefault(f"prefill_{prompt}", []).append(prompt * max(1, steps // 4) / dt)
    return {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", nargs="+", default=[], metavar="KIND",
                    help="also build with select_attention kernel KIND (e.g. decomposed gqa paged_attention)")
    ap.add_argument("--models", nargs="+", default=["demo", "llama-100m"], choices=["demo", "llama-100m"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=1024, help="past tokens per sequence when decoding")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--steps", type=int, default=16, help="forward steps per timing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    ap.add_argument("--out", type=Path, default=None, help="build folder (default: a temporary one, removed)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/decode.json")
    ap.add_argument("--quick", action="store_true", help="tiny settings to check the script runs")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.context, args.prompt, args.steps, args.rounds = [1, 8], 64, 64, 2, 1

    from compiler.passes import PASSES

    out = args.out or Path(tempfile.mkdtemp(prefix="decode-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    builds: list[dict[str, Any]] = []
    try:
        for model in args.models:
            ckpt = DEMO if model == "demo" else make_llama_100m(out / "llama-100m-ckpt", args.quick)
            max_pos = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
            max_model_len = min(max_pos, max(2048 if not args.quick else 256, args.context + 1))
            context = min(args.context, max_model_len - 1)
            num_blocks = max(args.batch) * -(-(context + 1) // 16) + -(-args.prompt // 16) + 1
            for attention in [None, *args.attention]:
                label = attention or "default"
                if attention is not None and "select_attention" not in PASSES:
                    why = "pass select_attention is not registered in compiler/passes/__init__.py"
                    print(f"skip {model} / attention {attention}: {why}")
                    skipped.append({"model": model, "attention": attention, "reason": why})
                    continue
                name = f"{model}-{label}".replace("_", "-")
                folder = out / name
                folder.mkdir(exist_ok=True)
                recipe = write_recipe(folder, ckpt, name, attention, max_model_len, num_blocks)
                t = time.perf_counter()
                try:
                    unfused, fused, stats = build_pair(recipe, folder / "unfused")
                except Exception as e:  # a kind the model cannot use: the build says why
                    why = str(e).splitlines()[0]
                    print(f"skip {model} / attention {label}: build failed: {why}")
                    skipped.append({"model": model, "attention": label, "reason": why})
                    continue
                build_s = time.perf_counter() - t
                res = measure({"unfused": unfused, "fused": fused}, args.batch, context, args.prompt, args.steps,
                              args.rounds, args.threads)
                for metric in res["fused"]:
                    rows.append({"model": model, "attention": label, "metric": metric,
                                 "context": context if metric.startswith("decode") else 0,
                                 "unfused_tok_s": round(res["unfused"][metric], 1),
                                 "fused_tok_s": round(res["fused"][metric], 1),
                                 "speedup": round(res["fused"][metric] / res["unfused"][metric], 3)})
                builds.append({"model": model, "attention": label, "fusions": stats["fusions"],
                               "nodes_before": stats["nodes_before"], "nodes_after": stats["nodes_after"],
                               "build_s": round(build_s, 1)})
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)

    print(f"{'model':<11} {'attention':<16} {'metric':<13} {'context':>7} {'unfused tok/s':>14} "
          f"{'fused tok/s':>12} {'speedup':>8}")
    for r in rows:
        print(f"{r['model']:<11} {r['attention']:<16} {r['metric']:<13} {r['context']:>7} "
              f"{r['unfused_tok_s']:>14.1f} {r['fused_tok_s']:>12.1f} {r['speedup']:>8.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "quick": args.quick, "rounds": args.rounds, "steps": args.steps, "threads": args.threads,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "method": "runtime backend forward on hand-made ForwardBatch arrays; median of rounds alternating artifacts",
        "builds": builds, "rows": rows, "skipped": skipped}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
