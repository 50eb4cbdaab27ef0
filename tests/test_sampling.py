"""Tests of runtime.sampling: greedy, seeds, top-k, top-p, parameter validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from runtime.sampling import Sampler, SamplingParams, make_generator

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
