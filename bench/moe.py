"""Mixture-of-experts step cost against the number of experts each token selects.

One random Mixtral-shaped checkpoint (the demo tokenizer's 4096-token vocabulary, hidden 512, 2 layers,
8 heads / 4 KV heads, 8 experts of intermediate 1408: 87% of the weights in the experts), saved with
transformers; the same weights built four times for ONNX Runtime CPU with num_experts_per_tok k = 1, 2,
4, 8 (k = 8: every expert runs for every token, what a dense formulation of the block would compute).
A graph that computes only the selected experts' work takes time growing with k; one that ran every
expert would take the same time for each k.

Measured through the runtime's backend directly (bench/decode.py's Runner: hand-made ForwardBatch arrays,
no scheduler or sampler): decode of batch B (1, 8) with `context` past tokens, and one prefill of
`prompt` tokens; rounds alternate between the artifacts; medians. Prints a table, writes JSON
(bench/results/moe.json).

    python bench/moe.py [--rounds 5] [--steps 30] [--threads N] [--out DIR]
    python bench/moe.py --quick      # tiny settings: checks that everything runs (numbers meaningless)
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
DEMO = ROOT / "models" / "pycode-llama-6m"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOP_K = (1, 2, 4, 8)


def make_checkpoint(folder: Path, top_k: int, quick: bool) -> Path:
    """The random Mixtral (seed 0: the same weights for every k) with num_experts_per_tok = top_k."""
    import torch
    import transformers

    size = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2) if quick else \
        dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4)
    cfg = transformers.MixtralConfig(vocab_size=4096, num_hidden_layers=2, num_local_experts=8,
                                     num_experts_per_tok=top_k, max_position_embeddings=2048, rope_theta=10000.0,
                                     bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                                     **size)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(DEMO / f, folder / f)
    return folder


def build_artifact(ckpt: Path, folder: Path, name: str) -> Path:
    from compiler.build import build

    recipe = folder / f"{name}.yaml"
    recipe.write_text(
        f"name: {name}\nversion: 1.0.0\nsource:\n  checkpoint: {ckpt}\n"
        "target:\n  backend: onnxruntime\n  device: cpu\n  dtype: float32\n"
        "passes:\n  - name: capture\n  - name: lower_onnx\n  - name: fuse\n  - name: package\n"
        "runtime:\n  kv_block_size: 16\n  num_kv_blocks: 256\n  max_num_seqs: 8\n  max_num_batched_tokens: 512\n"
        f"  max_model_len: 1024\noutput: {folder / 'artifacts'}\n", encoding="utf-8")
    return build(recipe, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.context, args.prompt = 1, 2, 20, 16
    from decode import Runner

    work = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    try:
        artifacts = {k: build_artifact(make_checkpoint(work / f"ckpt-k{k}", k, args.quick), work, f"moe-k{k}")
                     for k in TOP_K}
        batches = [1, 8]
        bs = 16
        num_blocks = max(max(batches) * -(-(args.context + 1) // bs), -(-args.prompt // bs)) + 1
        runners = {k: Runner(a, num_blocks, args.threads) for k, a in artifacts.items()}
        decode_fb = {k: {b: r.decode_batch(b, args.context) for b in batches} for k, r in runners.items()}
        prefill_fb = {k: r.prefill_batch(args.prompt) for k, r in runners.items()}
        samples: dict[int, dict[str, list[float]]] = {k: {} for k in runners}
        for _ in range(args.rounds):
            for k, r in runners.items():
                for b in batches:
                    samples[k].setdefault(f"decode_b{b}_ms", []).append(
                        1e3 * r.time(decode_fb[k][b], args.steps) / args.steps)
                samples[k].setdefault("prefill_ms", []).append(1e3 * r.time(prefill_fb[k], max(1, args.steps // 10))
                                                               / max(1, args.steps // 10))
        result: dict[str, Any] = {"machine": platform.machine(), "python": platform.python_version(),
                                  "settings": vars(args) | {"out": str(args.out)}, "rows": {}}
        cols = [f"decode_b{b}_ms" for b in batches] + ["prefill_ms"]
        print(f"{'k (of 8)':>9} " + " ".join(f"{c:>14} {'x k=1':>6}" for c in cols))
        for k in runners:
            med = {c: statistics.median(samples[k][c]) for c in cols}
            result["rows"][str(k)] = med
            base = {c: statistics.median(samples[TOP_K[0]][c]) for c in cols}
            print(f"{k:>9} " + " ".join(f"{med[c]:>14.3f} {med[c] / base[c]:>6.2f}" for c in cols))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
