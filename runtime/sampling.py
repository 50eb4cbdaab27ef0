"""Sampling: per-request parameters and the sampler that turns a step's logits into next tokens.

The arithmetic lives in the engine core: `runtime.core._core.sample` (C, default) and its twin
`runtime.core.reference.sample` (`OPTIMIZE_CORE=python`); both give the same tokens for the same
seed (see the recipe at "Sampling" in runtime/core/reference/sampler.py). Per row:

- penalties on the logits of tokens already seen (repetition: prompt + output, HF/vLLM style;
  presence and frequency: output only, OpenAI style), when the caller passes the histories;
- a token mask (structured output, runtime/structured.py): a packed int32 bitmask row, bit i = token i
  allowed; disallowed tokens get -inf after the penalties and before everything below;
- greedy (temperature 0): argmax, first maximum on ties; the row's generator is not touched;
- otherwise temperature, then top-k, top-p and min-p on float64 weights, at least one token kept,
  and one draw from the request's own generator (`make_generator(seed)`: xoshiro256**, so a
  request with a seed is reproducible whatever else shares its batch);
- on request (`SamplingParams.logprobs`, `sample(..., logprobs=True)`), the log-probability of
  the chosen token and of the top-N tokens under the model's raw distribution (log-softmax of the
  logits, before penalties and temperature).

Stop strings are applied by the engine after detokenizing; `stop_token_ids` and EOS are the
engine's stop conditions too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import numpy as np

import runtime.core
from runtime.core import _core, reference
from runtime.core.reference import RNG, make_rng
from runtime.structured import StructuredOutput

__all__ = ["RNG", "SamplingParams", "Sampler", "TokenLogprobs", "make_generator"]

MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off
    min_p: float = 0.0  # keep tokens with probability >= min_p * the top probability; 0 => off
    repetition_penalty: float = 1.0  # > 1 discourages tokens of prompt + output; 1 => off
    presence_penalty: float = 0.0  # subtracted once from tokens already generated; 0 => off
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens; 0 => off
    seed: int | None = None
    logprobs: int | None = None  # None: none; N: the chosen token's logprob and the top N
    stop: list[str] = field(default_factory=list)  # stop strings (the engine applies them after detokenizing)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # a grammar the output must match (runtime/structured.py); the request ends when the grammar is complete
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when sampling needs the request's prompt and output token ids."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError with a message naming the field when a value is out of range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if (not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured must be None or a StructuredOutput, got {self.structured!r}")
            self.structured.validate()


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw logits (log-softmax, before penalties/temperature)
    top_ids: list[int]  # the N most likely tokens, most likely first (ties: lower id first)
    top_logprobs: list[float]  # their log-probabilities


def make_generator(seed: int | None) -> RNG:
    """The request's own generator: reproducible for a seed, fresh entropy for None.

    An `RNG` (xoshiro256** over a uint64[4] state) that the C sampler and its Python twin both
    advance, so a seed gives the same tokens with either core. `.random()` draws a float in [0, 1).
    """
    return make_rng(seed)


def _core_functions(impl: str) -> tuple[object, object]:
    if impl == "python":
        return reference.sample, reference.sample_probs
    if impl == "c":
        return _core.sample, _core.sample_probs
    raise ValueError(f"Sampler impl must be 'c' or 'python', got {impl!r}")


def _as_logits(logits: object, ndim: int) -> np.ndarray:
    arr = np.asarray(logits)
    if arr.ndim != ndim:
        want = "[B, vocab]" if ndim == 2 else "[vocab]"
        raise ValueError(f"logits: expected {want}, got shape {list(arr.shape)}")
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float32 if arr.dtype == np.float16 else np.float64)
    return np.ascontiguousarray(arr)


class Sampler:
    """Turn logits [B, vocab] into next tokens int64 [B], one SamplingParams and generator per row.

    `impl` is "c" or "python"; None follows `runtime.core.CORE_IMPL` (OPTIMIZE_CORE).
    """

    def __init__(self, impl: str | None = None) -> None:
        if impl is None:
            impl = runtime.core.CORE_IMPL
        self._sample, self._probs = _core_functions(impl)
        self.impl = impl

    def probs(self, logits: np.ndarray, params: SamplingParams, *, prompt_ids: Sequence[int] | None = None,
              output_ids: Sequence[int] | None = None, mask: np.ndarray | None = None) -> np.ndarray:
        """The distribution one row is drawn from (float64 [vocab]), after penalties, the token mask
        (int32 [ceil(vocab / 32)], or None), temperature, top-k, top-p and min-p. Greedy rows get a
        one-hot distribution on the argmax."""
        row = _as_logits(logits, 1)
        if row.size == 0:
            raise ValueError("logits row: expected a non-empty 1-D array, got shape [0]")
        out = np.empty(row.shape[0], np.float64)
        self._probs(row, params, prompt_ids, output_ids, out, mask)  # type: ignore[operator]
        return out

    @overload
    def sample(self, logits: np.ndarray, params: Sequence[SamplingParams], generators: Sequence[RNG | None], *,
               prompt_ids: Sequence[Sequence[int] | None] | None = ...,
               output_ids: Sequence[Sequence[int] | None] | None = ...,
               masks: np.ndarray | None = ...,
               logprobs: Literal[False] = ...) -> np.ndarray: ...

    @overload
    def sample(self, logits: np.ndarray, params: Sequence[SamplingParams], generators: Sequence[RNG | None], *,
               prompt_ids: Sequence[Sequence[int] | None] | None = ...,
               output_ids: Sequence[Sequence[int] | None] | None = ...,
               masks: np.ndarray | None = ...,
               logprobs: Literal[True]) -> tuple[np.ndarray, list[TokenLogprobs | None]]: ...

    def sample(self, logits, params, generators, *, prompt_ids=None, output_ids=None, masks=None, logprobs=False):
        """Next token of each row (int64 [B]). Greedy rows do not touch their generator.

        prompt_ids / output_ids: per row, the request's prompt and generated token ids (None for a
        row without penalties); rows with penalties need both. With `logprobs=True` the result is
        (tokens, [TokenLogprobs or None per row]), filled for rows whose params.logprobs is set.
        masks: None, or int32 [B, ceil(vocab / 32)]: per row a packed token mask (bit i % 32 of word
        i // 32 = token i allowed; a row of all ones (-1 words) constrains nothing).
        On error (bad input, NaN logits, a mask that leaves no finite logit) no generator has advanced.
        """
        arr = _as_logits(logits, 2)
        b = arr.shape[0]
        if len(params) != b or len(generators) != b:
            raise ValueError(f"logits has {b} rows but {len(params)} SamplingParams and "
                             f"{len(generators)} generators were given")
        out = np.empty(b, dtype=np.int64)
        lp = None
        if logprobs:
            width = max((p.logprobs for p in params if p.logprobs is not None), default=0)
            lp = (np.zeros(b), np.zeros((b, width), np.int64), np.zeros((b, width)))
        self._sample(arr, params, generators, prompt_ids, output_ids, out, lp, masks)  # type: ignore[operator]
        if not logprobs:
            return out
        result: list[TokenLogprobs | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                result.append(None)
            else:
                n = p.logprobs
                result.append(TokenLogprobs(int(out[i]), float(lp[0][i]), lp[1][i, :n].tolist(),  # type: ignore[index]
                                            lp[2][i, :n].tolist()))  # type: ignore[index]
        return out, result
