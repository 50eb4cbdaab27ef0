"""Perplexity of an artifact on a text file, computed through the runtime's backend.

Method (the demo model's README): tokens of the whole text without special tokens, cut into
consecutive non-overlapping chunks of `chunk_len` tokens (the last partial chunk dropped); each
chunk scored on its own (no BOS, no carried context); perplexity = exp(mean next-token NLL).
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


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens: int  # tokens of the text read
    chunks: int
    predictions: int

    def as_dict(self) -> dict[str, float | int]:
        return {"perplexity": self.perplexity, "mean_nll": self.mean_nll, "tokens": self.tokens,
                "chunks": self.chunks, "predictions": self.predictions}


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
        if progress is not None:
            progress(min(start + b, len(chunks)), len(chunks))
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, min(len(ids), max_tokens or len(ids)), len(chunks), count)


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
