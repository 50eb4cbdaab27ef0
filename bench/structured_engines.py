"""xgrammar vs. llguidance on one artifact's vocabulary: setup, compile time per grammar, per-step mask time.

For each engine, on the artifact's tokenizer (tokenizer/tokenizer.json, offline):

1. setup: the tokenizer object the engine needs (xgrammar's TokenizerInfo, llguidance's LLTokenizer);
2. compile: per grammar (a JSON schema with nested objects, arrays, enums and bounded numbers; any JSON
   object; a regex; a choice), the time from the grammar text to a matcher that can compute its first
   mask (xgrammar: compile_* with its cache off + GrammarMatcher; llguidance: grammar_from_* + LLMatcher,
   and LLMatcher.deep_copy, which is what a cached grammar costs per request), median of --repeat runs;
3. mask: the matcher walks a fixed valid text (the artifact tokenizer's tokens of it), one mask per
   token into an int32 bitmask row (the sampler's format), then the token is consumed; median and p99
   over every step of --repeat walks, and the consume time.

Both engines compact JSON (no free whitespace) so they constrain the same language. xgrammar is not a
dependency of the project (it imports torch and transformers): `pip install xgrammar==0.2.8` to compare.

4. with --engine-steps: the chosen engine inside LLMEngine on the artifact: --seqs requests decoding
   together (16 steps of warm-up, then --steps steps), all free, half constrained by the JSON schema, all
   constrained, and all constrained with the masks computed before the forward on the engine thread
   (overlap_masks=False); per step the median step time, the time spent in the mask computation call (on
   the worker: until it has the GIL back), and the time the step waited for masks (after the forward, or
   before it without the overlap).

Prints tables and writes JSON (bench/results/structured_engines.json by default).

    python bench/structured_engines.py artifacts/pycode-llama-6m/1.0.0 [--repeat 20] [--engine-steps] [--out FILE]
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

ROOT = Path(__file__).resolve().parents[1]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["module", "class", "function"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "count": {"type": "integer", "minimum": -5, "maximum": 50},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                   "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
    },
    "required": ["name", "kind", "score", "count", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})"
CHOICE = ["def", "class", "import", "return"]

CASES = {  # name -> (kind, grammar, a valid text)
    "json_schema": ("json_schema", SCHEMA,
                    '{"name":"parse_args","kind":"function","score":12.5,"count":3,"tags":["cli","io"],'
                    '"owner":{"id":42,"active":true}}'),
    "json_object": ("json_object", None, '{"a":[1,2,{"b":null}],"c":"text with spaces","d":-0.25e3}'),
    "regex": ("regex", REGEX, "192.168.0.17"),
    "choice": ("choice", CHOICE, "import"),
}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def _walk(name: str, fill, consume, ids: list[int], mask: np.ndarray, times: list[float],
          consumes: list[float]) -> None:
    for tok in ids:
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        if not (int(mask[0, tok >> 5]) >> (tok & 31)) & 1:
            raise AssertionError(f"{name}: token {tok} of the valid text is masked")
        consume(tok)
        t2 = time.perf_counter()
        times.append(t1 - t0)
        consumes.append(t2 - t1)
    fill()


def bench_xgrammar(tok_dir: Path, vocab: int, eos: list[int], texts: dict[str, list[int]], repeat: int) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    setup = time.perf_counter() - t0
    torch.set_num_threads(1)

    def compile_(compiler, kind, grammar):
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(grammar), any_whitespace=False, separators=(",", ":"))
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(grammar)
        return compiler.compile_regex("|".join(_re_escape(c) for c in grammar))

    out: dict = {"setup_ms": _ms(setup), "cases": {}}
    for name, (kind, grammar, _) in CASES.items():
        comp_t, match_t = [], []
        for _ in range(repeat):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            t0 = time.perf_counter()
            cg = compile_(compiler, kind, grammar)
            t1 = time.perf_counter()
            xgr.GrammarMatcher(cg)
            t2 = time.perf_counter()
            comp_t.append(t1 - t0)
            match_t.append(t2 - t1)
        mask = xgr.allocate_token_bitmask(1, vocab)
        times: list[float] = []
        consumes: list[float] = []
        for _ in range(repeat):
            m = xgr.GrammarMatcher(cg)
            _walk(name, lambda m=m, mask=mask: m.fill_next_token_bitmask(mask, 0), m.accept_token, texts[name], mask.numpy(),
                  times, consumes)
            if not m.is_completed():
                raise AssertionError(f"xgrammar {name}: the valid text does not complete the grammar")
        out["cases"][name] = _stats(comp_t, match_t, times, consumes)
    return out


def _re_escape(s: str) -> str:
    import re

    return re.escape(s)


def bench_llguidance(tok_dir: Path, vocab: int, eos: list[int], texts: dict[str, list[int]], repeat: int) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer((tok_dir / "tokenizer.json").read_text("utf-8"), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t0
    options = {"whitespace_flexible": False}

    def grammar_of(kind, grammar):
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(grammar, overrides=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar)
        return llguidance.grammar_from("choice", json.dumps(grammar))

    out: dict = {"setup_ms": _ms(setup), "cases": {}}
    for name, (kind, grammar, _) in CASES.items():
        comp_t, copy_t = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            m = llguidance.LLMatcher(tok, grammar_of(kind, grammar), log_level=0)
            t1 = time.perf_counter()
            m.deep_copy()
            t2 = time.perf_counter()
            if m.is_error():
                raise AssertionError(f"llguidance {name}: {m.get_error()}")
            comp_t.append(t1 - t0)
            copy_t.append(t2 - t1)
        template = m
        mask = lnp.allocate_token_bitmask(1, vocab)
        times: list[float] = []
        consumes: list[float] = []
        for _ in range(repeat):
            mm = template.deep_copy()
            _walk(name, lambda mm=mm, mask=mask: lnp.fill_next_token_bitmask(mm, mask, 0), mm.consume_token, texts[name], mask,
                  times, consumes)
            if mm.is_error() or not mm.is_accepting():
                raise AssertionError(f"llguidance {name}: the valid text does not complete the grammar "
                                     f"({mm.get_error()})")
        out["cases"][name] = _stats(comp_t, copy_t, times, consumes)
    return out


def _stats(compile_t: list[float], matcher_t: list[float], mask_t: list[float], consume_t: list[float]) -> dict:
    mask_sorted = sorted(mask_t)
    return {
        "compile_ms": _ms(statistics.median(compile_t)),
        "matcher_ms": _ms(statistics.median(matcher_t)),  # xgrammar: new GrammarMatcher; llguidance: deep_copy
        "mask_median_ms": _ms(statistics.median(mask_t)),
        "mask_p99_ms": _ms(mask_sorted[min(len(mask_sorted) - 1, int(0.99 * len(mask_sorted)))]),
        "mask_max_ms": _ms(mask_sorted[-1]),
        "consume_median_ms": _ms(statistics.median(consume_t)),
        "steps": len(mask_t),
    }


def bench_engine_steps(artifact: Path, seqs: int, steps: int) -> dict:
    from runtime.engine import LLMEngine
    from runtime.sampling import SamplingParams
    from runtime.structured import StructuredOutput

    schema = StructuredOutput.json_schema(SCHEMA)
    out = {}
    for label, constrained, overlap in (("free", 0, True), ("half", seqs // 2, True), ("all", seqs, True),
                                        ("all-sync", seqs, False)):
        engine = LLMEngine(artifact, max_num_seqs=seqs, threads=1, overlap_masks=overlap)
        engine.grammars.compile(schema)
        for i in range(seqs):
            spec = schema if i < constrained else None
            # ignore_eos and a long max_tokens keep the free rows decoding; the constrained ones end with
            # their grammar (~60 tokens) and are replaced so that the batch stays full
            engine.add_request(f"{label}-{i}", "def main():\n", SamplingParams(
                max_tokens=10_000, temperature=1.0, seed=i, ignore_eos=spec is None, structured=spec))
        added = seqs
        times: list[float] = []
        for k in range(16 + steps):
            g0, w0 = engine.grammars.stats["mask_s"], engine.stats["mask_wait_s"]
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if k >= 16:
                times.append(dt)
                out.setdefault(label, {"mask": [], "wait": []})
                out[label]["mask"].append(engine.grammars.stats["mask_s"] - g0)
                out[label]["wait"].append(engine.stats["mask_wait_s"] - w0)
            for o in outs:
                if o.finished:
                    engine.add_request(f"{label}-{added}", "def main():\n", SamplingParams(
                        max_tokens=10_000, temperature=1.0, seed=added, structured=schema))
                    added += 1
        r = out.setdefault(label, {"mask": [0.0], "wait": [0.0]})
        out[label] = {"constrained": constrained, "step_median_ms": _ms(statistics.median(times)),
                      "mask_median_ms": _ms(statistics.median(r["mask"])),
                      "wait_median_ms": _ms(statistics.median(r["wait"])), "wait_max_ms": _ms(max(r["wait"]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--engines", default="xgrammar,llguidance")
    ap.add_argument("--engine-steps", action="store_true", help="also time LLMEngine steps with masks")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "structured_engines.json")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok_dir = args.artifact / "tokenizer"
    rt = json.loads((args.artifact / "runtime.json").read_text("utf-8"))
    vocab = int(rt["model"]["vocab_size"])
    eos = list(rt["model"].get("eos_token_ids") or [])
    hf = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    texts = {name: hf.encode(text, add_special_tokens=False).ids for name, (_, _, text) in CASES.items()}
    result = {"artifact": str(args.artifact), "vocab": vocab, "repeat": args.repeat, "cpu_count": os.cpu_count(),
              "machine": platform.processor() or platform.machine(), "engines": {}}
    for engine in args.engines.split(","):
        fn = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance}[engine]
        try:
            __import__(engine)
        except ImportError:  # xgrammar is not a dependency of the project (it needs torch and transformers)
            print(f"{engine} is not installed (pip install {engine}; the numbers in docs/architecture.md: "
                  f"{'xgrammar==0.2.8' if engine == 'xgrammar' else 'llguidance==1.9.1'}): skipped")
            continue
        result["engines"][engine] = fn(tok_dir, vocab, eos, texts, args.repeat)
        import importlib.metadata as md

        result["engines"][engine]["version"] = md.version(engine)
    print(f"vocabulary {vocab}; medians over {args.repeat} runs (ms)")
    print(f"{'engine':<11} {'grammar':<12} {'compile':>9} {'matcher':>8} {'mask med':>9} {'mask p99':>9} "
          f"{'consume':>8}")
    for engine, r in result["engines"].items():
        print(f"{engine:<11} {'(setup)':<12} {r['setup_ms']:>9.2f}")
        for name, c in r["cases"].items():
            print(f"{engine:<11} {name:<12} {c['compile_ms']:>9.3f} {c['matcher_ms']:>8.3f} "
                  f"{c['mask_median_ms']:>9.4f} {c['mask_p99_ms']:>9.4f} {c['consume_median_ms']:>8.4f}")
    if args.engine_steps:
        result["engine_steps"] = bench_engine_steps(args.artifact, args.seqs, args.steps)
        print(f"LLMEngine, {args.seqs} sequences decoding, medians over {args.steps} steps (ms)")
        print(f"{'rows':<9} {'constrained':>11} {'step':>8} {'masks':>8} {'wait':>8} {'wait max':>9}")
        for label, r in result["engine_steps"].items():
            print(f"{label:<9} {r['constrained']:>11} {r['step_median_ms']:>8.3f} {r['mask_median_ms']:>8.3f} "
                  f"{r['wait_median_ms']:>8.3f} {r['wait_max_ms']:>9.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", "utf-8")


if __name__ == "__main__":
    main()
