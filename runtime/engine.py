"""Request lifecycle: queue -> prefill (chunked) -> decode -> finish/abort, on one artifact.

`LLMEngine.step()` is the whole loop: propose drafts for speculative requests (runtime/speculative.py),
schedule, pack, run the model (while the token masks of grammar-constrained requests are computed on a
worker thread: runtime/structured.py), sample or verify, then apply stop conditions. The scheduler (runtime/core) owns the KV blocks; the backend sees only ForwardBatches.
`LLM` is the offline API: `LLM(artifact).generate(prompts, SamplingParams(...))`.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.artifact import Artifact, ArtifactError
from runtime.backends import load_backend
from runtime.core import CORE_IMPL, RNG, Scheduler, SchedulerConfig
from runtime.cpu_check import bf16_line, int8_warning, isa_warning, retune
from runtime.draft import DraftModel, paired_draft
from runtime.oci import is_reference, resolve_artifact
from runtime.sampling import Sampler, SamplingParams, make_generator
from runtime.speculative import SpeculativeConfig, ngram_propose, verify_greedy, verify_sampled
from runtime.structured import Grammars, mask_words
from runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    """Lifecycle order: everything after RUNNING is finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 3  # max_tokens or the model's context
    FINISHED_ABORTED = 4

    @property
    def finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # all text generated so far (stop string excluded)
    token_ids: list[int]  # all tokens generated so far
    new_text: str  # text added since the previous output of this request
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    # Only for requests added with `logprobs=N`: one entry per token of `new_token_ids`.
    new_logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None  # the request's timestamps (shared, updated in place)
    # Only for requests added with `prompt_logprobs=N`, once the whole prompt has been computed: one entry
    # per prompt token, None for the first (nothing predicts it), else its logprob given the tokens before
    # it plus the top N.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Only for requests added with `logprobs=N` that ended on EOS or a stop token id: that token's logprob
    # (the token itself is not in token_ids or the text; OpenAI and vLLM list it among the logprobs).
    stop_logprob: TokenLogprob | None = None


@dataclass
class TokenLogprob:
    """Log-probability of a generated token under the model (log_softmax of the raw logits row)."""

    token_id: int
    logprob: float  # natural log; temperature, top-k and top-p are not applied
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), best first
    rank: int = 0  # 1 + how many tokens are more likely (0: not computed)


@dataclass
class RequestMetrics:
    """time.perf_counter() timestamps (seconds) of one request's phases."""

    arrival: float  # added (or the caller's receive time, `add_request(arrival=...)`)
    first_scheduled: float | None = None  # the step running its first chunk started
    first_token: float | None = None  # its first token was sampled
    finished: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the KV cache at its first step (prefix cache)


@dataclass
class _Request:
    request_id: str
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: RNG
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # of output_ids (a multi-byte character's incomplete tail held back until it finishes)
    detok: Any = None  # the tokenizer's TextStream over output_ids
    emitted: int = 0  # characters of `text` already handed out
    emitted_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_logprobs: int | None = None  # None: no logprobs; N: chosen token + top N
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_logprobs: int | None = None  # None: none; N: each prompt token's logprob + top N
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled chunk by chunk during the prefill
    stop_logprob: TokenLogprob | None = None  # the logprob of the EOS / stop token that ended it
    grammar: Any = None  # params.structured's matcher (llguidance LLMatcher): the tokens so far consumed
    speculative: SpeculativeConfig | None = None  # how it proposes tokens (None: plain decoding)
    draft: list[int] = field(default_factory=list)  # this step's proposals


class LLMEngine:
    """Continuous batching over one artifact: add requests at any time, call `step()` until done."""

    def __init__(
        self,
        artifact: str | Path | Artifact,
        *,
        verify: bool = True,
        num_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        threads: int | None = None,
        enable_prefix_caching: bool = True,
        device: str | None = None,
        graphs: str | None = None,
        overlap_masks: bool | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: str | Path | Artifact | bool | None = None,
        retune: bool = False,
    ) -> None:
        """`overlap_masks`: compute structured output's token masks on a worker thread during the forward
        (default; OPTIMIZE_MASK_OVERLAP=0 turns it off) rather than before it on the engine thread.
        `speculative`: the default of requests that do not say (`add_request(speculative=...)`); None:
        plain decoding unless a request opts in.
        `draft`: the draft model of method "draft" (runtime/draft.py): an artifact folder (or Artifact),
        True for the one the target's manifest pairs with it, False for none; None (default): the paired
        one when `speculative` is a "draft" config, else none.
        `retune`: re-measure the C ops' code path on this machine before loading (runtime/cpu_check.py;
        the attention variant itself is part of the graph and stays)."""
        if speculative is not None:
            speculative.validate()
        self.speculative = speculative
        self.overlap_masks = overlap_masks if overlap_masks is not None else \
            os.environ.get("OPTIMIZE_MASK_OVERLAP", "1").strip() != "0"
        self.artifact = artifact if isinstance(artifact, Artifact) else Artifact.open(artifact, verify=verify)
        limits = self.artifact.check_runtime(num_blocks=num_blocks, max_model_len=max_model_len, device=device,
                                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        cfg = self.artifact.runtime_config
        try:
            cpu_isa = self._retune(threads, device) if retune else None
            self.backend = load_backend(self.artifact, num_blocks, threads, device, graphs, cpu_isa)
        except (ArtifactError, RuntimeError, ValueError):
            raise
        except MemoryError as exc:
            raise ArtifactError(f"{self.artifact.root}: not enough memory to load the model and its KV pool "
                                f"({exc or 'MemoryError'})") from exc
        except Exception as exc:  # ONNX Runtime's own exception types for a corrupt graph
            raise ArtifactError(f"{self.artifact.model_path}: the model could not be loaded: {exc}") from exc
        self._report_kernel_paths()
        self.scheduler_config = SchedulerConfig(
            block_size=self.backend.block_size,
            num_blocks=self.backend.num_blocks,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=limits.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            enable_copy_on_write=True,  # step() applies batch.block_copies before the forward
        )
        self.scheduler = Scheduler(self.scheduler_config)
        self.tokenizer = Tokenizer(self.artifact.tokenizer_dir)
        self.sampler = Sampler()
        model = cfg["model"]
        self.vocab_size = int(model["vocab_size"])
        self.eos_token_ids = set(model.get("eos_token_ids") or [])
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._masks = np.full((0, mask_words(self.vocab_size)), -1, np.int32)  # grown on demand; rows all ones
        self._dirty_masks: list[int] = []  # rows of _masks written by the last constrained step
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._seq_ids = itertools.count()
        self.stats: dict[str, Any] = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "prefill_tokens": 0,
                                      "decode_tokens": 0, "mask_wait_s": 0.0,
                                      # speculative decoding: proposals verified / accepted, and per draft
                                      # position j (0-based) how often one was verified / accepted there
                                      "spec_steps": 0, "spec_proposed": 0, "spec_accepted": 0,
                                      "spec_position_proposed": [], "spec_position_accepted": [],
                                      # the same counters by method ("ngram", "draft")
                                      "spec_by_method": {}}
        self.draft_model: DraftModel | None = self._load_draft(draft, threads, device)
        if speculative is not None and speculative.method == "draft" and self.draft_model is None:
            raise ValueError("speculative method 'draft' needs a draft model: pass `draft` (an artifact folder) "
                             "or build the target from a recipe with a `speculative:` section")
        log.info("engine ready: %s %s, core=%s", self.artifact.name, self.artifact.version, CORE_IMPL)

    def _retune(self, threads: int | None, device: str | None) -> str | None:
        """--retune: the fastest code path of the C ops for this artifact here (None: nothing to choose)."""
        cfg = self.artifact.runtime_config
        uses_ops = cfg["graph"].get("kv_write") == "graph" or "optimize" in cfg["graph"].get("custom_op_domains", [])
        if cfg.get("backend") != "onnxruntime" or (device or cfg.get("device", "cpu")) != "cpu" or not uses_ops:
            log.info("--retune: nothing to re-measure (the package's CPU ops are not in this artifact's graph on "
                     "%s/%s)", cfg.get("backend"), device or cfg.get("device", "cpu"))
            return None
        best, scores = retune(self.artifact.model_path, cfg, threads)
        log.info("--retune: the attention variant is part of the graph and stays; CPU code path re-measured "
                 "(ms per request: prefill + 128 decode steps): %s -> %s",
                 ", ".join(f"{p} {s:.1f}" for p, s in scores.items()), best)
        return best

    def _report_kernel_paths(self) -> None:
        """Log where this CPU's code path differs from the one the build's autotune measured on, how
        bfloat16 products run here, and full-range int8 weights on a CPU without an int8 dot product."""
        paths = getattr(self.backend, "kernel_paths", None)
        if not paths:
            return
        warning = isa_warning(self.artifact.manifest, paths)
        if warning:
            log.warning("%s", warning)
        if self.artifact.manifest.get("target", {}).get("matmul") == "bfloat16":
            level, line = bf16_line(paths)
            log.log(level, "%s", line)
        int8 = int8_warning(self.artifact.manifest)
        if int8:
            log.warning("%s", int8)

    def _load_draft(self, draft: str | Path | Artifact | bool | None, threads: int | None,
                    device: str | None) -> DraftModel | None:
        if draft is None:
            draft = self.speculative is not None and self.speculative.method == "draft"
        if draft is False:
            return None
        if draft is True:
            folder = paired_draft(self.artifact)
            if folder is None:
                raise ArtifactError(f"{self.artifact.root}: its manifest pairs no draft model (build it from a "
                                    "recipe with a `speculative:` section, or pass the draft artifact's folder)")
            draft = folder
        art = draft if isinstance(draft, Artifact) else Artifact.open(draft, verify=True)
        sc = self.scheduler_config
        return DraftModel(art, self.artifact, num_blocks=sc.num_blocks, block_size=sc.block_size,
                          max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                          max_model_len=sc.max_model_len, threads=threads, device=device)

    @property
    def grammars(self) -> Grammars:
        """The grammar engine of structured output (runtime/structured.py), created on first use; the server
        compiles requests' constraints through it before admitting them."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = Grammars(self.artifact.tokenizer_dir / "tokenizer.json", self.vocab_size,
                                              sorted(self.eos_token_ids))
        return self._grammars

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    *, arrival: float | None = None, logprobs: int | None = None,
                    cache_salt: str | None = None, prompt_logprobs: int | None = None,
                    speculative: SpeculativeConfig | bool | None = None) -> None:
        """Queue a request. `arrival`: its perf_counter() receive time (default now); `logprobs`: N
        to get each generated token's logprob plus the top N (RequestOutput.new_logprobs);
        `cache_salt`: only requests with the same salt (or none) share prefix-cache blocks;
        `prompt_logprobs`: N to get each prompt token's logprob plus the top N
        (RequestOutput.prompt_logprobs). Such a request computes its whole prompt: it neither takes
        nor offers prefix-cache blocks (a cached prefix has no logits), so its numbers do not depend
        on what other requests left in the cache. `speculative`: a SpeculativeConfig, True (the
        engine's default config, else SpeculativeConfig()), False (plain decoding) or None (the
        engine's default); a grammar-constrained request never speculates."""
        params = params or SamplingParams()
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        params.validate()
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        limit = self.scheduler_config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; this artifact serves at most {limit} "
                             "tokens per sequence (prompt + output), so at most "
                             f"{limit - 1} prompt tokens")
        if speculative is True:
            speculative = self.speculative or SpeculativeConfig()
        elif speculative is None:
            speculative = self.speculative
        elif speculative is False:
            speculative = None
        elif isinstance(speculative, SpeculativeConfig):
            speculative.validate()
            if speculative.method == "draft" and self.draft_model is None:
                raise ValueError("speculative method 'draft': this engine has no draft model loaded")
        else:
            raise ValueError(f"speculative must be None, a bool or a SpeculativeConfig, got {speculative!r}")
        grammar = None if params.structured is None else self.grammars.matcher(params.structured)
        if grammar is not None:
            speculative = None  # proposals would need the grammar's masks at every draft position
        seq_id = next(self._seq_ids)
        req = _Request(request_id, seq_id, ids, params, make_generator(params.seed),
                       RequestMetrics(arrival=time.perf_counter() if arrival is None else arrival),
                       num_logprobs=logprobs, num_prompt_logprobs=prompt_logprobs, grammar=grammar,
                       speculative=speculative)
        if prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
            # a root of its own: no block of another request matches, none of its blocks is shared
            cache_salt = f"prompt-logprobs\0{seq_id}"
        self.scheduler.add(seq_id, ids, cache_root(cache_salt))
        self._requests[request_id] = req
        self._by_seq[seq_id] = req
        self.stats["prompt_tokens"] += len(ids)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed at once."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.abort(req.seq_id)
        self._by_seq.pop(req.seq_id, None)
        if self.draft_model is not None:
            self.draft_model.forget(req.seq_id)
        req.status = RequestStatus.FINISHED_ABORTED

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, apply stop conditions; outputs of requests that changed."""
        drafts = self._propose()
        preemptions = self.scheduler.num_preemptions
        batch = self.scheduler.schedule(drafts) if drafts else self.scheduler.schedule()
        if self.draft_model is not None and self.scheduler.num_preemptions != preemptions:
            for r in self._requests.values():  # a preempted sequence's blocks (and draft K/V) are gone
                if r.speculative is not None and not self.scheduler.seq_block_table(r.seq_id):
                    self.draft_model.forget(r.seq_id)
        if batch is None:
            return []
        started = time.perf_counter()
        if batch.block_copies:  # copy-on-write of shared prefix blocks this step writes into
            self.backend.copy_blocks(batch.block_copies)
        fb = self.scheduler.pack(batch)
        sampled_entries = [e for e in batch.entries if e.needs_logits]
        reqs = [self._by_seq[e.seq_id] for e in sampled_entries]
        # proposals each entry verifies (the scheduler may have cut a draft to its budget and blocks)
        ndraft = [e.start + e.num_tokens - len(r.prompt_ids) - len(r.output_ids) if r.draft else 0
                  for e, r in zip(sampled_entries, reqs, strict=True)]
        if any(ndraft):  # every position of a verified chunk needs its logits row
            fb.logits_index = np.concatenate([np.arange(idx - d, idx + 1, dtype=np.int64)
                                              for idx, d in zip(fb.logits_index.tolist(), ndraft, strict=True)])
        scored = self._prompt_rows(batch, fb)
        if scored:  # rows of prompt positions after the sampling rows, whose order is unchanged
            fb.logits_index = np.concatenate([fb.logits_index, np.asarray([row for row, _, _ in scored], np.int64)])
        guided = [(r.grammar, k) for k, r in enumerate(reqs) if r.grammar is not None]
        masks = self._mask_rows(len(reqs), [k for _, k in guided]) if guided else None
        job = None
        if guided and self.overlap_masks:  # the constrained rows' masks on the grammar worker while the model runs
            job = self.grammars.start_masks(guided, masks)  # type: ignore[arg-type]
        elif guided:  # or here, before it
            waited = time.perf_counter()
            self.grammars.fill_masks(guided, masks)  # type: ignore[arg-type]
            self.stats["mask_wait_s"] += time.perf_counter() - waited
        try:
            logits = self.backend.forward(fb)
        finally:
            if job is not None:
                waited = time.perf_counter()
                job.result()
                self.stats["mask_wait_s"] += time.perf_counter() - waited  # masks slower than the forward
        now = time.perf_counter()
        base = len(fb.logits_index) - len(scored)
        prompt_rows, logits = logits[base:], logits[:base]
        for k, (_, r, pos) in enumerate(scored):  # row of position pos predicts prompt token pos + 1
            assert r.prompt_logprobs is not None and r.num_prompt_logprobs is not None
            r.prompt_logprobs[pos + 1] = _token_logprob(prompt_rows[k], r.prompt_ids[pos + 1],
                                                        r.num_prompt_logprobs)
        for e in batch.entries:
            r = self._by_seq[e.seq_id]
            if r.metrics.first_scheduled is None:
                r.metrics.first_scheduled = started
                r.metrics.num_cached_tokens = e.start  # computed before its first step: prefix-cache hits
            decode = (e.num_tokens == 1 or bool(r.draft)) and e.start >= len(r.prompt_ids)
            self.stats["decode_tokens" if decode else "prefill_tokens"] += e.num_tokens
        # row k of `logits` is entry k's last row, the rows of a verified chunk are rows[k]
        firsts = np.cumsum([0] + [d + 1 for d in ndraft])
        if any(ndraft):
            rows = [logits[firsts[k]: firsts[k + 1]] for k in range(len(reqs))]
            logits = logits[firsts[1:] - 1]
        accepted = self._sample_or_verify(logits, rows if any(ndraft) else None, reqs, ndraft, masks)
        self.scheduler.update(batch, {e.seq_id: toks if len(toks) > 1 or ndraft[k] else toks[0]
                                      for k, (e, toks) in enumerate(zip(sampled_entries, accepted, strict=True))})
        self.stats["steps"] += 1
        outputs = []
        for k, (r, toks) in enumerate(zip(reqs, accepted, strict=True)):
            r.draft = []
            out = None
            for j, tok in enumerate(toks):
                row = rows[k][j] if ndraft[k] else logits[k]  # type: ignore[index]
                lp = None if r.num_logprobs is None else _token_logprob(row, tok, r.num_logprobs)
                out = self._append(r, tok, now, lp, self._advance_grammar(r, tok), emit=False)
                if r.status.finished:
                    break
            out = self._output(r)
            if out is not None:
                outputs.append(out)
        return outputs

    def _propose(self) -> dict[int, list[int]]:
        """This step's drafts (seq id -> proposed tokens) of the running speculative requests."""
        drafts: dict[int, list[int]] = {}
        limit = self.scheduler_config.max_model_len
        by_draft: list[tuple[int, list[int], list[int], int]] = []
        for r in self._requests.values():
            spec = r.speculative
            r.draft = []
            if spec is None or r.status is not RequestStatus.RUNNING:
                continue
            known = len(r.prompt_ids) + len(r.output_ids)
            # the token after the accepted proposals is always emitted: never propose past max_tokens
            k = min(spec.num_tokens, r.params.max_tokens - len(r.output_ids) - 1, limit - known - 1)
            if k < 1:
                continue
            if spec.method == "draft":
                by_draft.append((r.seq_id, r.prompt_ids + r.output_ids, self.scheduler.seq_block_table(r.seq_id), k))
                continue
            draft = ngram_propose(r.prompt_ids + r.output_ids, k, spec.ngram_max, spec.ngram_min)
            if draft:
                r.draft = draft
                drafts[r.seq_id] = draft
        if by_draft and self.draft_model is not None:
            for seq_id, draft in self.draft_model.propose(by_draft).items():
                self._by_seq[seq_id].draft = draft
                drafts[seq_id] = draft
        return drafts

    def _sample_or_verify(self, logits: np.ndarray, rows: list[np.ndarray] | None, reqs: list[_Request],
                          ndraft: list[int], masks: np.ndarray | None) -> list[list[int]]:
        """Per request: [the sampled token], or for a verified draft its accepted proposals + the next token."""
        plain = [k for k, d in enumerate(ndraft) if not d]
        out: list[list[int]] = [[] for _ in reqs]
        if plain:
            sub = plain if len(plain) < len(reqs) else slice(None)
            picks = self._sample(logits[sub], [reqs[k] for k in plain], None if masks is None else masks[sub])
            for k, t in zip(plain, picks, strict=True):
                out[k] = [int(t)]
        st = self.stats
        for k, d in enumerate(ndraft):
            if not d:
                continue
            assert rows is not None
            r = reqs[k]
            draft = r.draft[:d]
            verify = verify_greedy if r.params.greedy else verify_sampled
            out[k] = verify(self.sampler, rows[k], r.params, r.generator, r.prompt_ids, r.output_ids, draft)
            n_acc = len(out[k]) - 1
            st["spec_steps"] += 1
            st["spec_proposed"] += d
            st["spec_accepted"] += n_acc
            method = st["spec_by_method"].setdefault(r.speculative.method if r.speculative else "ngram",
                                                     {"proposed": 0, "accepted": 0})
            method["proposed"] += d
            method["accepted"] += n_acc
            for name in ("spec_position_proposed", "spec_position_accepted"):
                if len(st[name]) < d:
                    st[name].extend([0] * (d - len(st[name])))
            for j in range(d):
                st["spec_position_proposed"][j] += 1
                st["spec_position_accepted"][j] += j < n_acc
        return out

    def _prompt_rows(self, batch: Any, fb: Any) -> list[tuple[int, _Request, int]]:
        """(packed row, request, prompt position) of the step's prompt tokens whose next token is a prompt
        token, for requests that asked for prompt logprobs (entries are packed in batch order)."""
        rows: list[tuple[int, _Request, int]] = []
        for i, e in enumerate(batch.entries):
            r = self._by_seq[e.seq_id]
            if r.num_prompt_logprobs is None:
                continue
            last = min(e.start + e.num_tokens, len(r.prompt_ids) - 1)  # positions < len - 1
            off = int(fb.cu_seqlens[i]) - e.start
            rows.extend((off + pos, r, pos) for pos in range(e.start, last))
        return rows

    def _mask_rows(self, n: int, constrained: list[int]) -> np.ndarray:
        """The first n rows of the token-mask buffer, all ones but for the `constrained` rows about to be
        written (the rows the previous step wrote go back to all ones here: O(constrained rows))."""
        if self._masks.shape[0] < n:
            self._masks = np.full((max(n, 2 * self._masks.shape[0]), self._masks.shape[1]), -1, np.int32)
        else:
            self._masks[self._dirty_masks] = -1
        self._dirty_masks = constrained
        return self._masks[:n]

    def _sample(self, logits: np.ndarray, reqs: list[_Request], masks: np.ndarray | None = None) -> Sequence[int]:
        """Next token of each request; token histories are passed only when a penalty needs them."""
        params = [r.params for r in reqs]
        gens = [r.generator for r in reqs]
        if any(p.has_penalties for p in params):
            return self.sampler.sample(logits, params, gens, prompt_ids=[r.prompt_ids for r in reqs],
                                       output_ids=[r.output_ids for r in reqs], masks=masks)
        return self.sampler.sample(logits, params, gens, masks=masks)

    @staticmethod
    def _advance_grammar(r: _Request, tok: int) -> bool:
        """Feed the sampled token to the request's matcher; True when the grammar is complete (it takes
        nothing more but EOS), which ends the request."""
        if r.grammar is None:
            return False
        if not r.grammar.consume_token(tok):  # the mask allowed it, so only a broken grammar state gets here
            log.error("request %s: the grammar refused token %d: %s", r.request_id, tok, r.grammar.get_error())
            return True
        return bool(r.grammar.is_stopped())

    def _append(self, r: _Request, tok: int, now: float, lp: TokenLogprob | None = None,
                grammar_done: bool = False, emit: bool = True) -> RequestOutput | None:
        """Add one generated token and apply the stop conditions; the request's output when `emit`."""
        r.status = RequestStatus.RUNNING
        if r.metrics.first_token is None:
            r.metrics.first_token = now
        p = r.params
        self.stats["generation_tokens"] += 1
        # a constrained request's EOS always ends it: its mask allows EOS only where the grammar is complete
        if (tok in self.eos_token_ids and (not p.ignore_eos or r.grammar is not None)) or tok in p.stop_token_ids:
            r.status = RequestStatus.FINISHED_STOPPED
            r.stop_logprob = lp
        else:
            r.output_ids.append(tok)
            if lp is not None:
                r.output_logprobs.append(lp)
            if r.detok is None:
                r.detok = self.tokenizer.stream()
            r.text += r.detok.step(tok)
            if p.stop:
                hit = _find_stop(r.text, p.stop, r.emitted)
                if hit is not None:
                    r.text = r.text[:hit]
                    r.status = RequestStatus.FINISHED_STOPPED
                    r.detok = None  # the text ends at the stop string
            if not r.status.finished:
                if grammar_done:
                    r.status = RequestStatus.FINISHED_STOPPED
                elif len(r.output_ids) >= p.max_tokens:
                    r.status = RequestStatus.FINISHED_LENGTH
                elif len(r.prompt_ids) + len(r.output_ids) >= self.scheduler_config.max_model_len:
                    r.status = RequestStatus.FINISHED_LENGTH
        if r.status.finished:
            if r.detok is not None:  # an incomplete character at the end reads as decode() shows it
                r.text = self.tokenizer.decode(r.output_ids)
                r.detok = None
            r.metrics.finished = now
            self.scheduler.finish(r.seq_id)
            self._requests.pop(r.request_id, None)
            self._by_seq.pop(r.seq_id, None)
            if self.draft_model is not None:
                self.draft_model.forget(r.seq_id)
        return self._output(r) if emit else None

    def _output(self, r: _Request) -> RequestOutput | None:
        finished = r.status.finished
        # Hold back an incomplete UTF-8 character and a possible stop-string prefix while streaming.
        visible = len(r.text)
        if not finished:
            if r.text.endswith("\ufffd"):
                visible = len(r.text.rstrip("\ufffd"))
            if r.params.stop:
                visible -= _held_back(r.text, visible, r.params.stop)
        visible = max(visible, r.emitted)
        new_text = r.text[r.emitted:visible]
        new_ids = r.output_ids[r.emitted_tokens:]
        if not new_text and not new_ids and not finished:
            return None
        new_logprobs = r.output_logprobs[r.emitted_tokens:] if r.num_logprobs is not None else None
        r.emitted = visible
        r.emitted_tokens = len(r.output_ids)
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_ids,
            text=r.text[:visible],
            token_ids=list(r.output_ids),
            new_text=new_text,
            new_token_ids=new_ids,
            finished=finished,
            finish_reason=FINISH_REASON.get(r.status),
            new_logprobs=new_logprobs,
            metrics=r.metrics,
            prompt_logprobs=r.prompt_logprobs,
            stop_logprob=r.stop_logprob if finished else None,
        )


def _token_logprob(row: np.ndarray, token: int, n: int) -> TokenLogprob:
    """log_softmax of one logits row (float64): the chosen token's logprob and the top `n`."""
    x = np.asarray(row, dtype=np.float64)
    top = x.max()
    logz = top + np.log(np.exp(x - top).sum())
    best: list[tuple[int, float]] = []
    if n > 0:
        k = min(n, x.shape[0])
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        best = [(int(i), float(x[i] - logz)) for i in idx]
    return TokenLogprob(token, float(x[token] - logz), best, int((x > x[token]).sum()) + 1)


def cache_root(salt: str | None) -> int:
    """The scheduler's root hash for a cache salt: 0 without one (the shared cache)."""
    if not salt:
        return 0
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"cache-salt").digest()
    return int.from_bytes(digest, "little") or 1


def _held_back(text: str, end: int, stops: list[str]) -> int:
    """Length of the longest suffix of text[:end] that is a proper prefix of a stop string.

    Never copies `text`: the candidates are the prefixes of a stop string that end with the text's
    last character (found with `str.rfind`), each compared in place at its offset, so a step costs
    O(total stop length), whatever the length of the text generated so far.
    """
    if end <= 0:
        return 0
    last = text[end - 1]
    best = 0
    for s in stops:
        k = min(len(s) - 1, end)
        while k > best:
            i = s.rfind(last, 0, k)
            if i < best:
                break
            k = i + 1
            if text.startswith(s[:k], end - k, end):
                best = k
                break
            k -= 1
    return best


def _find_stop(text: str, stops: list[str], emitted: int) -> int | None:
    """Index where the earliest stop string starts in the not-yet-final tail of `text`, or None."""
    start = max(0, emitted - max(len(s) for s in stops))
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


class LLM:
    """Offline generation from an artifact: `LLM(path).generate(prompts, params)`."""

    def __init__(self, artifact: str | Path, *, require_signature: str | Path | None = None, insecure: bool = False,
                 **engine_kwargs: Any) -> None:
        """`artifact`: a folder, or a reference (oci://HOST/REPO:TAG, file:///DIR/REPO:TAG) pulled or reused
        from the cache and verified first; `require_signature`: a public key the reference must be signed by."""
        if is_reference(artifact) or require_signature is not None:
            key = Path(require_signature) if require_signature is not None else None
            artifact = resolve_artifact(artifact, insecure=insecure, require_signature=key)
        self.engine = LLMEngine(artifact, **engine_kwargs)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.engine.add_request(rid, prompt, p)  # type: ignore[arg-type]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs of one request as tokens are produced (each with its `new_text`)."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)
