"""Speculative decoding in the engine: n-gram proposals, exact greedy verification (tokens identical to
plain decoding, with chunked prefill, prefix caching, preemption, stops, logprobs) and the rejection
scheme for sampling (chi-square against plain sampling on a small-vocabulary model)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats
from test_parity import DEMO_PROMPTS

from runtime.core import make_rng
from runtime.engine import LLMEngine
from runtime.sampling import Sampler, SamplingParams
from runtime.speculative import SpeculativeConfig, ngram_propose, verify_sampled

REPETITIVE = ("def area(rectangle_width, rectangle_height):\n    return rectangle_width * rectangle_height\n\n\n"
              "def perimeter(rectangle_width, rectangle_height):\n    return 2 * (rectangle_width + ")
SPEC = SpeculativeConfig(num_tokens=4)


def run(engine: LLMEngine) -> dict[str, object]:
    done: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


# ---- the proposer ------------------------------------------------------------------------------


def test_ngram_propose_takes_the_latest_longest_match() -> None:
    assert ngram_propose([1, 2, 3, 4, 1, 2], k=2) == [3, 4]
    assert ngram_propose([1, 2, 3, 9, 2, 3, 7, 2, 3], k=3) == [7, 2, 3]  # the most recent "2 3"
    assert ngram_propose([5, 1, 2, 3, 8, 9, 3], k=2, ngram_max=3) == [8, 9]  # falls back to the 1-gram "3"
    assert ngram_propose([1, 2, 3, 4], k=2) == []
    assert ngram_propose([7, 7], k=4) == [7]  # what follows the match, up to the end
    assert ngram_propose([1, 2, 1, 2], k=3, ngram_min=3) == []


def test_speculative_config_parsing() -> None:
    assert SpeculativeConfig.parse("ngram:k=6,n=4,min=2") == SpeculativeConfig("ngram", 6, 4, 2)
    assert SpeculativeConfig.from_dict({"num_tokens": 2}) == SpeculativeConfig(num_tokens=2)
    for bad in ("medusa", "ngram:k=0", "ngram:x=1", "ngram:n=1,min=2", "draft:n=3"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.from_dict({"k": 2})


# ---- greedy: identical tokens ------------------------------------------------------------------


def test_greedy_identical_to_plain_mixed_batch(demo_artifact: Path) -> None:
    """The demo prompts (and a repetitive one) in one batch, every other request speculative, chunked
    prefill (32-token budget) and prefix caching on: the same tokens as plain greedy decoding."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [*DEMO_PROMPTS, REPETITIVE, REPETITIVE]
    plain = LLMEngine(demo_artifact, max_num_batched_tokens=32, max_num_seqs=8)
    mixed = LLMEngine(demo_artifact, max_num_batched_tokens=32, max_num_seqs=8)
    for i, p in enumerate(prompts):
        plain.add_request(f"r{i}", p, params)
        mixed.add_request(f"r{i}", p, params, speculative=SPEC if i % 2 == 0 else None)
    want, got = run(plain), run(mixed)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    st = mixed.stats
    assert st["spec_proposed"] > 50 and st["spec_accepted"] > 10, st
    assert st["generation_tokens"] == plain.stats["generation_tokens"]
    assert mixed.stats["steps"] < plain.stats["steps"]
    assert mixed.scheduler.prefix_cache_stats().hits > 0  # the second REPETITIVE reused the first's blocks
    assert mixed.scheduler.num_free_blocks == mixed.scheduler_config.num_blocks


def test_greedy_speculative_under_preemption(demo_artifact: Path) -> None:
    assert_exact_under_preemption(demo_artifact, speculative=SPEC)


def assert_exact_under_preemption(demo_artifact: Path, **speculative: Any) -> None:
    """8 greedy requests in a pool of 24 blocks (preempted and resumed, proposals accepted) give the
    tokens of plain decoding, and every block comes back."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    big = LLMEngine(demo_artifact, enable_prefix_caching=False)
    small = LLMEngine(demo_artifact, num_blocks=24, max_num_seqs=8, **speculative)
    prompts = [small.tokenizer.encode(REPETITIVE)[: 30 + 5 * i] for i in range(4)] + \
        [small.tokenizer.encode(p) for p in DEMO_PROMPTS[:4]]
    for engine in (big, small):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
    want, got = run(big), run(small)
    assert small.scheduler.num_preemptions > 0
    assert small.stats["spec_accepted"] > 0
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    assert small.scheduler.num_free_blocks == 24


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 23])
def test_stop_string_max_tokens_and_logprobs(demo_artifact: Path, max_tokens: int) -> None:
    """Never past max_tokens or a stop string; logprobs per emitted token, as plain decoding gives."""
    plain, spec = LLMEngine(demo_artifact), LLMEngine(demo_artifact, speculative=SPEC)
    for engine in (plain, spec):
        engine.add_request("len", REPETITIVE, SamplingParams(max_tokens=max_tokens, temperature=0.0), logprobs=2)
        engine.add_request("stop", REPETITIVE, SamplingParams(max_tokens=64, temperature=0.0, stop=["number of the second"]))
    want, got = run(plain), run(spec)
    for rid in ("len", "stop"):
        w, g = want[rid], got[rid]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)  # type: ignore[attr-defined]
    assert got["stop"].finish_reason == "stop" and "number of the second" not in got["stop"].text  # type: ignore[attr-defined]
    assert len(got["len"].token_ids) <= max_tokens  # type: ignore[attr-defined]
    streamed = []
    spec.add_request("s", REPETITIVE, SamplingParams(max_tokens=max_tokens, temperature=0.0), logprobs=2)
    while spec.has_unfinished():
        for out in spec.step():
            streamed += out.new_logprobs or []
    plain.add_request("s", REPETITIVE, SamplingParams(max_tokens=max_tokens, temperature=0.0), logprobs=2)
    ref_lp = []
    while plain.has_unfinished():
        for out in plain.step():
            ref_lp += out.new_logprobs or []
    assert [x.token_id for x in streamed] == [x.token_id for x in ref_lp]
    np.testing.assert_allclose([x.logprob for x in streamed], [x.logprob for x in ref_lp], atol=1e-4)


def test_constrained_requests_do_not_speculate(demo_artifact: Path) -> None:
    pytest.importorskip("llguidance")
    from runtime.structured import StructuredOutput

    engine = LLMEngine(demo_artifact, speculative=SPEC)
    params = SamplingParams(max_tokens=16, temperature=0.0,
                            structured=StructuredOutput(kind="regex", value="(rectangle_width, )+"))
    engine.add_request("g", REPETITIVE, params)
    run(engine)
    assert engine.stats["spec_proposed"] == 0
    # batched with a speculative free request: the constrained row keeps its mask, the free one its tokens
    engine.add_request("g2", REPETITIVE, params, speculative=False)
    alone = run(engine)
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(demo_artifact)
    plain.add_request("f", REPETITIVE, free)
    want = run(plain)["f"].token_ids  # type: ignore[attr-defined]
    engine.add_request("g3", REPETITIVE, params)
    engine.add_request("f", REPETITIVE, free)
    both = run(engine)
    assert both["f"].token_ids == want and engine.stats["spec_proposed"] > 0  # type: ignore[attr-defined]
    assert both["g3"].text == alone["g2"].text  # type: ignore[attr-defined]
    assert ("rectangle_width, " * 16).startswith(both["g3"].text)  # type: ignore[attr-defined]


# ---- sampling: the target distribution ---------------------------------------------------------


def test_rejection_scheme_preserves_the_distribution() -> None:
    """verify_sampled on fixed logits: the first emitted token follows p whatever the proposal (one that
    is likely, one that is unlikely, one outside top-k), and a second accepted position follows its row."""
    rng = np.random.default_rng(0)
    vocab = 12
    rows = rng.normal(0, 1.5, (3, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
    sampler = Sampler()
    p0 = sampler.probs(rows[0], params)
    p1 = sampler.probs(rows[1], params)
    gen = make_rng(1)
    n = 20000
    for x in (int(np.argmax(p0)), int(np.argsort(p0)[-5]), int(np.argmin(p0))):
        first: Counter = Counter()
        second: Counter = Counter()
        y = int(np.argmax(p1))
        for _ in range(n):
            out = verify_sampled(sampler, rows, params, gen, [1], [], [x, y])
            first[out[0]] += 1
            if out[0] == x and len(out) > 1:
                second[out[1]] += 1
        for counts, p in ((first, p0), (second, p1)):
            support = np.flatnonzero(p > 0)
            assert set(counts) <= set(support.tolist())
            total = sum(counts.values())
            if counts is second and p0[x] == 0:  # a proposal outside top-k is never accepted
                assert total == 0
                continue
            assert total > 500
            observed = np.array([counts[int(t)] for t in support])
            _, pvalue = stats.chisquare(observed, p[support] * total)
            assert pvalue > 1e-3, (x, observed, p[support] * total)


def test_rejection_scheme_joint_distribution_of_consecutive_tokens() -> None:
    """Speculative sampling of whole sequences from a bigram model (fixed logits per previous token) with
    2-token point-mass drafts (each row's mode, chained): every pair of consecutive emitted tokens -- within
    one verification, across a rejection, across the bonus token and the next step -- follows the exact joint
    distribution pi_j(a) p(b | a) (chi-square goodness of fit on the 25 cells, pi_j the chain's marginal at
    position j). 20,000 sequences: a proposal accepted 5% more often than p(x) (min(1, 1.05 p(x))) gives
    p-values below 1e-10 for the first pair, far under the bound; the exact scheme gives 0.3 to 0.7."""
    vocab, k, length, n = 5, 2, 4, 20_000
    logits = np.random.default_rng(0).normal(0, 1.5, (vocab, vocab)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    sampler = Sampler()
    p = np.stack([sampler.probs(logits[a], params) for a in range(vocab)])  # p[a, b] = p(b | a)
    mode = p.argmax(axis=1)
    gen = make_rng(1)
    seqs = np.empty((n, length), np.int64)
    accepted = rejected = 0
    for i in range(n):
        tokens: list[int] = []
        while len(tokens) < length:
            draft = [int(mode[tokens[-1] if tokens else 0])]
            draft.append(int(mode[draft[-1]]))
            out = verify_sampled(sampler, logits[[tokens[-1] if tokens else 0, *draft]], params, gen, [0], tokens,
                                 draft)
            accepted += len(out) - 1
            rejected += len(out) <= k
            tokens += out
        seqs[i] = tokens[:length]
    assert accepted > n // 2 and rejected > n // 2, (accepted, rejected)  # both branches well exercised
    marginal = p[0]  # the first token follows the prompt's last token, 0
    for j in range(length - 1):
        expected = (marginal[:, None] * p).ravel() * n
        observed = np.bincount(seqs[:, j] * vocab + seqs[:, j + 1], minlength=vocab * vocab)
        sparse = expected < 5  # pooled: the chi-square approximation needs populated cells
        if sparse.any():
            expected = np.append(expected[~sparse], expected[sparse].sum())
            observed = np.append(observed[~sparse], observed[sparse].sum())
        pvalue = stats.chisquare(observed, expected).pvalue
        assert pvalue > 1e-3, (j, pvalue, observed, expected.round(1))
        marginal = marginal @ p


def test_sampled_speculative_matches_plain_sampling(tiny_vocab_artifact: Path) -> None:
    """Many seeded requests, plain and speculative, on a prompt that ends in the model's own greedy loop (so
    the n-gram proposer has matches the model likes): per output position, the token counts pass a
    chi-square test of homogeneity. At temperature 0.2 about a quarter of the proposals are accepted, so
    both the acceptance and the residual draw are exercised."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 26, 21, 18, 18, 18, 21, 8, 23, 18, 21, 8, 23, 18, 21, 21, 21, 21, 21, 23, 18,
              21, 23, 18, 21, 21]
    assert_sampled_like_plain(tiny_vocab_artifact, prompt, SpeculativeConfig(num_tokens=3), temperature=0.2,
                              min_accepted=600 // 3)


def assert_sampled_like_plain(artifact: Path, prompt: list[int], spec: SpeculativeConfig, temperature: float,
                              min_accepted: int, n: int = 600, length: int = 5) -> None:
    """n seeded requests plain and n speculative: per output position, and per pair of consecutive positions
    (the joint distribution of two tokens), the counts pass a chi-square test of homogeneity, and at least
    `min_accepted` proposals were accepted, n / 3 rejected. (n = 600 finds gross errors end to end; the
    sample size that catches a 5% acceptance error is test_rejection_scheme_joint_distribution_of_consecutive_tokens'.)"""
    counts = {}
    pairs = {}
    for mode in ("plain", "spec"):
        engine = LLMEngine(artifact, max_num_seqs=32, max_num_batched_tokens=512,
                           speculative=spec if mode == "spec" else None)
        for i in range(n):
            engine.add_request(f"{mode}{i}", prompt, SamplingParams(max_tokens=length, temperature=temperature,
                                                                    seed=i, ignore_eos=True))
        outs = run(engine)
        counts[mode] = [Counter(o.token_ids[j] for o in outs.values()) for j in range(length)]  # type: ignore[attr-defined]
        pairs[mode] = [Counter(tuple(o.token_ids[j:j + 2]) for o in outs.values())  # type: ignore[attr-defined]
                       for j in range(length - 1)]
        if mode == "spec":
            st = engine.stats
            assert st["spec_accepted"] > min_accepted and st["spec_proposed"] - st["spec_accepted"] > n // 3, st
    for j in range(length):
        tokens = sorted(set(counts["plain"][j]) | set(counts["spec"][j]))
        table = np.array([[counts[m][j][t] for t in tokens] for m in ("plain", "spec")])
        table = table[:, table.sum(axis=0) >= 10]  # the chi-square approximation needs populated cells
        assert table.shape[1] >= 3
        pvalue = stats.chi2_contingency(table).pvalue
        assert pvalue > 1e-3, (j, table)
    for j in range(length - 1):
        cells = sorted(set(pairs["plain"][j]) | set(pairs["spec"][j]))
        table = np.array([[pairs[m][j][c] for c in cells] for m in ("plain", "spec")])
        table = table[:, table.sum(axis=0) >= 10]
        assert table.shape[1] >= 3
        pvalue = stats.chi2_contingency(table).pvalue
        assert pvalue > 1e-3, ("pair", j, table)


# ---- serving: the server default, the request field, /metrics and `optimize bench` -------------


def test_server_default_request_field_metrics_and_bench(demo_artifact: Path) -> None:
    import asyncio

    from test_server import API_KEY, ServerProcess, post

    from runtime.loadgen import BenchConfig, format_table, run_bench

    server = ServerProcess(demo_artifact, "--api-key", API_KEY, "--speculative", "ngram:k=4")
    try:
        body = {"prompt": REPETITIVE, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        status, _, default = post(server.port, "/v1/completions", body)
        assert status == 200
        before = server.metrics()
        assert before["optimize_spec_decode_draft_tokens_total"] > 0
        status, _, off = post(server.port, "/v1/completions", {**body, "speculative": False})
        assert status == 200 and off["choices"][0]["text"] == default["choices"][0]["text"]
        after = server.metrics()
        assert after["optimize_spec_decode_draft_tokens_total"] == before["optimize_spec_decode_draft_tokens_total"]
        status, _, own = post(server.port, "/v1/completions", {**body, "speculative": {"num_tokens": 2}})
        assert status == 200 and own["choices"][0]["text"] == default["choices"][0]["text"]
        m = server.metrics()
        assert 'optimize_spec_decode_acceptance_rate_per_pos{position="0"}' in m
        assert 0 < m["optimize_spec_decode_acceptance_rate"] <= 1
        assert m['optimize_spec_decode_accepted_tokens_per_pos_total{position="1"}'] <= \
            m['optimize_spec_decode_accepted_tokens_per_pos_total{position="0"}']
        status, _, err = post(server.port, "/v1/completions", {**body, "speculative": {"k": 2}})
        assert status == 400 and err["error"]["param"] == "speculative"

        cfg = BenchConfig(url=server.base, num_requests=3, concurrency=1, input_len=32, output_len=24,
                          api_key=API_KEY, speculative="ngram:k=3")
        report, _ = asyncio.run(run_bench(cfg))
        spec = report["speculative"]
        assert spec["proposed"] > 0 and spec["per_position"][0]["position"] == 0
        assert "spec proposed / accepted" in format_table(report)
    finally:
        server.kill()


def test_ngram_propose_equals_its_definition_on_random_sequences() -> None:
    """The vectorised proposer against the plain definition: for n from ngram_max down to ngram_min, the
    most recent earlier window equal to the last n tokens, and the k tokens after it."""
    import random

    def definition(tokens: list[int], k: int, nmax: int, nmin: int) -> list[int]:
        for n in range(min(nmax, len(tokens) - 1), nmin - 1, -1):
            for end in range(len(tokens) - 2, n - 2, -1):
                if tokens[end - n + 1: end + 1] == tokens[-n:]:
                    return tokens[end + 1: end + 1 + k]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        vocab, size = rng.choice([2, 3, 5, 20]), rng.randint(1, 40)
        tokens = [rng.randrange(vocab) for _ in range(size)]
        nmax = rng.randint(1, 5)
        k, nmin = rng.randint(1, 5), rng.randint(1, nmax)
        assert ngram_propose(tokens, k, nmax, nmin) == definition(tokens, k, nmax, nmin), (tokens, k, nmax, nmin)
