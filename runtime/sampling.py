"""Sampling: per-request parameters and the sampler that turns a step's logits into next tokens.

Greedy (temperature 0) is argmax, first maximum on ties (like torch.argmax). Otherwise the logits
are divided by the temperature, top-k and then top-p are applied to the softmax (float64), at least
one token is kept, and a token is drawn with the request's own `np.random.Generator` (so a
request with a seed is reproducible whatever else shares its batch). Stop strings are applied by
the engine after detokenizing; `stop_token_ids` and EOS are the engine's stop conditions too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SamplingParams", "Sampler", "make_generator"]


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (the engine applies them after detokenizing)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError with a message naming the field when a value is out of range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if (not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if (not isinstance(self.top_p, int | float) or isinstance(self.top_p, bool)
                or not (0.0 < self.top_p <= 1.0)):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


def make_generator(seed: int | None) -> np.random.Generator:
    """The request's own generator: reproducible for a seed, fresh entropy for None."""
    return np.random.default_rng(seed)


class Sampler:
    """Turn logits [B, vocab] into next tokens int64 [B], one SamplingParams and generator per row."""

    def probs(self, logits: np.ndarray, params: SamplingParams) -> np.ndarray:
        """The distribution one row is drawn from (float64 [vocab]), after temperature/top-k/top-p.

        Greedy rows get a one-hot distribution on the argmax.
        """
        row = np.asarray(logits, dtype=np.float64)
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"logits row: expected a non-empty 1-D array, got shape {list(row.shape)}")
        if np.isnan(row).any():
            raise ValueError("logits contain NaN")
        vocab = row.shape[0]
        if params.greedy:
            out = np.zeros(vocab)
            out[int(np.argmax(row))] = 1.0
            return out
        x = row / params.temperature
        if 0 < params.top_k < vocab:
            kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
            x = np.where(x < kth, -np.inf, x)  # ties with the k-th value are kept
        top = x.max()
        if not np.isfinite(top):
            raise ValueError("logits row has no finite maximum (all -inf or +inf)")
        p = np.exp(x - top)
        p /= p.sum()
        if params.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            mass_before = np.cumsum(p[order]) - p[order]
            drop = order[mass_before >= params.top_p]  # the minimal nucleus reaching top_p stays
            p[drop] = 0.0
            p /= p.sum()
        return p

    def sample(self, logits: np.ndarray, params: Sequence[SamplingParams],
               generators: Sequence[np.random.Generator | None]) -> np.ndarray:
        """Next token of each row (int64 [B]). Greedy rows do not touch their generator."""
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits: expected [B, vocab], got shape {list(logits.shape)}")
        b = logits.shape[0]
        if len(params) != b or len(generators) != b:
            raise ValueError(f"logits has {b} rows but {len(params)} SamplingParams and "
                             f"{len(generators)} generators were given")
        out = np.empty(b, dtype=np.int64)
        for i, sp in enumerate(params):
            if sp.greedy:
                if np.isnan(logits[i]).any():
                    raise ValueError("logits contain NaN")
                out[i] = int(np.argmax(logits[i]))
                continue
            gen = generators[i]
            if gen is None:
                raise ValueError(f"row {i}: sampling with temperature {sp.temperature} needs a generator")
            p = self.probs(logits[i], sp)
            cdf = np.cumsum(p)
            u = gen.random() * cdf[-1]
            idx = int(np.searchsorted(cdf, u, side="right"))
            out[i] = min(idx, int(np.flatnonzero(p)[-1]))  # guard the u == cdf[-1] rounding edge
        return out
