"""Known answers for the quality gate's metrics (compiler.build: `_Comparison`, `token_agreement`;
runtime.evaluate: `prefix_agreement`).

The build tests bound these metrics loosely (any KL below 0.01-1.0, any agreement above 0.1-0.9),
which a KL stuck at 0 or an agreement stuck at 1.0 would pass. Here the "models" are bigram tables
of hand-written probabilities over six tokens (the next-token distribution depends on the last token
only), so every metric has a value computed by hand:

- the reference (the role of the unoptimised torch model) puts 0.7 on token (t + 1) % 6 after token
  t and 0.06 on each other token;
- the "artifact" (the role of the runtime backend) equals it except after token 2, where tokens 3
  and 0 swap probabilities (its argmax disagrees), and after token 4, where it puts 0.5 on token 5
  and 0.1 on each other token (same argmax, a smaller KL). Its logits are log-probabilities plus a
  constant, which the metrics' softmax must remove.

KL(p || q) after token 2 = 0.7 ln(0.7/0.06) + 0.06 ln(0.06/0.7) = 0.64 ln(0.7/0.06)
KL(p || q) after token 4 = 0.7 ln(0.7/0.5) + 5 * 0.06 ln(0.06/0.1)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from compiler.build import _Comparison, token_agreement
from runtime.evaluate import prefix_agreement

V = 6
KL_AFTER_2 = 0.64 * math.log(0.7 / 0.06)  # 1.5723...
KL_AFTER_4 = 0.7 * math.log(0.7 / 0.5) + 0.3 * math.log(0.06 / 0.1)  # 0.0823...


def reference_table() -> np.ndarray:
    p = np.full((V, V), 0.06)
    for t in range(V):
        p[t, (t + 1) % V] = 0.7
    return p


def artifact_table() -> np.ndarray:
    q = reference_table()
    q[2, 3], q[2, 0] = 0.06, 0.7  # argmax after token 2 is 0, not 3: one forced disagreement
    q[4] = 0.1
    q[4, 5] = 0.5
    return q


class BigramBackend:
    """The runtime backend's interface (forward(ForwardBatch) -> logits of the logits_index rows)."""

    block_size = 16
    num_blocks = 64

    def __init__(self, probs: np.ndarray, shift: float = 0.0) -> None:
        self.logits = (np.log(probs) + shift).astype(np.float32)

    def forward(self, fb) -> np.ndarray:
        return self.logits[fb.input_ids[fb.logits_index]]


class BigramReference(torch.nn.Module):
    """The reference model's interface (LlamaForwardBatchModel's call signature, cfg, block_size)."""

    block_size = 16

    def __init__(self, probs: np.ndarray) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(num_kv_heads=1, head_dim=1, num_layers=1)
        self.logits = torch.from_numpy(np.log(probs))

    def forward(self, input_ids, positions, cu_seqlens, past_lens, block_table, logits_index, *kv):
        return (self.logits[input_ids[logits_index]],)


def test_known_kl_and_perplexity_on_eval_chunks() -> None:
    """Two chunks of 256 tokens that follow the reference's chain 0 1 2 3 4 5 0 ...: 2 x 255 scored
    positions, 85 of them after token 2 and 85 after token 4 (chunk 0 starts at token 0: 42 cycles
    + 0 1 2; chunk 1 starts at token 4: 42 cycles + 4 5 0)."""
    ids = [i % V for i in range(512)]
    compare = _Comparison(BigramBackend(artifact_table(), shift=5.0), BigramReference(reference_table()))
    result = compare.perplexity(ids, max_tokens=10_000)
    assert (result.chunks, result.predictions) == (2, 510)
    assert compare.mean_kl() == pytest.approx(85 * (KL_AFTER_2 + KL_AFTER_4) / 510, rel=1e-6)
    assert compare.reference_perplexity() == pytest.approx(1 / 0.7, rel=1e-9)
    nll = (85 * -math.log(0.06) + 85 * -math.log(0.5) + 340 * -math.log(0.7)) / 510
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-6)


def test_known_token_agreement_and_decode_kl() -> None:
    """Greedy continuations of 3 tokens: prompt ...0 visits rows 0 1 2, prompt ...3 rows 3 4 5; one
    of the six steps (after token 2) disagrees."""
    prompts = [[5, 0], [1, 2, 3]]
    agreement, decode_kl = token_agreement(BigramBackend(artifact_table(), shift=-3.0),
                                           BigramReference(reference_table()), prompts, 3)
    assert agreement == pytest.approx(5 / 6, abs=1e-12)
    assert decode_kl == pytest.approx((KL_AFTER_2 + KL_AFTER_4) / 6, rel=1e-6)


def test_identical_models_agree_fully_with_zero_kl() -> None:
    backend, reference = BigramBackend(reference_table(), shift=2.0), BigramReference(reference_table())
    agreement, decode_kl = token_agreement(backend, reference, [[0], [4, 4]], 4)
    assert agreement == 1.0 and abs(decode_kl) < 1e-7
    compare = _Comparison(backend, reference)
    compare.perplexity([i % V for i in range(256)], max_tokens=10_000)
    assert abs(compare.mean_kl()) < 1e-7


def test_prefix_agreement_known_values() -> None:
    # first pair: 1 2 agree, 9 != 3 ends it (3 tokens compared); second: 2 of 2; third: 0 of 1
    assert prefix_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == pytest.approx(4 / 5)
    assert prefix_agreement([[1, 2, 3, 4], [5, 6], [7]], [[1, 2, 9, 4], [5, 6], [8]]) == pytest.approx(4 / 6)
    assert prefix_agreement([[1, 2]], [[1, 2, 3]]) == 1.0  # compared up to the shorter one


# ------------------------------------------------------------------------------ error bars and the interval rule


def test_known_paired_delta_and_interval() -> None:
    """Chunk differences 0.01 and 0.03 nats: mean 0.02, sd 0.01 sqrt(2), se 0.01; the interval is
    0.02 +- 1.96 x 0.01 nats, in % 100 (exp(.) - 1)."""
    from runtime.evaluate import Z95, paired_delta

    d = paired_delta([2.01, 3.03], [2.0, 3.0])
    assert (d.chunks, d.mean_diff, d.se) == (2, pytest.approx(0.02, abs=1e-12), pytest.approx(0.01, abs=1e-12))
    assert d.pct == pytest.approx(100 * (math.exp(0.02) - 1), rel=1e-12)
    assert d.se_pct == pytest.approx(math.exp(0.02), rel=1e-9)  # 100 exp(0.02) x 0.01
    lo, hi = d.ci_pct
    assert lo == pytest.approx(100 * (math.exp(0.02 - Z95 * 0.01) - 1), rel=1e-9)  # +0.0400 %
    assert hi == pytest.approx(100 * (math.exp(0.02 + Z95 * 0.01) - 1), rel=1e-9)  # +4.0816 %
    assert Z95 == pytest.approx(1.959964, abs=1e-6)
    assert math.isinf(paired_delta([1.0], [0.5]).se) and paired_delta([1.0], [0.5]).ci_pct == (-math.inf, math.inf)


def test_interval_rule_known_answers() -> None:
    """The gate passes a change bound only when the whole interval is at or below it."""
    from compiler.build import decide_interval

    assert decide_interval(0.04, 4.08, 4.1) == "within"
    assert decide_interval(0.04, 4.08, 4.08) == "within"  # the upper end on the bound
    assert decide_interval(0.04, 4.08, 2.0) == "undecided"  # the point estimate (2.02) is above: not shown
    assert decide_interval(0.04, 4.08, 0.03) == "exceeded"
    assert decide_interval(-math.inf, math.inf, 100.0) == "undecided"  # one chunk: no se, never judged


def test_known_delta_through_the_comparison_and_the_gate_rule() -> None:
    """Four chunks through the gate's comparison: two follow the reference's chain 0 1 2 3 4 5 0 ...
    from token 0 (42 of the 255 predictions come after token 4, where the artifact gives the next
    token 0.5 instead of 0.7: a = 42 ln(1.4) / 255 nats per chunk), two repeat token 0 (both models
    0.06: difference 0). d = [a, 0, a, 0]: mean a/2, sd a/sqrt(3), se a/(2 sqrt(3))."""
    from compiler.build import decide_interval
    from runtime.evaluate import Z95

    chain = [i % V for i in range(256)]
    ids = chain + [0] * 256 + chain + [0] * 256
    q = reference_table()
    q[4] = 0.1  # the artifact's only change: after token 4, 0.5 on token 5
    q[4, 5] = 0.5
    compare = _Comparison(BigramBackend(q, shift=1.0), BigramReference(reference_table()))
    compare.perplexity(ids, max_tokens=None)
    a = 42 * math.log(1.4) / 255
    d = compare.delta()
    assert d.chunks == 4
    assert d.mean_diff == pytest.approx(a / 2, rel=1e-6)  # the backend's logits are float32
    assert d.se == pytest.approx(a / (2 * math.sqrt(3)), rel=1e-6)
    lo, hi = d.ci_pct
    assert (lo, hi) == (pytest.approx(100 * math.expm1(a / 2 - Z95 * a / (2 * math.sqrt(3))), rel=1e-5),
                        pytest.approx(100 * math.expm1(a / 2 + Z95 * a / (2 * math.sqrt(3))), rel=1e-6))
    assert (round(lo, 3), round(hi, 3)) == (-0.364, 6.084)  # by hand: a = 0.055419
    # the point change is 2.81 %: a 3 % bound is not shown to hold, 7 % is, and neither is exceeded
    assert d.pct == pytest.approx(100 * math.expm1(a / 2), rel=1e-6) and round(d.pct, 2) == 2.81
    assert [decide_interval(lo, hi, b) for b in (3.0, 7.0)] == ["undecided", "within"]
    assert compare.reference_perplexity() == pytest.approx(math.exp(
        (2 * -math.log(0.7) + 2 * -math.log(0.06)) / 4), rel=1e-9)


def test_eval_size_rule_known_answers() -> None:
    """The gate's default size: pilot sd (in %) s, bound B -> (s / (B / (4 z)))^2 chunks, clipped to the
    pilot and the text."""
    from compiler.build import PILOT_CHUNKS, eval_size
    from runtime.evaluate import Z95, PairedDelta

    se = 0.01 / math.sqrt(PILOT_CHUNKS)  # per-chunk sd 0.01 nats = 1 % at a change near 0
    pilot = PairedDelta(PILOT_CHUNKS, 0.0, se)
    n, rec = eval_size(pilot, 0.5, 400)
    assert rec["needed_chunks"] == math.ceil((1.0 / (0.5 / (4 * Z95))) ** 2) == 246 and n == 246
    n, rec = eval_size(pilot, 0.5, 200)  # more than the text has: all of it, said so
    assert n == 200 and "note" in rec
    n, _ = eval_size(pilot, 5.0, 400)  # a loose bound: the pilot is enough
    assert n == PILOT_CHUNKS
    assert eval_size(None, None, 400)[0] == PILOT_CHUNKS and eval_size(pilot, None, 10)[0] == 10
