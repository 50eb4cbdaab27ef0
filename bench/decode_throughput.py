"""Decode throughput of the runtime vs. transformers `generate`, side by side in one run.

Both run the same model (the demo artifact and its source checkpoint), fp32, greedy, on the same
prompts, alternating rounds so machine noise hits both alike. For each batch size the decode rate
is (tokens of a long run - tokens of a 1-token run) / (time difference), so prefill is excluded.
Prints a table and writes JSON (bench/results/decode_throughput.json by default).

    python bench/decode_throughput.py [--artifact artifacts/pycode-llama-6m/1.0.0] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "def fibonacci(n):\n    if",
    "import os\nimport sys\n\n\nclass Config:\n",
    '"""Utilities for reading files."""\n',
    "for i in range(10):\n",
    "    def __repr__(self):\n        return",
    "try:\n    import _thread\nexcept ImportError:\n",
    "x = ",
    "class Error(Exception):\n",
]


def ours(llm: object, prompts: list[str], n: int) -> float:
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)  # type: ignore[attr-defined]
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == n for o in outs)
    return dt


def theirs(model: object, tok: object, prompts: list[str], n: int) -> float:
    import torch
    import transformers

    enc = tok(prompts, return_tensors="pt", padding=True)  # type: ignore[operator]
    cfg = transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, generation_config=cfg)  # type: ignore[attr-defined]
    dt = time.perf_counter() - t
    assert out.shape[1] == enc.input_ids.shape[1] + n
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=ROOT / "artifacts/pycode-llama-6m/1.0.0")
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models/pycode-llama-6m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/decode_throughput.json")
    args = ap.parse_args()

    import torch
    import transformers

    from runtime import LLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    llm = LLM(args.artifact)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
    tok.padding_side = "left"
    # warm-up both
    ours(llm, PROMPTS[:2], 4)
    theirs(model, tok, PROMPTS[:2], 4)

    rows = []
    for b in args.batch:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        res: dict[str, list[float]] = {"ours_1": [], "ours_n": [], "hf_1": [], "hf_n": []}
        for _ in range(args.rounds):
            res["ours_1"].append(ours(llm, prompts, 1))
            res["hf_1"].append(theirs(model, tok, prompts, 1))
            res["ours_n"].append(ours(llm, prompts, args.tokens))
            res["hf_n"].append(theirs(model, tok, prompts, args.tokens))
        med = {k: statistics.median(v) for k, v in res.items()}
        decode_tokens = b * (args.tokens - 1)
        ours_tps = decode_tokens / (med["ours_n"] - med["ours_1"])
        hf_tps = decode_tokens / (med["hf_n"] - med["hf_1"])
        rows.append({
            "batch": b, "new_tokens": args.tokens,
            "ours_decode_tok_s": round(ours_tps, 1), "transformers_decode_tok_s": round(hf_tps, 1),
            "ratio": round(ours_tps / hf_tps, 2),
            "ours_first_token_s": round(med["ours_1"], 4), "transformers_first_token_s": round(med["hf_1"], 4),
            "raw_s": {k: [round(x, 4) for x in v] for k, v in res.items()},
        })

    build = json.loads((args.artifact / "build.json").read_text())
    print(f"demo artifact build time: {build['timings_s']['total']:.1f} s "
          f"(capture {build['timings_s'].get('pass.capture', 0):.1f} s, "
          f"lower_onnx {build['timings_s'].get('pass.lower_onnx', 0):.1f} s, "
          f"quality gate {build['timings_s'].get('quality_gate', 0):.1f} s)")
    print(f"{'batch':>5} {'ours tok/s':>11} {'transformers tok/s':>19} {'ratio':>6} "
          f"{'ours 1st tok s':>15} {'hf 1st tok s':>13}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ours_decode_tok_s']:>11.1f} {r['transformers_decode_tok_s']:>19.1f} "
              f"{r['ratio']:>6.2f} {r['ours_first_token_s']:>15.4f} {r['transformers_first_token_s']:>13.4f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"artifact": str(args.artifact), "build_timings_s": build["timings_s"],
                                     "torch_threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
