"""The sampler of the Python twin (twin of runtime/core/_sampler.c): the xoshiro256** random stream
(RNG, make_rng), exp_neg, and sample / sample_probs, bit-identical to the C arithmetic (the recipe is
at "Sampling" below).
"""

from __future__ import annotations

import math
import operator
import secrets
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from runtime.core.reference.common import GOLDEN, M64, as_array, is_int, mix64

__all__ = ["RNG", "exp_neg", "make_rng", "sample", "sample_probs", "unpack_mask"]


# --------------------------------------------------------------------------------------------
# Random numbers (twin of the xoshiro256** generator in _sampler.c)
# --------------------------------------------------------------------------------------------


def _rotl(x: int, k: int) -> int:
    return ((x << k) | (x >> (64 - k))) & M64


class RNG:
    """A request's random stream: xoshiro256** over `state`, a uint64[4] array.

    The C sampler reads and advances `state` in place through the buffer protocol, the Python
    twin does the same arithmetic on Python ints, so a seed gives the same draws in both.
    One non-greedy sampled token consumes exactly one draw.
    """

    __slots__ = ("state",)

    def __init__(self, state: np.ndarray) -> None:
        state = np.asarray(state)
        if state.dtype != np.uint64 or state.shape != (4,) or not state.flags.c_contiguous:
            raise ValueError(f"RNG state: expected a C-contiguous uint64[4] array, got {state.dtype}{list(state.shape)}")
        if not state.any():
            raise ValueError("RNG state: all zero (xoshiro256** would only return zeros)")
        self.state = state

    def next_u64(self) -> int:
        s0, s1, s2, s3 = (int(v) for v in self.state)
        result = (_rotl((s1 * 5) & M64, 7) * 9) & M64
        t = (s1 << 17) & M64
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        s3 = _rotl(s3, 45)
        self.state[:] = (s0, s1, s2, s3)
        return result

    def random(self) -> float:
        """The next double in [0, 1): the top 53 bits of a draw."""
        return (self.next_u64() >> 11) * 2.0**-53

    def __repr__(self) -> str:
        return f"RNG(state=[{', '.join(hex(int(v)) for v in self.state)}])"


def make_rng(seed: int | None) -> RNG:
    """A generator seeded through splitmix64 (a seed wider than 64 bits is folded by XOR of its
    64-bit words); fresh entropy for None."""
    if seed is None:
        seed = secrets.randbits(64)
    seed = operator.index(seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    s = 0
    while True:
        s ^= seed & M64
        seed >>= 64
        if not seed:
            break
    words = []
    for _ in range(4):
        s = (s + GOLDEN) & M64
        words.append(mix64(s))
    return RNG(np.array(words, dtype=np.uint64))


# --------------------------------------------------------------------------------------------
# Sampling (twin of _sampler.c)
# --------------------------------------------------------------------------------------------
#
# Every step is an IEEE-754 basic operation (+ - * /, comparisons) in a fixed order, so numpy here
# and C there give the same bits: exp is our own (below); sums are "lane sums" (8 interleaved
# sequential sums, then the 8 in order: vectorizable in C, np.cumsum here, never the pairwise
# np.sum); the only libm call is one log per logprobs row (math.log here, log() there: the same
# libm). Per row:
#
#   x = float64(logits)                                    NaN -> ValueError
#   penalties (only tokens in the history change):
#     repetition r, tokens in prompt + output:  x = x / r if x > 0 else x * r
#     frequency f, presence p, tokens in output (count c):  x = x - f * c;  x = x - p
#   token mask (a packed int32 row, bit i % 32 of word i / 32 = token i allowed; all ones = none):
#     x = -inf on disallowed tokens; no allowed finite x -> ValueError
#   greedy (temperature 0): argmax x, first maximum on ties; the RNG is not touched
#   s = x / temperature;  m = max s (not finite -> ValueError)
#   top-k (0 < k < V):  keep s >= k-th largest s (ties with it are kept)
#   e = exp_neg(s - m) on kept tokens, 0 elsewhere
#   top-p (< 1):  rank kept tokens by (e desc, id asc); keep a token while the sequential sum of
#                 e before it (in rank order) is < top_p * lane_sum(e)
#   min-p (> 0):  keep e >= min_p * max e
#   draw:  u = rng.random();  token = first id whose sequential cumulative e (id order) exceeds
#          u * lane_sum(e) (the last kept id if rounding leaves none)
#   logprobs (raw logits, before penalties and temperature):
#     logprob = (x - max x) - log(lane_sum(exp_neg(x - max x))); top-N by (x desc, id asc)

_EXP_C = [float.fromhex(h) for h in (
    "0x1.0p+0", "0x1.0p+0", "0x1.0p-1", "0x1.5555555555555p-3", "0x1.5555555555555p-5",
    "0x1.1111111111111p-7", "0x1.6c16c16c16c17p-10", "0x1.a01a01a01a01ap-13", "0x1.a01a01a01a01ap-16",
    "0x1.71de3a556c734p-19", "0x1.27e4fb7789f5cp-22", "0x1.ae64567f544e4p-26", "0x1.1eed8eff8d898p-29",
    "0x1.6124613a86d09p-33",
)]  # 1/n!, n = 0..13
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
_EXP_MIN = -708.0  # below: 0 (exp(-708) ~ 3e-308, the normal range's edge)


_MAGIC = float.fromhex("0x1.8p52")  # 1.5 * 2**52: adding it rounds |y| < 2**51 to an integer (ties to even)
_MAGIC_BITS = int(np.array(_MAGIC).view(np.int64))


def exp_neg(x: np.ndarray) -> np.ndarray:
    """exp(x) for x <= 0 (float64), bit-identical to exp_neg() in _sampler.c.

    Cody-Waite reduction x = k ln2 + r (|r| <= ln2/2; k rounded with the 1.5 * 2**52 trick), a
    degree-13 Taylor polynomial of e^r by Estrin's scheme (truncation < 1e-17), times 2^k from k's
    bits; x < -708 (and -inf) gives 0. Within 2 ulp of the true exp; what matters here is that it
    is the same in C and numpy (basic IEEE operations only, so it vectorizes in C as well).
    """
    x = np.asarray(x, dtype=np.float64)
    ok = x >= _EXP_MIN
    xs = np.where(ok, x, 0.0)
    t = xs * _INV_LN2 + _MAGIC
    k = t - _MAGIC
    r = (xs - k * _LN2_HI) - k * _LN2_LO
    c = _EXP_C  # Estrin's scheme, the same tree as C
    r2 = r * r
    r4 = r2 * r2
    r8 = r4 * r4
    q0 = (c[0] + c[1] * r) + (c[2] + c[3] * r) * r2
    q1 = (c[4] + c[5] * r) + (c[6] + c[7] * r) * r2
    q2 = (c[8] + c[9] * r) + (c[10] + c[11] * r) * r2
    q3 = c[12] + c[13] * r
    p = (q0 + q1 * r4) + (q2 + q3 * r4) * r8
    scale = ((t.view(np.int64) - _MAGIC_BITS + 1023) << 52).view(np.float64)
    return np.where(ok, p * scale, 0.0)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class _RowParams(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int  # -1: none

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _row_params(p: object, i: int) -> _RowParams:
    """Read and check one row's SamplingParams (the same checks, in the same order, as C)."""
    vals: dict[str, float] = {}
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logprobs"):
        if not hasattr(p, name):
            raise TypeError(f"params[{i}]: expected SamplingParams, {type(p).__name__} has no '{name}'")
        v = getattr(p, name)
        if name in ("top_k", "logprobs"):
            if name == "logprobs" and v is None:
                vals[name] = -1
                continue
            if not is_int(v) or isinstance(v, bool):
                raise TypeError(f"params[{i}].{name}: expected an integer, got {type(v).__name__}")
            v = int(v)
            if v < 0 or v > 2**31 - 1:
                raise ValueError(f"params[{i}].{name} must be in [0, 2**31), got {v}")
        else:
            if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
                raise TypeError(f"params[{i}].{name}: expected a number, got {type(v).__name__}")
            v = float(v)
            if not math.isfinite(v):
                raise ValueError(f"params[{i}].{name} must be finite, got {v}")
        vals[name] = v
    rp = _RowParams(**vals)  # type: ignore[arg-type]
    if rp.temperature < 0:
        raise ValueError(f"params[{i}].temperature must be >= 0, got {rp.temperature}")
    if not 0.0 < rp.top_p <= 1.0:
        raise ValueError(f"params[{i}].top_p must be in (0, 1], got {rp.top_p}")
    if not 0.0 <= rp.min_p <= 1.0:
        raise ValueError(f"params[{i}].min_p must be in [0, 1], got {rp.min_p}")
    if rp.repetition_penalty <= 0.0:
        raise ValueError(f"params[{i}].repetition_penalty must be > 0, got {rp.repetition_penalty}")
    return rp


def _history(seqs: Sequence[object] | None, i: int, name: str, vocab: int) -> np.ndarray | None:
    if seqs is None:
        return None
    h = seqs[i]
    if h is None:
        return None
    try:
        arr = np.asarray(h)
    except Exception:  # noqa: BLE001 - ragged or odd objects
        raise TypeError(f"{name}[{i}]: expected a sequence of token ids") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TypeError(f"{name}[{i}]: expected a 1-D sequence of integer token ids")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab))
    if bad.size:
        raise ValueError(f"{name}[{i}]: token id {int(arr[bad[0]])} outside the vocabulary [0, {vocab})")
    return arr.astype(np.int64)


def _rng_state(rng: object, i: int) -> np.ndarray:
    state = getattr(rng, "state", None)
    if (not isinstance(state, np.ndarray) or state.dtype != np.uint64 or state.shape != (4,)
            or not state.flags.c_contiguous or not state.flags.writeable):
        raise TypeError(f"generators[{i}]: expected an RNG from make_generator (a writable uint64[4] state)")
    if not state.any():
        raise ValueError(f"generators[{i}]: RNG state is all zero")
    return state


def _penalized(row: np.ndarray, rp: _RowParams, prompt: np.ndarray | None, output: np.ndarray | None) -> np.ndarray:
    x = row.astype(np.float64)
    if not rp.penalized:
        return x
    if rp.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([prompt, output]))  # type: ignore[list-item]
        v = x[seen]
        x[seen] = np.where(v > 0, v / rp.repetition_penalty, v * rp.repetition_penalty)
    if output is not None and output.size and (rp.frequency_penalty != 0.0 or rp.presence_penalty != 0.0):
        uo, cnt = np.unique(output, return_counts=True)
        if rp.frequency_penalty != 0.0:
            x[uo] = x[uo] - rp.frequency_penalty * cnt.astype(np.float64)
        if rp.presence_penalty != 0.0:
            x[uo] = x[uo] - rp.presence_penalty
    return x


def _check_masks(masks: object, name: str, rows: int | None, vocab: int) -> np.ndarray | None:
    """A token-mask buffer: int32 words, C-contiguous, [rows, ceil(vocab / 32)] (rows None: one row
    [ceil(vocab / 32)]); the same checks and messages as C."""
    if masks is None:
        return None
    m = as_array(masks, name)
    if m.dtype.kind != "i" or m.dtype.itemsize != 4 or not m.dtype.isnative:
        raise TypeError(f"{name}: expected int32 words, got format '{m.dtype.char}' with itemsize {m.dtype.itemsize}")
    words = (vocab + 31) // 32
    if m.shape != ((words,) if rows is None else (rows, words)):
        shown = "[" if rows is None else "[rows of logits, "
        raise ValueError(f"{name}: expected shape {shown}{words} words (ceil(vocab / 32) for a vocabulary of {vocab})")
    if not m.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return m


def unpack_mask(words: np.ndarray, vocab: int) -> np.ndarray | None:
    """bool [vocab] from one packed mask row (bit i % 32 of word i / 32 = token i allowed); None when the
    row is all ones (it constrains nothing)."""
    w = words.view(np.uint32)
    if (w == 0xFFFFFFFF).all():
        return None
    bits = (w[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:vocab].astype(bool)


def _masked(x: np.ndarray, allowed: np.ndarray | None, i: int) -> np.ndarray:
    """x with -inf on the tokens the mask disallows; ValueError when no allowed token is finite."""
    if allowed is None:
        return x
    x = np.where(allowed, x, -np.inf)
    if x.max() == -np.inf:
        raise ValueError(f"logits row {i}: its token mask allows no token with a finite logit")
    return x


def _lane_sum(e: np.ndarray) -> float:
    """Sum in 8 interleaved lanes (lane j: e[j], e[j+8], ... sequentially), then the lanes in order:
    lane_sum() in _sampler.c, whose 8 accumulators vectorize where one sequential sum cannot."""
    lanes = np.cumsum(np.concatenate([e, np.zeros(-e.shape[0] % 8)]).reshape(-1, 8), axis=0)[-1]
    return float(np.cumsum(lanes)[-1])


def _kept_weights(x: np.ndarray, rp: _RowParams, i: int, allowed: np.ndarray | None = None) -> np.ndarray:
    """Unnormalised weights e after temperature, the token mask, top-k, top-p, min-p (0 = dropped)."""
    v = x.shape[0]
    s = x / rp.temperature
    if allowed is not None:  # after the division, as C does (-inf / t = -inf: the same weights either way)
        s = np.where(allowed, s, -np.inf)
        if s.max() == -np.inf:
            raise ValueError(f"logits row {i}: its token mask allows no token with a finite logit")
    m = s.max()
    if not math.isfinite(m):
        raise ValueError(f"logits row {i} has no finite maximum (all -inf, or +inf)")
    if 0 < rp.top_k < v:
        kth = np.partition(s, v - rp.top_k)[v - rp.top_k]
        keep = s >= kth
        e = np.where(keep, exp_neg(np.where(keep, s - m, 0.0)), 0.0)
    else:
        e = exp_neg(s - m)
    if rp.top_p < 1.0:
        threshold = rp.top_p * _lane_sum(e)
        order = np.lexsort((np.arange(v), -e))
        ranked = e[order]
        before = np.concatenate(([0.0], np.cumsum(ranked)[:-1]))
        e[order[before >= threshold]] = 0.0
    if rp.min_p > 0.0:
        e[e < rp.min_p * e.max()] = 0.0
    return e


def _draw(e: np.ndarray, u: float) -> int:
    cdf = np.cumsum(e)
    idx = int(np.searchsorted(cdf, u * _lane_sum(e), side="right"))
    return min(idx, int(np.flatnonzero(e)[-1]))


def _logprobs(row: np.ndarray, token: int, n: int, i: int) -> tuple[float, np.ndarray, np.ndarray]:
    x = row.astype(np.float64)
    m = x.max()
    if not math.isfinite(m):
        raise ValueError(f"logits row {i} has no finite maximum (all -inf, or +inf)")
    d = x - m
    lse = math.log(_lane_sum(exp_neg(d)))
    lp = d - lse
    top = np.lexsort((np.arange(x.shape[0]), -x))[:n]
    return float(lp[token]), top.astype(np.int64), lp[top]


def _check_logits(logits: object) -> np.ndarray:
    a = as_array(logits, "logits")
    if a.ndim != 2:
        raise ValueError(f"logits: expected 2 dimensions [B, vocab], got {a.ndim}")
    if a.dtype not in (np.float32, np.float64) or not a.dtype.isnative:
        raise TypeError(f"logits: expected float32 or float64, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError("logits: must be C-contiguous")
    if a.shape[1] < 1:
        raise ValueError("logits: vocabulary of size 0")
    return a


def _check_out(arr: object, name: str, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    a = as_array(arr, name)
    if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError(f"{name}: expected a writable C-contiguous {np.dtype(dtype).name}{list(shape)}, "
                         f"got {'read-only ' if not a.flags.writeable else ''}{a.dtype}{list(a.shape)}")
    return a


def _check_len(seq: object, name: str, b: int, optional: bool) -> Sequence[object] | None:
    if seq is None and optional:
        return None
    try:
        n = len(seq)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of {b} items, got {type(seq).__name__}") from None
    if n != b:
        raise ValueError(f"{name}: {n} items for {b} logits rows")
    return seq  # type: ignore[return-value]


def sample(logits: np.ndarray, params: Sequence[object], rngs: Sequence[object],
           prompt_ids: Sequence[object] | None, output_ids: Sequence[object] | None,
           tokens_out: np.ndarray,
           logprobs_out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
           masks: np.ndarray | None = None) -> None:
    """Sample one token per row of logits [B, V] into tokens_out (int64 [B]); twin of _core.sample.

    params[i]: SamplingParams-like; rngs[i]: an RNG (None allowed for greedy rows);
    prompt_ids / output_ids: None, or per row None or a sequence of token ids (needed by rows
    with penalties); logprobs_out: None or (chosen float64[B], top_ids int64[B, N],
    top_logprobs float64[B, N]) filled for rows whose params.logprobs is not None (needs <= N);
    without it params.logprobs is ignored. masks: None or int32 [B, ceil(V / 32)], a packed token mask
    per row (bit i % 32 of word i / 32 = token i allowed; a row of all ones constrains nothing),
    applied after the penalties and before greedy / temperature and the rest; logprobs stay raw.
    Every input is checked before any row is computed, and RNG states and outputs are written
    only when every row succeeded: on error nothing changed.
    """
    a = _check_logits(logits)
    b, vocab = a.shape
    params = _check_len(params, "params", b, False)  # type: ignore[assignment]
    rngs = _check_len(rngs, "generators", b, False)  # type: ignore[assignment]
    prompt_ids = _check_len(prompt_ids, "prompt_ids", b, True)
    output_ids = _check_len(output_ids, "output_ids", b, True)
    tok = _check_out(tokens_out, "tokens_out", np.int64, (b,))
    lp_outs = None
    width = 0
    if logprobs_out is not None:
        if not isinstance(logprobs_out, tuple | list) or len(logprobs_out) != 3:
            raise TypeError("logprobs_out: expected None or (chosen, top_ids, top_logprobs)")
        chosen = _check_out(logprobs_out[0], "logprobs_out[0]", np.float64, (b,))
        top_ids = as_array(logprobs_out[1], "logprobs_out[1]")
        if top_ids.ndim != 2:
            raise ValueError("logprobs_out[1]: expected 2 dimensions [B, N]")
        width = top_ids.shape[1]
        top_ids = _check_out(top_ids, "logprobs_out[1]", np.int64, (b, width))
        top_lp = _check_out(logprobs_out[2], "logprobs_out[2]", np.float64, (b, width))
        lp_outs = (chosen, top_ids, top_lp)
    mask_rows = _check_masks(masks, "masks", b, vocab)
    rows = []
    for i in range(b):
        rp = _row_params(params[i], i)  # type: ignore[index]
        state = None
        if rp.temperature != 0.0:
            state = _rng_state(rngs[i], i)  # type: ignore[index]
        prompt = _history(prompt_ids, i, "prompt_ids", vocab)
        output = _history(output_ids, i, "output_ids", vocab)
        if rp.penalized and (prompt is None or output is None):
            raise ValueError(f"params[{i}]: penalties need the row's prompt_ids and output_ids")
        if rp.logprobs > width and lp_outs is not None:
            raise ValueError(f"params[{i}].logprobs={rp.logprobs} exceeds logprobs_out's width {width}")
        if rp.logprobs > vocab and lp_outs is not None:
            raise ValueError(f"params[{i}].logprobs={rp.logprobs} exceeds the vocabulary size {vocab}")
        rows.append((rp, state, prompt, output))
    tokens = np.empty(b, np.int64)
    states: list[tuple[int, np.ndarray, RNG] | None] = []
    lps = []
    for i, (rp, state, prompt, output) in enumerate(rows):
        row = a[i]
        if np.isnan(row).any():
            raise ValueError(f"logits row {i} contains NaN")
        x = _penalized(row, rp, prompt, output)
        allowed = None if mask_rows is None else unpack_mask(mask_rows[i], vocab)
        if rp.temperature == 0.0:
            tokens[i] = int(np.argmax(_masked(x, allowed, i)))
            states.append(None)
        else:
            e = _kept_weights(x, rp, i, allowed)
            rng = RNG(state.copy())  # type: ignore[union-attr]
            tokens[i] = _draw(e, rng.random())
            states.append((i, state, rng))  # type: ignore[arg-type]
        want = rp.logprobs >= 0 and lp_outs is not None
        lps.append(_logprobs(row, int(tokens[i]), rp.logprobs, i) if want else None)
    for st in states:
        if st is not None:
            st[1][:] = st[2].state
    tok[:] = tokens
    if lp_outs is not None:
        for i, lp in enumerate(lps):
            if lp is not None:
                n = rows[i][0].logprobs
                lp_outs[0][i] = lp[0]
                lp_outs[1][i, :n] = lp[1]
                lp_outs[2][i, :n] = lp[2]


def sample_probs(row: np.ndarray, params: object, prompt_ids: Sequence[int] | None,
                 output_ids: Sequence[int] | None, out: np.ndarray, mask: np.ndarray | None = None) -> None:
    """The distribution one row is drawn from, into out (float64 [V]); twin of _core.sample_probs.

    Greedy rows get a one-hot distribution on the argmax. mask: None or one packed row (int32
    [ceil(V / 32)]) as in `sample`.
    """
    a = as_array(row, "logits")
    if a.ndim != 1:
        raise ValueError(f"logits: expected 1 dimension [vocab], got {a.ndim}")
    a = _check_logits(a.reshape(1, -1))
    vocab = a.shape[1]
    dst = _check_out(out, "out", np.float64, (vocab,))
    rp = _row_params(params, 0)
    prompt = _history([prompt_ids], 0, "prompt_ids", vocab)
    output = _history([output_ids], 0, "output_ids", vocab)
    if rp.penalized and (prompt is None or output is None):
        raise ValueError("params[0]: penalties need the row's prompt_ids and output_ids")
    words = _check_masks(mask, "mask", None, vocab)
    allowed = None if words is None else unpack_mask(words, vocab)
    if np.isnan(a[0]).any():
        raise ValueError("logits row 0 contains NaN")
    x = _penalized(a[0], rp, prompt, output)
    if rp.temperature == 0.0:
        best = int(np.argmax(_masked(x, allowed, 0)))
        dst[:] = 0.0
        dst[best] = 1.0
        return
    e = _kept_weights(x, rp, 0, allowed)
    dst[:] = e / _lane_sum(e)
