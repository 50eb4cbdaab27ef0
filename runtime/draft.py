"""The draft-model proposer of speculative decoding: a second, smaller artifact proposes k tokens greedily.

Pairing. A draft artifact must speak the target's tokenizer: `check_pairing` compares the sha256 of the
two artifacts' tokenizer/tokenizer.json (naming the first differing vocabulary entries when they differ),
their model vocabulary sizes and their KV block sizes. A target built from a recipe with a `speculative:`
section records its draft in manifest.json (`speculative.draft`: name, version, path relative to the target
folder, manifest sha256); `paired_draft` finds and checks it.

KV cache. The draft keeps K/V of its own for each sequence, in a pool of its own backend session, addressed
by the *target's* block table: block b of the draft pool holds the draft's K/V of the positions that block b
of the target pool holds. So one block of the scheduler's accounting is both models' K/V for `block_size`
positions: admission, preemption, prefix-cache eviction and the roll-back of rejected proposals (whole blocks
past the accepted end freed by `Scheduler.update`) cover the draft's cache too, and the draft needs no
allocator. Only the tail a proposal runs through (the last known token and k - 1 proposals, at positions the
target has not computed yet, whose blocks the scheduler allocates later in the step) may land past the
sequence's blocks: those positions go to scratch blocks after the shared range of the draft pool (a fixed
few per sequence), and are recomputed from the real blocks next time.

Catch-up. The draft sees a sequence lazily: before proposing, it runs the tokens it has not seen (the whole
prompt the first time, after a prefix-cache hit or a preemption; otherwise the tokens verified since its last
proposal that its cache does not hold) as one chunk together with the first proposal position. What its
cache holds is tracked per sequence as the tokens written at real positions and the block ids they went to:
a later mismatch (a rejected proposal, a block that changed after a preemption) limits what is reused. A
stale entry can only make proposals worse, never output different: verification is exact.

Each step then runs k draft forwards for all proposing sequences together (the first with the catch-up
chunks, the others one token per sequence) and takes the argmax of each row: a point-mass draft, which
`verify_greedy` / `verify_sampled` verify exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.artifact import Artifact, ArtifactError, sha256_file
from runtime.backends import load_backend
from runtime.forward_batch import ForwardBatch
from runtime.tokenizer import load_tokenizer

__all__ = ["DraftModel", "check_pairing", "paired_draft"]

log = logging.getLogger(__name__)

MAX_DRAFT_TOKENS = 32  # SpeculativeConfig.num_tokens' upper bound: sizes the scratch blocks


def _vocab_difference(target: Path, draft: Path) -> str:
    """A short description of how two tokenizer.json vocabularies differ ('' when they are equal)."""
    a = load_tokenizer(target).get_vocab(with_added_tokens=True)
    b = load_tokenizer(draft).get_vocab(with_added_tokens=True)
    if a == b:
        return ""
    only_a = sorted(set(a) - set(b))[:3]
    only_b = sorted(set(b) - set(a))[:3]
    moved = sorted(t for t in set(a) & set(b) if a[t] != b[t])[:3]
    parts = [f"{len(a)} vs {len(b)} entries"]
    if only_a:
        parts.append(f"only the target's: {only_a}")
    if only_b:
        parts.append(f"only the draft's: {only_b}")
    if moved:
        parts.append(f"different ids: {[(t, a[t], b[t]) for t in moved]}")
    return "; ".join(parts)


def check_pairing(target: Artifact, draft: Artifact) -> None:
    """ArtifactError naming what differs unless `draft` can propose for `target`: the same tokenizer.json
    (sha256), the same model vocabulary size and the same KV block size."""
    t_tok, d_tok = target.tokenizer_dir / "tokenizer.json", draft.tokenizer_dir / "tokenizer.json"
    for path in (t_tok, d_tok):
        if not path.is_file():
            raise ArtifactError(f"{path}: missing (a draft model must share the target's tokenizer)")
    t_sha, d_sha = sha256_file(t_tok), sha256_file(d_tok)
    if t_sha != d_sha:
        diff = _vocab_difference(target.tokenizer_dir, draft.tokenizer_dir)
        raise ArtifactError(
            f"draft {draft.root} does not share the tokenizer of target {target.root}: tokenizer.json sha256 "
            f"{d_sha[:12]} vs the target's {t_sha[:12]}; "
            + (f"vocabularies differ ({diff})" if diff else "same vocabulary, other settings differ"))
    t_cfg, d_cfg = target.runtime_config, draft.runtime_config
    for section, key in (("model", "vocab_size"), ("kv_cache", "block_size")):
        tv, dv = t_cfg.get(section, {}).get(key), d_cfg.get(section, {}).get(key)
        if tv != dv:
            raise ArtifactError(f"draft {draft.root}: runtime.json {section}.{key} is {dv!r}, the target's "
                                f"{tv!r}; they must be equal")


def paired_draft(target: Artifact) -> Path | None:
    """The draft artifact folder the target's manifest records (`speculative.draft.path`, relative to the
    target), or None when it records none. ArtifactError when it is recorded but missing or not the one
    built with the target (its manifest sha256 differs)."""
    spec = target.manifest.get("speculative")
    if not isinstance(spec, dict) or not isinstance(spec.get("draft"), dict):
        return None
    entry = spec["draft"]
    rel = entry.get("path")
    if not isinstance(rel, str) or not rel:
        raise ArtifactError(f"{target.root}/manifest.json: speculative.draft.path must be a relative path")
    folder = (target.root / rel).resolve()
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise ArtifactError(f"{target.root}: the paired draft {entry.get('name')} {entry.get('version')} is not "
                            f"at {folder} (pass the draft artifact's folder explicitly)")
    sha = sha256_file(manifest)
    if entry.get("manifest_sha256") not in (None, sha):
        raise ArtifactError(f"{folder}: manifest sha256 {sha[:12]} is not the {str(entry['manifest_sha256'])[:12]} "
                            f"recorded by {target.root} (the draft was rebuilt or replaced)")
    return folder


@dataclass
class _SeqCache:
    """What the draft pool holds for one sequence: its tokens at positions 0..len-1, in `blocks`."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    stable: int = 0  # tokens known to be the sequence's own (not proposals): no need to compare them again


class DraftModel:
    """A draft artifact on its own backend session, its pool addressed by the target's block ids (module doc).

    `propose(items)` takes (seq id, known tokens, the target's block table, k) per sequence and returns
    seq id -> k greedy proposals; `forget(seq_id)` drops a finished sequence's record."""

    def __init__(self, artifact: Artifact, target: Artifact, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, threads: int | None = None,
                 device: str | None = None) -> None:
        check_pairing(target, artifact)
        self.artifact = artifact
        self.max_model_len = artifact.check_runtime(device=device, max_model_len=max_model_len).max_model_len
        self.block_size = block_size
        self.shared_blocks = num_blocks
        self.scratch_per_seq = -(-(MAX_DRAFT_TOKENS + 1) // block_size) + 1
        self.budget = max(max_num_batched_tokens, max_num_seqs)
        try:
            self.backend = load_backend(artifact, num_blocks + max_num_seqs * self.scratch_per_seq, threads, device)
        except (ArtifactError, RuntimeError, ValueError):
            raise
        except Exception as exc:  # ONNX Runtime's own exception types for a corrupt graph
            raise ArtifactError(f"{artifact.model_path}: the draft model could not be loaded: {exc}") from exc
        self._seqs: dict[int, _SeqCache] = {}
        self.stats = {"forwards": 0, "tokens": 0, "catch_up_tokens": 0}
        log.info("draft model %s %s: %d layers, pool of %d + %d scratch blocks", artifact.name, artifact.version,
                 artifact.runtime_config["model"].get("num_layers", 0), num_blocks, max_num_seqs * self.scratch_per_seq)

    @property
    def name(self) -> str:
        return f"{self.artifact.name} {self.artifact.version}"

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def _valid(self, seq_id: int, tokens: list[int], table: list[int]) -> int:
        """How many leading positions of `tokens` the draft pool already holds for this sequence."""
        st = self._seqs.get(seq_id)
        if st is None:
            return 0
        n = min(len(st.tokens), len(tokens))
        valid = n
        for i in range(min(st.stable, n), n):
            if st.tokens[i] != tokens[i]:
                valid = i
                break
        bs = self.block_size
        for j in range(-(-valid // bs)):
            if j >= len(table) or st.blocks[j] != table[j]:
                valid = min(valid, j * bs)
                break
        return valid

    def propose(self, items: list[tuple[int, list[int], list[int], int]]) -> dict[int, list[int]]:
        """seq id -> up to k greedy proposals for each (seq id, tokens, target block table, k); a sequence
        whose blocks do not cover its computed tokens (waiting, or mid-recompute) proposes nothing."""
        bs = self.block_size
        rows: list[dict[str, Any]] = []
        for seq_id, tokens, table, k in items:
            size = len(tokens)
            k = min(k, MAX_DRAFT_TOKENS, self.max_model_len - size)
            if k < 1 or len(table) * bs < size - 1:
                continue
            start = min(self._valid(seq_id, tokens, table), size - 1)
            slot = len(rows)
            need = -(-(size - 1 + k) // bs)  # blocks of positions 0 .. size-2+k (the last proposal is not fed)
            scratch = [self.shared_blocks + slot * self.scratch_per_seq + i for i in range(max(0, need - len(table)))]
            rows.append({"seq": seq_id, "tokens": tokens, "table": table, "k": k, "start": start,
                         "blocks": list(table[:need]) + scratch, "out": []})
        if not rows:
            return {}
        # catch-up: while the unseen tokens exceed the budget, run them in chunks (no proposals yet)
        while sum(len(r["tokens"]) - r["start"] for r in rows) > self.budget:
            left, chunks = self.budget, []
            for r in rows:
                n = min(len(r["tokens"]) - 1 - r["start"], left)
                if n > 0:
                    chunks.append((r, r["tokens"][r["start"]: r["start"] + n]))
                    left -= n
            if not chunks:
                break
            self._forward(chunks)
            for r, chunk in chunks:
                self.stats["catch_up_tokens"] += len(chunk)
                r["start"] += len(chunk)
        # the first proposal: each sequence's unseen tokens up to its last known one
        chunks = [(r, r["tokens"][r["start"]:]) for r in rows]
        picks = self._forward(chunks)
        for (r, chunk), tok in zip(chunks, picks, strict=True):
            self.stats["catch_up_tokens"] += len(chunk) - 1
            r["start"] += len(chunk)
            r["out"].append(tok)
        # the others: one token per sequence still proposing
        for j in range(1, max(r["k"] for r in rows)):
            live = [r for r in rows if r["k"] > j]
            picks = self._forward([(r, [r["out"][-1]]) for r in live])
            for r, tok in zip(live, picks, strict=True):
                r["start"] += 1
                r["out"].append(tok)
        out: dict[int, list[int]] = {}
        for r in rows:
            written = r["tokens"] + r["out"][:-1]  # the positions the draft pool now holds
            real = min(len(written), len(r["table"]) * bs)
            st = self._seqs.setdefault(r["seq"], _SeqCache())
            st.tokens = written[:real]
            st.blocks = list(r["table"])
            st.stable = len(r["tokens"])
            out[r["seq"]] = r["out"]
        return out

    def _forward(self, chunks: list[tuple[dict[str, Any], list[int]]]) -> list[int]:
        """One draft forward of `chunks` (row, tokens from row['start']); the argmax after each chunk."""
        bs = self.block_size
        lens = [len(c) for _, c in chunks]
        total = sum(lens)
        ids = np.fromiter((t for _, c in chunks for t in c), np.int64, total)
        positions = np.concatenate([np.arange(r["start"], r["start"] + n, dtype=np.int64)
                                    for (r, _), n in zip(chunks, lens, strict=True)])
        cu = np.zeros(len(chunks) + 1, np.int32)
        cu[1:] = np.cumsum(lens)
        past = np.asarray([r["start"] for r, _ in chunks], np.int32)
        width = max(-(-(r["start"] + n) // bs) for (r, _), n in zip(chunks, lens, strict=True))
        table = np.full((len(chunks), width), -1, np.int32)
        slots = np.empty(total, np.int64)
        for i, ((r, _), n) in enumerate(zip(chunks, lens, strict=True)):
            blocks = np.asarray(r["blocks"][:width], np.int64)
            table[i, : blocks.shape[0]] = blocks
            pos = positions[cu[i]: cu[i] + n]
            slots[cu[i]: cu[i] + n] = blocks[pos // bs] * bs + pos % bs
        fb = ForwardBatch(ids, positions, cu, past, table, slots, (cu[1:] - 1).astype(np.int64))
        logits = self.backend.forward(fb)
        self.stats["forwards"] += 1
        self.stats["tokens"] += total
        return [int(t) for t in np.argmax(logits, axis=-1)]
