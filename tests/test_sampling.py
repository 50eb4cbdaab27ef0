"""Tests of runtime.sampling: greedy, seeds, top-k, top-p, token masks, parameter validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from runtime.sampling import Sampler, SamplingParams, make_generator
from runtime.structured import mask_words

SAMPLER = Sampler()


def _draw(logits: np.ndarray, params: SamplingParams, seed: int) -> np.ndarray:
    b = logits.shape[0]
    return SAMPLER.sample(logits, [params] * b, [make_generator(seed + i) for i in range(b)])


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 20)),
              elements=st.integers(-5, 5).map(float)))
def test_greedy_is_argmax_first_max_on_ties(logits: np.ndarray) -> None:
    out = SAMPLER.sample(logits, [SamplingParams(temperature=0.0)] * logits.shape[0], [None] * logits.shape[0])
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, np.argmax(logits, axis=1))


def test_same_seed_same_tokens() -> None:
    logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    runs = [np.concatenate([_draw(logits, params, seed=7) for _ in range(5)]) for _ in range(2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    other = np.concatenate([_draw(logits, params, seed=8 + 10 * k) for k in range(5)])
    assert not np.array_equal(runs[0], other)


def test_seeded_row_independent_of_batch_neighbours() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 30))
    p = SamplingParams(temperature=1.0)
    alone = SAMPLER.sample(logits[:1], [p], [make_generator(5)])
    together = SAMPLER.sample(logits, [p, p], [make_generator(5), make_generator(99)])
    assert alone[0] == together[0]


@settings(max_examples=30, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(2, 30)),
              elements=st.floats(-10, 10)), st.integers(0, 2**32 - 1))
def test_top_k_1_is_greedy(logits: np.ndarray, seed: int) -> None:
    got = _draw(logits, SamplingParams(temperature=1.3, top_k=1), seed)
    # ties with the max are kept by top-k, so the draw lands on one of the maxima
    assert all(logits[i, t] == logits[i].max() for i, t in enumerate(got))
    unique = logits[(logits == logits.max(axis=1, keepdims=True)).sum(axis=1) == 1]
    if unique.size:
        np.testing.assert_array_equal(_draw(unique, SamplingParams(top_k=1), seed), np.argmax(unique, axis=1))


def test_top_k_support() -> None:
    logits = np.array([3.0, 1.0, 2.0, 0.0, 2.5])
    p = SAMPLER.probs(logits, SamplingParams(top_k=3))
    assert set(np.flatnonzero(p)) == {0, 2, 4}
    assert p.sum() == pytest.approx(1.0)


@pytest.mark.parametrize(("top_p", "nucleus"), [
    (0.3, {0}), (0.49, {0}), (0.6, {0, 1}), (0.79, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_minimal_nucleus(top_p: float, nucleus: set[int]) -> None:
    probs = np.array([0.15, 0.5, 0.05, 0.3])  # sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    order = [1, 3, 0, 2]
    expected = {order[i] for i in nucleus}
    p = SAMPLER.probs(np.log(probs), SamplingParams(top_p=top_p))
    assert set(np.flatnonzero(p)) == expected
    np.testing.assert_allclose(p[list(expected)], probs[list(expected)] / probs[list(expected)].sum())
    drawn = {int(_draw(np.log(probs)[None], SamplingParams(top_p=top_p), s)[0]) for s in range(200)}
    assert drawn <= expected


def test_temperature_changes_sharpness() -> None:
    logits = np.array([2.0, 1.0, 0.0])
    cold = SAMPLER.probs(logits, SamplingParams(temperature=0.5))
    hot = SAMPLER.probs(logits, SamplingParams(temperature=2.0))
    assert cold[0] > hot[0]
    np.testing.assert_allclose(cold, np.exp(logits / 0.5) / np.exp(logits / 0.5).sum())


def test_masked_logits_never_drawn() -> None:
    logits = np.array([[-np.inf, 0.0, -np.inf, 0.0]])
    drawn = {int(_draw(logits, SamplingParams(), s)[0]) for s in range(100)}
    assert drawn == {1, 3}


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": -1}, {"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0},
    {"top_p": 1.5}, {"top_k": -1}, {"seed": -3}, {"stop": "x"}, {"stop_token_ids": [-1]},
])
def test_validate_rejects(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_defaults_and_edges() -> None:
    SamplingParams().validate()
    SamplingParams(max_tokens=0, temperature=0.0, top_k=1, top_p=1.0, seed=0, stop=["\n"]).validate()


def test_sample_checks_lengths() -> None:
    with pytest.raises(ValueError, match="rows"):
        SAMPLER.sample(np.zeros((2, 4)), [SamplingParams()], [make_generator(0)])
    with pytest.raises(ValueError, match="NaN"):
        SAMPLER.sample(np.array([[0.0, np.nan]]), [SamplingParams()], [make_generator(0)])


# ---- C sampler against its twin; every option against a hand-computed distribution ------------

from runtime.core import _core, reference  # noqa: E402
from runtime.sampling import TokenLogprobs  # noqa: E402

SAMPLERS = [pytest.param(Sampler("c"), id="c"), pytest.param(Sampler("python"), id="python")]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@st.composite
def sampling_case(draw: st.DrawFn):
    b = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([1, 2, 5, 37, 300, 5000]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(b, vocab)) * draw(st.sampled_from([0.1, 1.0, 8.0]))).astype(dtype)
    if draw(st.booleans()):  # ties and masked tokens
        logits = np.round(logits).astype(dtype)
        logits[rng.random(size=logits.shape) < 0.2] = -np.inf
        logits[:, 0] = 0.0  # keep a finite maximum
    params, prompts, outputs = [], [], []
    for _ in range(b):
        p = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 1.7])),
            top_k=draw(st.sampled_from([0, 1, 2, 5, 1000])),
            top_p=draw(st.sampled_from([1.0, 0.95, 0.5, 0.1])),
            min_p=draw(st.sampled_from([0.0, 0.05, 0.5])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
            presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.25, -0.5])),
            logprobs=draw(st.sampled_from([None, 0, 1, 5])),
            seed=draw(st.integers(0, 2**70)),
        )
        p.logprobs = None if p.logprobs is None else min(p.logprobs, vocab)
        prompts.append(rng.integers(0, vocab, int(rng.integers(0, 6))).tolist())
        outputs.append(rng.integers(0, vocab, int(rng.integers(0, 9))).tolist())
        params.append(p)
    return logits, params, prompts, outputs


@settings(max_examples=300, deadline=None)
@given(sampling_case())
def test_c_and_twin_sample_the_same_tokens_and_logprobs(case) -> None:
    logits, params, prompts, outputs = case
    c_rngs = [make_generator(p.seed) for p in params]
    p_rngs = [make_generator(p.seed) for p in params]
    for _ in range(3):  # three steps: the RNG streams advance identically
        tc, lc = Sampler("c").sample(logits, params, c_rngs, prompt_ids=prompts, output_ids=outputs, logprobs=True)
        tp, lp = Sampler("python").sample(logits, params, p_rngs, prompt_ids=prompts, output_ids=outputs,
                                          logprobs=True)
        np.testing.assert_array_equal(tc, tp)
        assert lc == lp  # bit-identical floats
        for a, b in zip(c_rngs, p_rngs, strict=True):
            np.testing.assert_array_equal(a.state, b.state)
    for i, p in enumerate(params):
        pc = Sampler("c").probs(logits[i], p, prompt_ids=prompts[i], output_ids=outputs[i])
        pp = Sampler("python").probs(logits[i], p, prompt_ids=prompts[i], output_ids=outputs[i])
        assert pc.tobytes() == pp.tobytes()
        assert pc[tc[i]] > 0 and pc.sum() == pytest.approx(1.0)


def test_exp_neg_is_exact_enough_and_the_same_in_c() -> None:
    x = np.concatenate([-np.linspace(0, 750, 20001), [-0.0, -1e-300, -708.0, -np.inf]])
    got = reference.exp_neg(x)
    want = np.exp(x)
    ok = x >= -708
    np.testing.assert_allclose(got[ok], want[ok], rtol=4e-16 * 4, atol=0)
    assert (got[~ok] == 0).all() and got[0] == 1.0
    # the C sampler's weights for a row of zeros minus x are the same exp (temperature 1, no filters)
    row = x[ok][:2000]
    out = np.empty(row.size)
    _core.sample_probs(row, SamplingParams(), None, None, out)
    e = reference.exp_neg(row - row.max())
    np.testing.assert_array_equal(out, e / reference._lane_sum(e))


def test_rng_is_xoshiro256starstar_seeded_by_splitmix64() -> None:
    g = make_generator(0)
    # splitmix64(0) words and the first xoshiro256** outputs, from Vigna's reference C code
    assert [hex(int(v)) for v in g.state] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4", "0x6c45d188009454f",
                                             "0xf88bb8a8724c81ec"]
    assert [g.next_u64() for _ in range(3)] == [0x99EC5F36CB75F2B4, 0xBF6E1F784956452A, 0x1A5F849D4933E6E0]
    assert make_generator(2**64 + 5).state.tolist() == make_generator(4).state.tolist()  # 64-bit words folded
    u = [make_generator(9).random() for _ in range(1)] + [g.random() for _ in range(1000)]
    assert all(0.0 <= v < 1.0 for v in u)
    with pytest.raises(ValueError, match="all zero"):
        reference.RNG(np.zeros(4, np.uint64))


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_hand_computed_temperature_top_k_top_p_min_p(sampler: Sampler) -> None:
    logits = np.array([2.0, 1.0, 0.0])
    np.testing.assert_allclose(sampler.probs(logits, SamplingParams(temperature=0.5)), softmax(logits / 0.5), rtol=1e-14)
    x = np.array([3.0, 1.0, 2.0, 0.0, 2.5])
    p = sampler.probs(x, SamplingParams(top_k=3))
    want = np.zeros(5)
    want[[0, 2, 4]] = softmax(x[[0, 2, 4]])
    np.testing.assert_allclose(p, want, rtol=1e-14, atol=1e-300)
    ties = sampler.probs(np.array([1.0, 1.0, 1.0, 0.0]), SamplingParams(top_k=2))
    np.testing.assert_allclose(ties, [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-14)  # ties with the k-th are kept
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    for min_p, keep in [(0.2, [0, 1, 2]), (0.5, [0, 1]), (0.61, [0]), (0.0, [0, 1, 2, 3])]:
        want = np.zeros(4)
        want[keep] = probs[keep] / probs[keep].sum()
        np.testing.assert_allclose(sampler.probs(np.log(probs), SamplingParams(min_p=min_p)), want, rtol=1e-13,
                                   err_msg=f"min_p={min_p}")
    # top-p then min-p: top_p=0.9 keeps {0, 1, 2}; min_p=0.4 of the top (0.5) drops 2 (0.15 < 0.2)
    want = np.array([0.5, 0.3, 0, 0]) / 0.8
    np.testing.assert_allclose(sampler.probs(np.log(probs), SamplingParams(top_p=0.9, min_p=0.4)), want, rtol=1e-13)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_hand_computed_penalties(sampler: Sampler) -> None:
    logits = np.array([2.0, -1.0, 0.5, 1.0])
    # repetition 2 on prompt {0} and output {1}: 2.0 / 2 = 1.0, -1.0 * 2 = -2.0 (counts do not matter)
    p = sampler.probs(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 0], output_ids=[1, 1, 1])
    np.testing.assert_allclose(p, softmax(np.array([1.0, -2.0, 0.5, 1.0])), rtol=1e-14)
    # frequency 0.5 per occurrence and presence 0.25 once, on output tokens only (not the prompt's 3)
    flat = np.ones(4)
    p = sampler.probs(flat, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt_ids=[3],
                      output_ids=[0, 0, 2])
    np.testing.assert_allclose(p, softmax(np.array([1 - 1.0 - 0.25, 1.0, 1 - 0.5 - 0.25, 1.0])), rtol=1e-14)
    # penalties come before temperature, and greedy sees them too
    p = sampler.probs(logits, SamplingParams(temperature=0.5, repetition_penalty=4.0), prompt_ids=[], output_ids=[0])
    np.testing.assert_allclose(p, softmax(np.array([0.5, -1.0, 0.5, 1.0]) / 0.5), rtol=1e-14)
    tok = sampler.sample(logits[None], [SamplingParams(temperature=0.0, repetition_penalty=4.0)], [None],
                         prompt_ids=[[]], output_ids=[[0]])
    assert tok.tolist() == [3]
    with pytest.raises(ValueError, match="penalties need"):
        sampler.sample(logits[None], [SamplingParams(presence_penalty=0.5)], [make_generator(0)])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_draws_follow_the_distribution(sampler: Sampler) -> None:
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=0)  # nucleus {1, 3, 4}: 0.4, 0.3, 0.15
    want = sampler.probs(logits, params)
    n = 4000
    gens = [make_generator(s) for s in range(n)]
    toks = sampler.sample(np.tile(logits, (n, 1)), [params] * n, gens)
    freq = np.bincount(toks, minlength=5) / n
    assert set(np.flatnonzero(freq)) <= {1, 3, 4}
    np.testing.assert_allclose(freq, want, atol=0.03)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_logprobs_of_the_raw_logits(sampler: Sampler) -> None:
    logits = np.array([[1.0, 3.0, 3.0, -2.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, logprobs=0, top_k=1)]
    toks, lps = sampler.sample(logits, params, [None, make_generator(1)], logprobs=True)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    assert toks.tolist()[0] == 1
    a, b = lps
    assert isinstance(a, TokenLogprobs) and a.token_id == 1 and a.top_ids == [1, 2, 0]  # ties: lower id first
    np.testing.assert_allclose([a.logprob, *a.top_logprobs], [ref[0, 1], ref[0, 1], ref[0, 2], ref[0, 0]], rtol=1e-13)
    assert b.top_ids == [] and b.logprob == pytest.approx(np.log(0.2), rel=1e-13)  # raw: before top-k/temperature
    assert sampler.sample(logits, params, [None, make_generator(1)], logprobs=False).tolist() == toks.tolist()
    _, none = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None], logprobs=True)
    assert none == [None, None]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_errors_leave_generators_untouched(sampler: Sampler) -> None:
    logits = np.zeros((2, 4))
    logits[1, 2] = np.nan
    gens = [make_generator(1), make_generator(2)]
    before = [g.state.copy() for g in gens]
    with pytest.raises(ValueError, match="row 1 contains NaN"):
        sampler.sample(logits, [SamplingParams()] * 2, gens)
    assert all(np.array_equal(g.state, s) for g, s in zip(gens, before, strict=True))
    with pytest.raises(ValueError, match="no finite maximum"):
        sampler.sample(np.full((1, 3), -np.inf), [SamplingParams()], gens[:1])
    assert np.array_equal(gens[0].state, before[0])


def test_sampler_errors_match_twin() -> None:
    good = np.zeros((2, 4), np.float32)
    gp = [SamplingParams(), SamplingParams()]

    def call(impl, *args):
        b = np.asarray(args[0]).shape[0] if np.asarray(args[0]).ndim == 2 else 1
        out = np.zeros(b, np.int64)
        try:
            impl.sample(*args[:5], out, *args[5:])
        except Exception as exc:  # noqa: BLE001
            return type(exc), str(exc)
        return None

    class NoMinP:
        temperature, top_k, top_p = 1.0, 0, 1.0

    cases = [
        (good, [SamplingParams(temperature=-1)] * 2, [make_generator(0)] * 2, None, None),
        (good, [SamplingParams(top_p=0.0)] * 2, [make_generator(0)] * 2, None, None),
        (good, [SamplingParams(min_p=2.0)] * 2, [make_generator(0)] * 2, None, None),
        (good, [SamplingParams(repetition_penalty=0.0)] * 2, [make_generator(0)] * 2, None, None),
        (good, [SamplingParams(top_k=1.5)] * 2, [make_generator(0)] * 2, None, None),
        (good, [SamplingParams(top_k=-2)] * 2, [make_generator(0)] * 2, None, None),
        (good, [SamplingParams(temperature="hot")] * 2, [make_generator(0)] * 2, None, None),
        (good, [SamplingParams(temperature=float("inf"))] * 2, [make_generator(0)] * 2, None, None),
        (good, [NoMinP()] * 2, [make_generator(0)] * 2, None, None),
        (good, gp, [None, None], None, None),
        (good, gp, [object(), make_generator(0)], None, None),
        (good, gp, [make_generator(0)], None, None),
        (good, gp[:1], [make_generator(0)] * 2, None, None),
        (good, gp, [make_generator(0)] * 2, [[1], [9]], None),
        (good, gp, [make_generator(0)] * 2, None, [[1], [-1]]),
        (good, gp, [make_generator(0)] * 2, None, [[1], [1.5]]),
        (good, gp, [make_generator(0)] * 2, None, [[1]]),
        (good, [SamplingParams(frequency_penalty=1.0)] * 2, [make_generator(0)] * 2, [[1], None], [[1], [2]]),
    ]
    for args in cases:
        c, p = call(_core, *args), call(reference, *args)
        assert c is not None and c == p, (args[1][0] if args[1] else None, c, p)
    buffers = [  # the logits buffer itself: same exception type, messages name the dtype differently
        (good[0], gp, [make_generator(0)] * 2, None, None),
        (good.astype(np.float16), gp, [make_generator(0)] * 2, None, None),
        (good.T, gp, [make_generator(0)] * 2, None, None),
        (np.zeros((2, 0), np.float32), gp, [make_generator(0)] * 2, None, None),
        ([[0.0, 1.0]], gp[:1], [make_generator(0)], None, None),
    ]
    for args in buffers:
        c, p = call(_core, *args), call(reference, *args)
        assert c is not None and p is not None and c[0] == p[0] and "logits" in c[1] and "logits" in p[1], (c, p)
    # logprobs wider than the output, and output buffers of the wrong kind (types match; texts differ)
    lp = (np.zeros(2), np.zeros((2, 1), np.int64), np.zeros((2, 1)))
    args = (good, [SamplingParams(logprobs=2)] * 2, [make_generator(0)] * 2, None, None, lp)
    assert call(_core, *args) == call(reference, *args)
    for bad_out in (np.zeros(2, np.int32), np.zeros(3, np.int64), np.zeros(2, np.int64)[::1].reshape(1, 2)):
        for impl in (_core, reference):
            with pytest.raises(ValueError, match="tokens_out"):
                impl.sample(good, gp, [make_generator(0)] * 2, None, None, bad_out)


# --------------------------------------------------------------------------------------------
# Token masks (structured output): C and the twin apply them the same, bit for bit
# --------------------------------------------------------------------------------------------


def _pack(allowed: np.ndarray) -> np.ndarray:
    """bool [B, V] -> int32 [B, ceil(V / 32)] (bit i % 32 of word i // 32 = token i), written independently
    of the samplers' unpacking."""
    b, v = allowed.shape
    words = np.zeros((b, mask_words(v)), np.uint32)
    for i in range(b):
        for t in np.flatnonzero(allowed[i]):
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


@st.composite
def masked_case(draw: st.DrawFn):
    b = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([1, 2, 31, 32, 33, 64, 300, 5000]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(b, vocab)) * draw(st.sampled_from([0.1, 1.0, 8.0]))).astype(dtype)
    if draw(st.booleans()):  # ties and -inf logits
        logits = np.round(logits).astype(dtype)
        logits[rng.random(size=logits.shape) < 0.2] = -np.inf
    allowed = np.zeros((b, vocab), bool)
    params = []
    for i in range(b):
        kind = draw(st.sampled_from(["all", "dense", "sparse", "one"]))
        if kind == "all":
            allowed[i] = True
        elif kind == "one":
            allowed[i, draw(st.integers(0, vocab - 1))] = True
        else:
            allowed[i] = rng.random(vocab) < (0.9 if kind == "dense" else 0.02)
        keep = draw(st.integers(0, vocab - 1))
        allowed[i, keep] = True
        logits[i, keep] = 0.0  # an allowed token with a finite logit
        p = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 1.7])),
            top_k=draw(st.sampled_from([0, 1, 2, 5, 1000])),
            top_p=draw(st.sampled_from([1.0, 0.95, 0.5, 0.1])),
            min_p=draw(st.sampled_from([0.0, 0.05, 0.5])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.25])),
            logprobs=draw(st.sampled_from([None, 0, 3])),
            seed=draw(st.integers(0, 2**70)),
        )
        p.logprobs = None if p.logprobs is None else min(p.logprobs, vocab)
        params.append(p)
    masks = _pack(allowed)
    if draw(st.booleans()):  # bits past the vocabulary in the last word mean nothing
        masks.view(np.uint32)[:, -1] |= np.uint32(~((1 << (vocab % 32)) - 1) & 0xFFFFFFFF if vocab % 32 else 0)
    prompts = [rng.integers(0, vocab, 3).tolist() for _ in range(b)]
    outputs = [rng.integers(0, vocab, 5).tolist() for _ in range(b)]
    return logits, allowed, masks, params, prompts, outputs


@settings(max_examples=300, deadline=None)
@given(masked_case())
def test_c_and_twin_apply_token_masks_bit_identically(case) -> None:
    logits, allowed, masks, params, prompts, outputs = case
    c_rngs = [make_generator(p.seed) for p in params]
    p_rngs = [make_generator(p.seed) for p in params]
    o_rngs = [make_generator(p.seed) for p in params]
    # the oracle: a disallowed token is one whose logit is -inf (a mask is nothing more)
    neg = np.where(allowed, logits, -np.inf).astype(logits.dtype)
    kw = {"prompt_ids": prompts, "output_ids": outputs}
    for _ in range(3):  # three steps: the RNG streams advance identically
        tc, lc = Sampler("c").sample(logits, params, c_rngs, masks=masks, logprobs=True, **kw)
        tp, lp = Sampler("python").sample(logits, params, p_rngs, masks=masks, logprobs=True, **kw)
        np.testing.assert_array_equal(tc, tp)
        assert lc == lp  # bit-identical floats; raw logits, so the mask does not change them
        for a, b in zip(c_rngs, p_rngs, strict=True):
            np.testing.assert_array_equal(a.state, b.state)
        assert all(allowed[i, t] for i, t in enumerate(tc))
        np.testing.assert_array_equal(Sampler("c").sample(neg, params, o_rngs, **kw), tc)
    for i, p in enumerate(params):
        pc = Sampler("c").probs(logits[i], p, prompt_ids=prompts[i], output_ids=outputs[i], mask=masks[i])
        pp = Sampler("python").probs(logits[i], p, prompt_ids=prompts[i], output_ids=outputs[i], mask=masks[i])
        assert pc.tobytes() == pp.tobytes()
        assert not pc[~allowed[i]].any() and pc.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("impl", ["c", "python"])
def test_mask_errors_are_the_same_in_c_and_twin(impl: str) -> None:
    s = Sampler(impl)
    x = np.zeros((2, 40), np.float32)
    params, gens = [SamplingParams()] * 2, [make_generator(1), make_generator(2)]
    with pytest.raises(TypeError, match="masks: expected int32 words"):
        s.sample(x, params, gens, masks=np.full((2, 2), -1, np.int64))
    with pytest.raises(ValueError, match=r"masks: expected shape \[rows of logits, 2 words"):
        s.sample(x, params, gens, masks=np.full((2, 3), -1, np.int32))
    none = np.full((2, 2), -1, np.int32)
    none[1] = 0
    before = [g.state.copy() for g in gens]
    with pytest.raises(ValueError, match="logits row 1: its token mask allows no token with a finite logit"):
        s.sample(x, params, gens, masks=none)
    assert all((g.state == b).all() for g, b in zip(gens, before, strict=True))  # nothing advanced
    inf = np.full((2, 2), -1, np.int32)
    inf[0] = [1 << 3, 0]
    x[0, 3] = -np.inf
    with pytest.raises(ValueError, match="logits row 0: its token mask"):
        s.sample(x, [SamplingParams(temperature=0.0)] * 2, [None, None], masks=inf)
