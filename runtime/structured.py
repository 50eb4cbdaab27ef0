"""Structured output: grammar-constrained decoding (JSON schema, any JSON object, regex, choice, grammar).

A request's constraint is a `StructuredOutput` (on `SamplingParams.structured`). The engine gives each
constrained request a matcher (llguidance's `LLMatcher`) over the artifact's own tokenizer, and every
step:

1. before the forward, `Grammars.start_masks` computes the packed token masks of the step's constrained
   rows on a worker thread (llguidance's `LLExecutor`, which drops the GIL), into an int32 [rows,
   ceil(vocab / 32)] buffer whose other rows stay all ones; the forward runs meanwhile (ONNX Runtime and
   torch drop the GIL too), so the masks cost the batch nothing unless they take longer than the forward;
2. the sampler (C core or its twin) applies each row's mask before temperature/top-k/top-p
   (runtime/core/_sampler.c: a disallowed token's logit is -inf);
3. after sampling, each matcher consumes its token; a matcher that can take nothing more but EOS
   (`is_stopped`) ends its request ("stop"): EOS is allowed by the mask only where the grammar accepts.

Compiling a grammar (the JSON schema or regex to llguidance's lexer and parser, checked against the
vocabulary) happens once per distinct constraint: `Grammars.compile` keeps an LRU of compiled templates
and every request gets a `deep_copy` of one (microseconds). The server compiles on its thread pool
before admitting a request, so an invalid schema or regex is a 400 and the engine thread only ever
copies. JSON is generated compact (no whitespace between tokens): with free whitespace a model can
emit blanks until max_tokens (the demo model, trained on Python source, does).

Why llguidance rather than xgrammar: docs/architecture.md, "Structured output" (bench/structured_engines.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["KINDS", "Grammars", "StructuredOutput", "StructuredOutputError", "mask_words"]

KINDS = ("json", "json_object", "regex", "choice", "grammar")
INSTALL_HINT = "structured output needs the llguidance package: pip install llguidance"
# JSON is compact: no whitespace between tokens (a model cannot pad with blanks until max_tokens)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (invalid schema, regex or grammar), or no grammar engine."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed token-mask row: ceil(vocab / 32)."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint. `value` by kind: json: the JSON schema as JSON text; json_object: "";
    regex: the regex (Rust regex syntax, matched against the whole output); choice: a JSON list of the
    allowed strings; grammar: a Lark or GBNF (llama.cpp) grammar."""

    kind: str
    value: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("a JSON schema must be a JSON object")
        return cls("json", json.dumps(schema, separators=(",", ":")))  # key order kept: it is the output's

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        if (isinstance(choices, str) or not isinstance(choices, Sequence) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise StructuredOutputError(f"at most {MAX_CHOICES} choices, got {len(choices)}")
        return cls("choice", json.dumps(list(choices)))

    def validate(self) -> None:
        """Cheap checks of shape (the grammar itself is checked by `Grammars.compile`)."""
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"the {self.kind} constraint must be a string of at most {MAX_SPEC_CHARS} "
                                        "characters")
        if self.kind in ("regex", "grammar") and not self.value:
            raise StructuredOutputError(f"the {self.kind} constraint is empty")

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        llguidance = _llguidance()
        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(self.value, overrides=JSON_OPTIONS)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                return llguidance.grammar_from("choice", self.value)
            return llguidance.grammar_from("grammar", self.value)
        except ValueError as exc:
            raise StructuredOutputError(f"invalid {self.kind} constraint: {exc}") from None


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputError(INSTALL_HINT) from None
    return llguidance


class Grammars:
    """The grammar engine of one engine: llguidance's tokenizer over the artifact's vocabulary (built on
    first use, offline, from tokenizer/tokenizer.json), compiled constraints (LRU of `cache_size`),
    matchers, and the masks of a step. Thread-safe: the server compiles on its pool while the engine
    thread copies matchers."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = 256, threads: int | None = None) -> None:
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.cache_size = cache_size
        self.threads = threads or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._executor: Any = None
        self._cache: collections.OrderedDict[StructuredOutput, Any] = collections.OrderedDict()
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.stats: dict[str, float] = {"compiled": 0, "hits": 0, "mask_s": 0.0, "mask_rows": 0}

    def _tok(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                if not self.eos_token_ids:
                    raise StructuredOutputError("structured output needs the model's EOS token id (runtime.json "
                                                "model.eos_token_ids is empty)")
                try:
                    text = self.tokenizer_json.read_text("utf-8")
                    self._tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                except (OSError, ValueError, RuntimeError) as exc:
                    raise StructuredOutputError(f"{self.tokenizer_json}: llguidance cannot use this tokenizer: "
                                                f"{exc}") from None
                self._executor = llg.LLExecutor(num_threads=self.threads)
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled template of `spec` (cached); StructuredOutputError with llguidance's message when
        the schema, regex or grammar is invalid."""
        spec.validate()
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats["hits"] += 1
                return hit
        tok = self._tok()
        llg = _llguidance()
        matcher = llg.LLMatcher(tok, spec.grammar(), log_level=0)  # drops the GIL while it builds
        if matcher.is_error():
            raise StructuredOutputError(f"invalid {_NAMES[spec.kind]}: {matcher.get_error()}")
        with self._lock:
            self._cache[spec] = matcher
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.stats["compiled"] += 1
        return matcher

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for one request (a copy of the compiled template)."""
        return self.compile(spec).deep_copy()

    def fill_masks(self, rows: Sequence[tuple[Any, int]], masks: np.ndarray) -> None:
        """Write the next-token mask of each (matcher, row) into masks[row] (int32 [rows, words], C order)."""
        if masks.dtype != np.int32 or masks.ndim != 2 or not masks.flags.c_contiguous \
                or masks.shape[1] != mask_words(self.vocab_size):
            raise ValueError(f"masks: expected a C-contiguous int32 [rows, {mask_words(self.vocab_size)}] array")
        if not all(0 <= row < masks.shape[0] for _, row in rows):
            raise ValueError("fill_masks: a row outside the masks buffer")
        self._tok()
        started = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(list(rows), masks.ctypes.data, masks.shape[1] * 4, masks.shape[0])
        self.stats["mask_s"] += time.perf_counter() - started
        self.stats["mask_rows"] += len(rows)

    def start_masks(self, rows: Sequence[tuple[Any, int]], masks: np.ndarray) -> concurrent.futures.Future[None]:
        """`fill_masks` on the worker thread; the caller runs the forward meanwhile, then waits."""
        if self._worker is None:
            with self._lock:
                if self._worker is None:
                    self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._worker.submit(self.fill_masks, rows, masks)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}
