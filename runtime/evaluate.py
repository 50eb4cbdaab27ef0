"""Perplexity of an artifact on a text file, computed through the runtime's backend, and the paired
difference of two models' perplexities with its standard error.

Method (the demo model's README): tokens of the whole text without special tokens, cut into
consecutive non-overlapping chunks of `chunk_len` tokens (the last partial chunk dropped); each
chunk scored on its own (no BOS, no carried context); perplexity = exp(mean next-token NLL).

Error bars (`paired_delta`): two models scored on the same chunks give per chunk the difference
d_i = (mean NLL of the model) - (mean NLL of the reference) over the chunk's chunk_len - 1
predictions. Every chunk has the same number of predictions, so mean(d) is exactly the difference
of the two mean NLLs, and the relative perplexity change is 100 (exp(mean d) - 1) %, the same number
as 100 (ppl / ppl_ref - 1). The chunks are the independent units (tokens inside a chunk are not):
se = sd(d) / sqrt(n) (sample sd, n - 1), and the interval is mean(d) +- z se with z = 1.96 (normal,
95 % two-sided), mapped through 100 (exp(.) - 1) %; the se in % is 100 exp(mean d) se (delta
method). With fewer than about 30 chunks the normal quantile understates the interval (Student's t
would be wider); the quality gate evaluates at least 32 chunks unless a recipe sets fewer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


Z95 = 1.959963984540054  # the two-sided 95 % quantile of the normal distribution


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens: int  # tokens of the text read
    chunks: int
    predictions: int
    chunk_nll: tuple[float, ...] = ()  # mean next-token NLL of each chunk, in order

    def as_dict(self) -> dict[str, float | int]:
        return {"perplexity": self.perplexity, "mean_nll": self.mean_nll, "tokens": self.tokens,
                "chunks": self.chunks, "predictions": self.predictions}


@dataclass(frozen=True)
class PairedDelta:
    """The change of a model's perplexity against a reference's on the same chunks (module docstring)."""

    chunks: int
    mean_diff: float  # mean over chunks of the per-chunk mean-NLL difference (nats)
    se: float  # its standard error, sd / sqrt(chunks) (nats); inf with one chunk
    z: float = Z95

    @property
    def pct(self) -> float:
        """Perplexity change in %: 100 (exp(mean_diff) - 1) = 100 (ppl / ppl_ref - 1)."""
        return 100.0 * math.expm1(self.mean_diff)

    @property
    def se_pct(self) -> float:
        """Standard error of `pct` (delta method): 100 exp(mean_diff) se."""
        return 100.0 * math.exp(self.mean_diff) * self.se

    @property
    def ci_pct(self) -> tuple[float, float]:
        """The z interval of mean_diff, mapped to % (exact under the monotone map, not +- z se_pct)."""
        if not math.isfinite(self.se):
            return (-math.inf, math.inf)
        return (100.0 * math.expm1(self.mean_diff - self.z * self.se),
                100.0 * math.expm1(self.mean_diff + self.z * self.se))

    def as_dict(self) -> dict[str, float | int]:
        lo, hi = self.ci_pct
        return {"chunks": self.chunks, "mean_nll_diff": self.mean_diff, "se_nll_diff": self.se,
                "increase_pct": self.pct, "increase_se_pct": self.se_pct, "ci_low_pct": lo, "ci_high_pct": hi,
                "z": self.z}


def paired_delta(chunk_nll: list[float] | tuple[float, ...], reference_chunk_nll: list[float] | tuple[float, ...],
                 z: float = Z95) -> PairedDelta:
    """Paired per-chunk differences of two models' mean NLLs on the same chunks -> mean, se, interval."""
    if len(chunk_nll) != len(reference_chunk_nll):
        raise ValueError(f"paired chunks differ in number: {len(chunk_nll)} vs {len(reference_chunk_nll)}")
    if not chunk_nll:
        raise ValueError("no chunks to compare")
    d = np.asarray(chunk_nll, dtype=np.float64) - np.asarray(reference_chunk_nll, dtype=np.float64)
    n = d.size
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    return PairedDelta(n, float(d.mean()), se, z)


def chunk_tokens(ids: list[int], chunk_len: int, max_tokens: int | None = None) -> list[list[int]]:
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = len(ids) // chunk_len
    return [ids[i * chunk_len:(i + 1) * chunk_len] for i in range(n)]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def perplexity(
    backend: object,
    ids: list[int],
    chunk_len: int = 256,
    max_tokens: int | None = None,
    seqs_per_step: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Score `ids` chunk by chunk with `backend.forward` (blocks 0.. of its pool are reused)."""
    chunks = chunk_tokens(ids, chunk_len, max_tokens)
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {chunk_len}")
    bs: int = backend.block_size  # type: ignore[attr-defined]
    nb: int = backend.num_blocks  # type: ignore[attr-defined]
    per_seq = -(-chunk_len // bs)
    seqs_per_step = max(1, min(seqs_per_step, nb // per_seq))
    if nb < per_seq:
        raise ValueError(f"the KV pool ({nb} blocks of {bs}) cannot hold one chunk of {chunk_len} tokens")
    total_nll = 0.0
    count = 0
    per_chunk: list[float] = []
    for start in range(0, len(chunks), seqs_per_step):
        group = chunks[start:start + seqs_per_step]
        b = len(group)
        pos = np.tile(np.arange(chunk_len, dtype=np.int64), b)
        table = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
        slots = (table.astype(np.int64)[:, pos[:chunk_len] // bs] * bs + pos[:chunk_len] % bs).reshape(-1)
        fb = ForwardBatch(
            input_ids=np.asarray(group, dtype=np.int64).reshape(-1),
            positions=pos,
            cu_seqlens=np.arange(0, (b + 1) * chunk_len, chunk_len, dtype=np.int32),
            past_lens=np.zeros(b, dtype=np.int32),
            block_table=table,
            slot_mapping=slots,
            logits_index=np.arange(b * chunk_len, dtype=np.int64),
        )
        logp = _log_softmax(backend.forward(fb)).reshape(b, chunk_len, -1)  # type: ignore[attr-defined]
        targets = np.asarray(group, dtype=np.int64)[:, 1:]
        picked = np.take_along_axis(logp[:, :-1, :], targets[..., None], axis=-1)[..., 0]
        total_nll -= float(picked.sum())
        count += picked.size
        per_chunk += (-picked.mean(axis=1)).tolist()
        if progress is not None:
            progress(min(start + b, len(chunks)), len(chunks))
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, min(len(ids), max_tokens or len(ids)), len(chunks), count,
                            tuple(per_chunk))


def text_perplexity(
    llm_engine: object, path: Path, chunk_len: int = 256, max_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of a text file through an LLMEngine's tokenizer and backend."""
    text = Path(path).read_text(encoding="utf-8")
    ids = llm_engine.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    return perplexity(llm_engine.backend, ids, chunk_len, max_tokens, progress=progress)  # type: ignore[attr-defined]


def prefix_agreement(want: list[list[int]], got: list[list[int]]) -> float:
    """Greedy-token agreement of two runs over the same prompts: the fraction of tokens equal up to each
    sequence's first difference (after it, the contexts differ and the tokens are not comparable)."""
    agree = total = 0
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=False):
            total += 1
            if x != y:
                break
            agree += 1
    return agree / max(1, total)
