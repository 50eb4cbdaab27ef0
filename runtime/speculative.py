"""Speculative decoding: what to propose (n-gram prompt lookup) and how to verify it exactly.

A request that opts in gets, before each step, up to k proposed tokens (its *draft*); the scheduler
runs its last token plus the draft as one chunk (`Scheduler.schedule(drafts)`), the engine asks for
the logits of every position of that chunk, and `verify_greedy` / `verify_sampled` decide how many
proposals to keep plus one more token. Both are exact:

- greedy: row j's token is what plain greedy decoding would pick after the accepted prefix (the
  sampler itself, with row j's own token history for penalties); the draft is kept while it agrees,
  then the model's token at the first disagreement (or after the last proposal) is added;
- sampling: the standard rejection scheme (Leviathan et al. 2023; Chen et al. 2023) with a point-mass
  draft distribution q = 1[x]: proposal x is accepted with probability min(1, p(x) / q(x)) = p(x), and
  on rejection the token is drawn from the residual max(p - q, 0) renormalised, i.e. p with x removed;
  after k accepted proposals a bonus token is drawn from row k. Every emitted token is thus distributed
  exactly as p, the distribution plain sampling draws from (after penalties, temperature, top-k/p,
  min-p: `Sampler.probs`). The request's generator supplies the uniforms, so a seed reproduces a
  speculative run, though not the tokens of a plain run with the same seed.

The n-gram proposer (prompt lookup decoding) needs no second model: it finds the most recent earlier
occurrence of the last n tokens (n from `ngram_max` down to `ngram_min`) in prompt + output and
proposes the k tokens that followed it. The draft-model proposer (method "draft", runtime/draft.py)
runs a second, smaller artifact with the same tokenizer greedily for k tokens; its proposals are a
point mass too, so the same verification keeps it exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.core import RNG
from runtime.sampling import Sampler, SamplingParams

__all__ = ["SpeculativeConfig", "ngram_propose", "verify_greedy", "verify_sampled"]

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one request speculates: `method` "ngram" (prompt lookup, matching the last `ngram_max` ..
    `ngram_min` tokens) or "draft" (the engine's draft model; the n-gram fields are unused), up to
    `num_tokens` proposals per step."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name, low, high in (("num_tokens", 1, 32), ("ngram_max", 1, 64), ("ngram_min", 1, 64)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative {name} must be an integer in [{low}, {high}], got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")

    @classmethod
    def from_dict(cls, obj: Any) -> SpeculativeConfig:
        """From a JSON object (the API's `speculative` field): {"method": "ngram", "num_tokens": 4, ...}."""
        if not isinstance(obj, dict):
            raise ValueError(f"speculative must be an object, true or false, got {obj!r}")
        unknown = set(obj) - {"method", "num_tokens", "ngram_max", "ngram_min"}
        if unknown:
            raise ValueError(f"speculative: unknown field(s) {', '.join(sorted(unknown))}")
        cfg = cls(**obj)
        cfg.validate()
        return cfg

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the command line: "ngram", "ngram:k=4", "ngram:k=6,n=4,min=2", "draft", "draft:k=4"."""
        method, _, rest = text.strip().partition(":")
        names = {"k": "num_tokens"} if method == "draft" else {"k": "num_tokens", "n": "ngram_max", "min": "ngram_min"}
        kwargs: dict[str, Any] = {"method": method}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in names:
                raise ValueError(f"speculative option {item!r}: expected "
                                 + ("k=N" if method == "draft" else "k=N, n=N or min=N"))
            try:
                kwargs[names[key.strip()]] = int(value)
            except ValueError:
                raise ValueError(f"speculative option {item!r}: {value!r} is not an integer") from None
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg


def ngram_propose(tokens: Sequence[int] | np.ndarray, k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens`
    (ngram_max .. ngram_min tokens long) found elsewhere in `tokens`; [] when none is found.

    One vectorised pass: the earlier positions holding the last token are the candidate match ends, and
    each candidate's match is extended backwards one token at a time (at most ngram_max - 1 times)."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    longest = min(ngram_max, size - 1)
    if k < 1 or longest < ngram_min:
        return []
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # matches of length 1, ending before the suffix itself
    if ends.size == 0:
        return []
    length = np.ones(ends.size, np.int64)
    alive = np.ones(ends.size, bool)
    for m in range(1, longest):
        idx = ends - m
        alive &= idx >= 0
        alive &= arr[np.maximum(idx, 0)] == arr[size - 1 - m]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < ngram_min:
        return []
    end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest matches
    return arr[end + 1: end + 1 + k].tolist()


def verify_greedy(sampler: Sampler, rows: np.ndarray, params: SamplingParams, generator: RNG,
                  prompt_ids: list[int], output_ids: list[int], draft: list[int]) -> list[int]:
    """Accepted proposals + the next token: rows[j] are the logits after output + draft[:j]."""
    n = len(draft) + 1
    if params.has_penalties:
        picks = sampler.sample(rows, [params] * n, [generator] * n, prompt_ids=[prompt_ids] * n,
                               output_ids=[output_ids + draft[:j] for j in range(n)])
    else:
        picks = sampler.sample(rows, [params] * n, [generator] * n)
    out: list[int] = []
    for j in range(n):
        tok = int(picks[j])
        out.append(tok)
        if j == len(draft) or tok != draft[j]:
            break
    return out


def _draw(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of one token from unnormalised weights p >= 0 with u in [0, 1)."""
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(i, p.shape[0] - 1) if cdf[-1] > 0 else int(np.argmax(p))


def verify_sampled(sampler: Sampler, rows: np.ndarray, params: SamplingParams, generator: RNG,
                   prompt_ids: list[int], output_ids: list[int], draft: list[int]) -> list[int]:
    """Rejection sampling against a point-mass draft (module doc): accepted proposals + one drawn token."""
    history = prompt_ids if params.has_penalties else None
    out: list[int] = []
    for j in range(len(draft) + 1):
        p = sampler.probs(rows[j], params, prompt_ids=history,
                          output_ids=(output_ids + draft[:j]) if params.has_penalties else None)
        if j == len(draft):  # every proposal accepted: the bonus token comes from the last row
            out.append(_draw(p, generator.random()))
            break
        x = draft[j]
        if generator.random() < p[x]:
            out.append(x)
            continue
        p[x] = 0.0  # the residual max(p - 1[x], 0), renormalised by _draw
        out.append(_draw(p, generator.random()))
        break
    return out
