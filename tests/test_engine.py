"""The engine on the demo artifact: prefix caching, preemption under a tight pool, stops, seeds, aborts."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.engine import LLM, LLMEngine
from runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def eval_text_ids(engine: LLMEngine, n: int, offset: int = 0) -> list[int]:
    text = (Path(__file__).parents[1] / "models/pycode-llama-6m/eval.txt").read_text(encoding="utf-8")
    return engine.tokenizer.encode(text, add_special_tokens=False)[offset:offset + n]


def test_shared_prefix_reuses_cached_blocks(demo_artifact: Path) -> None:
    engine = LLMEngine(demo_artifact)
    prefix = eval_text_ids(engine, 256)
    first = prefix + eval_text_ids(engine, 40, offset=1000)
    second = prefix + eval_text_ids(engine, 30, offset=3000)
    engine.add_request("first", first, GREEDY)
    run_all(engine)
    before = engine.stats["prefill_tokens"]
    engine.add_request("second", second, GREEDY)
    req_metrics = []
    while engine.has_unfinished():
        for out in engine.step():
            req_metrics.append(out.metrics)
    # all 16 full blocks of the shared 256-token prefix come from the cache: only the tail is computed
    assert req_metrics[0].num_cached_tokens == 256
    assert engine.stats["prefill_tokens"] - before == len(second) - 256
    stats = engine.scheduler.prefix_cache_stats()
    assert stats.hits >= 256
    # and the cached run gives the same tokens as a cold engine
    cold = LLMEngine(demo_artifact, enable_prefix_caching=False)
    cold.add_request("second", second, GREEDY)
    warm_engine = LLMEngine(demo_artifact)
    warm_engine.add_request("first", first, GREEDY)
    run_all(warm_engine)
    warm_engine.add_request("second", second, GREEDY)
    assert run_all(warm_engine)["second"] == run_all(cold)["second"]


def test_whole_prompt_cached_copy_on_write(demo_artifact: Path) -> None:
    """The same block-aligned prompt twice: the second reuses every block but its last (copied)."""
    engine = LLMEngine(demo_artifact)
    prompt = eval_text_ids(engine, 64)
    engine.add_request("a", prompt, GREEDY)
    a = run_all(engine)["a"]
    engine.add_request("b", prompt, GREEDY)
    before = engine.stats["prefill_tokens"]
    b = run_all(engine)["b"]
    assert a == b
    assert engine.stats["prefill_tokens"] - before == 1  # only the last prompt token runs again
    assert engine.scheduler.num_free_blocks == engine.scheduler_config.num_blocks


def test_tight_pool_preempts_and_matches_large_pool(demo_artifact: Path) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    big = LLMEngine(demo_artifact, enable_prefix_caching=False)
    small = LLMEngine(demo_artifact, num_blocks=24, max_num_seqs=8, enable_prefix_caching=False)
    prompts = [eval_text_ids(big, 40 + 7 * i, offset=500 * i) for i in range(8)]
    for engine in (big, small):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
    want, got = run_all(big), run_all(small)
    assert small.scheduler.num_preemptions > 0
    assert got == want
    assert all(len(v) == 48 for v in got.values())
    assert small.scheduler.num_free_blocks == 24


def test_stop_string_and_streaming(demo_artifact: Path) -> None:
    llm = LLM(demo_artifact)
    params = SamplingParams(max_tokens=64, temperature=0.0, stop=["\n\n"])
    full = llm.generate("def fibonacci(n):\n    if", SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert "\n\n" in full.text
    out = llm.generate("def fibonacci(n):\n    if", params)[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index("\n\n")]
    streamed = "".join(o.new_text for o in llm.stream("def fibonacci(n):\n    if", params))
    assert streamed == out.text


def test_seeded_sampling_is_reproducible_whatever_the_batch(demo_artifact: Path) -> None:
    llm = LLM(demo_artifact)
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    alone = llm.generate("import os\n", p)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(3)]
    batched = llm.generate(["class A:\n", "import os\n", "x = 1\n", "def f():\n"], [others[0], p, others[1], others[2]])
    assert batched[1].token_ids == alone
    assert llm.generate("import os\n", SamplingParams(max_tokens=20, temperature=0.9, seed=8))[0].token_ids != alone


def test_abort_frees_blocks_at_once(demo_artifact: Path) -> None:
    engine = LLMEngine(demo_artifact)
    engine.add_request("x", eval_text_ids(engine, 100), SamplingParams(max_tokens=200, temperature=0.0))
    for _ in range(5):
        engine.step()
    assert engine.scheduler.num_free_blocks < engine.scheduler_config.num_blocks
    engine.abort("x")
    assert not engine.has_unfinished()
    assert engine.scheduler.num_free_blocks == engine.scheduler_config.num_blocks


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
])
def test_bad_sampling_params_are_refused(demo_artifact: Path, bad: dict) -> None:
    engine = LLMEngine(demo_artifact)
    with pytest.raises(ValueError):
        engine.add_request("bad", [5, 6, 7], SamplingParams(**bad))
    assert not engine.has_unfinished()


def test_prompt_over_context_is_refused(demo_artifact: Path) -> None:
    engine = LLMEngine(demo_artifact)
    with pytest.raises(ValueError, match="at most"):
        engine.add_request("long", [5] * 1024, GREEDY)


def test_the_serving_limits_are_computed_once(demo_artifact: Path) -> None:
    """Artifact.check_runtime returns the limits in effect (runtime.json's with the serving overrides; a context
    override never raises the artifact's) and the engine's scheduler takes exactly those."""
    from runtime.artifact import Artifact

    art = Artifact.open(demo_artifact)
    sched = art.runtime_config["scheduler"]
    plain = art.check_runtime()
    assert (plain.max_model_len, plain.max_num_seqs, plain.max_num_batched_tokens) == (
        sched["max_model_len"], sched["max_num_seqs"], sched["max_num_batched_tokens"])
    assert plain.num_blocks == art.runtime_config["kv_cache"]["num_blocks"]
    assert art.check_runtime(max_model_len=sched["max_model_len"] * 4).max_model_len == sched["max_model_len"]
    small = art.check_runtime(max_model_len=300, num_blocks=64, max_num_seqs=3, max_num_batched_tokens=100)
    engine = LLMEngine(demo_artifact, max_model_len=300, num_blocks=64, max_num_seqs=3, max_num_batched_tokens=100)
    sc = engine.scheduler_config
    assert (sc.max_model_len, sc.num_blocks, sc.max_num_seqs, sc.max_num_batched_tokens) == (
        small.max_model_len, small.num_blocks, small.max_num_seqs, small.max_num_batched_tokens) == (300, 64, 3, 100)
