"""OpenAI-compatible HTTP server for one artifact (aiohttp), with SSE streaming, metrics and back-pressure.

Endpoints:

    POST /v1/completions        prompt (a string, token ids, or a list of up to 64 of those)
    POST /v1/chat/completions   messages, rendered with the tokenizer's chat template
    GET  /v1/models             the served model (id = artifact name unless --served-model-name)
    POST /tokenize              vLLM's shape: prompt or messages -> token ids (also under /v1)
    POST /detokenize            token ids -> text (also under /v1)
    GET  /tokenizer_info        the tokenizer's config, context and vocabulary size (also under /v1)
    GET  /health                200 while the process and its engine thread are alive (liveness)
    GET  /ready                 200 once the artifact is verified, loaded and warmed up, and not draining
    GET  /metrics               Prometheus text (runtime/metrics.py)

Request fields: max_tokens (chat: also max_completion_tokens), temperature (default 1), top_p,
top_k (extension; -1 or 0 = off), seed, stop (a string or a list), n (1..16), best_of (completions:
n..16; above n not streamed), stream, stream_options.include_usage, logprobs (completions: 0..20
alternatives; chat: bool with top_logprobs 0..20), echo (completions; with logprobs the prompt's tokens
lead the logprobs object, not streamed; max_tokens 0 with echo scores the prompt alone), and the vLLM
extensions prompt_logprobs (0..20, not streamed), ignore_eos, stop_token_ids and cache_salt (requests
share prefix-cache blocks only with the same salt), and `speculative` (true, false, {"method": "ngram",
"num_tokens": k, "ngram_max": n, "ngram_min": m} or, with a draft model loaded, {"method": "draft", "num_tokens": k}; absent: the server's --speculative default;
runtime/speculative.py: exact, the same tokens greedy and the same distribution sampled). Logprobs are log_softmax of the model's raw logits
(before temperature/top-k/top-p). presence_penalty, frequency_penalty, repetition_penalty and min_p go
to the sampler where this runtime's SamplingParams has them (else 400 unless neutral); logit_bias,
suffix, tools and chat's best_of are refused (400) unless neutral; other unknown fields are ignored.
completions default to 16 tokens; chat defaults to the rest of the context.

Structured output (both endpoints; runtime/structured.py): response_format {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"schema": {...}}}, vLLM's guided_json, guided_regex,
guided_choice and guided_grammar (Lark or GBNF), or vLLM's structured_outputs {json, regex, choice,
grammar, json_object}; one constraint per request. It is compiled (cached per constraint) before the
request is admitted: an invalid schema, regex or grammar is a 400 naming the field. The output is
sampled under the grammar's token mask and ends ("stop") when the grammar is complete; max_tokens can
still cut it short ("length"). JSON comes out compact (no whitespace between tokens).

Several choices (prompts x n): one engine request per sample, run together; choice index = prompt index
x n + sample. With a seed, sample j > 0 samples with seed_for(seed, j), so sample 0 is what a request
of n = 1 gives. Streamed, the choices interleave as their tokens come (each chunk one choice, with its
index; each choice's own finish_reason on its last chunk; include_usage's last chunk sums the request,
each prompt counted once). best_of > n (vLLM's): best_of samples per prompt (the ones n = best_of draws
with the same seed), of which the n of highest cumulative logprob (the sum of the sampled tokens'
logprobs, EOS or the stop token included) are returned, the most likely first; usage counts every
sample's tokens (they were generated, as OpenAI bills best_of).

Chat template: `chat_template` of tokenizer/tokenizer_config.json, rendered with a sandboxed
Jinja2 environment (messages, add_generation_prompt=True, bos_token, eos_token). Without one the
fallback format is, for each message, `### <Role>:\n<content>\n\n`, then `### Assistant:\n`
(Role capitalised; content parts of type "text" are joined).

Errors are OpenAI-style: `{"error": {"message", "type", "param", "code"}}`; `_ERRORS` maps each
kind to its status; each refused request logs one line (WARNING; INFO for 429/503), a 500 its
traceback. Admission: requests the engine has not finished, outside its running batch, are bounded
by --max-waiting (429 with Retry-After beyond it), and per client address by
--max-requests-per-client; prompt + max_tokens over the context, bad types or values, lone
surrogates, JSON nested too deep and bodies over --max-body-bytes are 400; a POST that is not
`Content-Type: application/json` is 415; a wrong or missing API key is 401 (when --api-key is set;
/health, /ready and /metrics stay open for probes and scrapers); a request that runs longer than
--request-timeout is aborted (408, or an error event on a stream). A client that disconnects, or
does not read for --write-timeout, aborts its request, which frees its KV blocks before the
engine's next step. Slow clients: --header-timeout, --body-timeout and --max-connections (see
`_GuardedHandler`). Prefix-cache isolation: `cache_salt` and --cache-salt-header. CORS: off unless
--cors-origin.

Lifecycle: the socket is bound first (so /health answers during loading), then the artifact is
verified (sha256 of every file), loaded and warmed up on a worker thread, and /ready turns 200.
SIGTERM (or SIGINT) stops admitting (/ready 503, new connections refused), lets in-flight requests
finish for up to --shutdown-grace seconds (then ends them: streams get an error event and [DONE],
others a 503), stops the engine and exits 0. If the engine thread dies, requests in flight get an
error and the process exits 1 (its supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import hashlib
import hmac
import json
import logging
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from runtime.artifact import Artifact, ArtifactError, quality_line, read_manifest, sha256_file
from runtime.async_engine import (
    AsyncEngine,
    EngineDeadError,
    GenerateRequest,
    QueueFull,
    RequestStream,
    warm_up,
)
from runtime.engine import RequestOutput, TokenLogprob
from runtime.kv_events import KVEventPublisher, parse_endpoint
from runtime.metrics import CONTENT_TYPE, ServingMetrics
from runtime.sampling import SamplingParams
from runtime.speculative import SpeculativeConfig
from runtime.structured import StructuredOutput, StructuredOutputError

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "HEALTH_PATH",
    "METRICS_PATH",
    "READY_PATH",
    "APIError",
    "ErrorKind",
    "Server",
    "ServerConfig",
    "serve",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_GRACE = 30.0  # seconds in-flight requests get after SIGTERM
HEALTH_PATH = "/health"
READY_PATH = "/ready"
METRICS_PATH = "/metrics"
MAX_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one completions request
MAX_N = 16  # choices per prompt
MAX_STOP = 16  # default --max-stop-strings
MAX_STOP_CHARS = 256  # default --max-stop-chars (each stop string)


@dataclass
class ServerConfig:
    artifact: Path
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: any free port (the bound one is printed)
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <key>`
    served_model_name: str | None = None  # default: the artifact's name
    max_waiting: int = 256  # accepted requests not yet running; one more gets 429
    request_timeout: float = 600.0  # seconds from receipt to the last token
    max_body_bytes: int = 1 << 20
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    # Engine limits (None: the artifact's runtime.json).
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    threads: int | None = None  # ONNX Runtime intra-op threads
    device: str | None = None  # None: the artifact's target device
    cuda_graphs: str | None = None  # auto | padded | off (GPU backends); None: auto
    warmup: bool = True
    retune: bool = False  # re-measure the C ops' CPU code path at load (runtime/cpu_check.py)
    # Slow and hostile clients.
    header_timeout: float = 10.0  # seconds from connection (or the previous response) to a request's full headers
    body_timeout: float = 30.0  # seconds from the headers to the end of the body
    write_timeout: float = 30.0  # seconds one write to the client may block (a client not reading)
    max_connections: int = 512  # open connections; one more is answered 503 and closed
    max_requests_per_client: int = 0  # unfinished requests per client address (0: no bound)
    max_stop_strings: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    tokenizer_threads: int = 2  # worker threads that tokenize and render chat templates
    # Prefix-cache isolation: requests share cached prompt blocks only with the same salt, made of this
    # header's value (e.g. `Authorization` to salt by API key, or a tenant header set by the gateway)
    # and the request's `cache_salt` field. None: one shared cache (one trust domain).
    cache_salt_header: str | None = None
    cors_origins: tuple[str, ...] = ()  # origins allowed cross-site (CORS); empty: no CORS headers
    # Speculative decoding for requests that do not say (their `speculative` field): None: off, else the
    # default config ("ngram", "ngram:k=4,n=3,min=1", "draft:k=4": runtime/speculative.py).
    speculative: str | None = None
    # The draft model of method "draft" (runtime/draft.py). None: the one the artifact's manifest pairs,
    # loaded when `speculative` is a "draft" config; a folder: that artifact, loaded in any case.
    draft_artifact: Path | None = None
    # KV-cache events (runtime/kv_events.py): tcp://HOST:PORT binds the PUB socket there and the replay
    # socket on PORT + 1. None: off. Token ids travel on it: an internal address only.
    kv_events: str | None = None

    def validate(self) -> None:
        if self.max_waiting < 1:  # every request waits at least until the engine's next step
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        for name in ("max_connections", "max_stop_strings", "max_stop_chars", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_requests_per_client < 0:
            raise ValueError(f"max_requests_per_client must be >= 0, got {self.max_requests_per_client}")
        for name in ("request_timeout", "shutdown_grace", "header_timeout", "body_timeout", "write_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.speculative is not None:
            SpeculativeConfig.parse(self.speculative)
        if self.kv_events is not None:
            parse_endpoint(self.kv_events)


# --------------------------------------------------------------------------------------------
# Errors: one table from kind to HTTP status and OpenAI error type
# --------------------------------------------------------------------------------------------


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    TIMEOUT = "timeout"
    QUEUE_FULL = "queue_full"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


_ERRORS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.AUTHENTICATION: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: (415, "invalid_request_error"),
    ErrorKind.TIMEOUT: (408, "timeout_error"),
    ErrorKind.QUEUE_FULL: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}


class APIError(Exception):
    """A request refused or failed; `error_body()` is what the client sees."""

    def __init__(self, kind: ErrorKind, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def status(self) -> int:
        return _ERRORS[self.kind][0]

    def error_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERRORS[self.kind][1], "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.json_response(self.error_body(), status=self.status, headers=headers, dumps=_dumps)


def _invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(ErrorKind.INVALID_REQUEST, message, param=param, code=code)


def _speculative(body: dict[str, Any]) -> SpeculativeConfig | bool | None:
    """The request's `speculative` field: absent or null (the server's default), true / false (on with the
    server's config, else n-gram with k=4 / off), or an object {"method": "ngram", "num_tokens": k,
    "ngram_max": n, "ngram_min": m}."""
    value = body.get("speculative")
    if value is None or isinstance(value, bool):
        return value
    try:
        return SpeculativeConfig.from_dict(value)
    except (TypeError, ValueError) as exc:
        raise _invalid(f"speculative: {exc}" if not str(exc).startswith("speculative") else str(exc),
                       "speculative") from None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------------------------
# Request fields
# --------------------------------------------------------------------------------------------

_MISSING = object()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict[str, Any], name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not _is_int(v):
        raise _invalid(f"{name} must be an integer, got {_show(v)}", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _invalid(f"{name} must be {_range(lo, hi)}, got {v}", name)
    return v


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float | None = None,
            lo_open: bool = False) -> float:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise _invalid(f"{name} must be a number, got {_show(v)}", name, "invalid_type")
    bad = v <= lo if lo_open else v < lo
    if not math.isfinite(v) or bad or (hi is not None and v > hi):
        low = f"> {lo}" if lo_open else f">= {lo}"
        raise _invalid(f"{name} must be {low}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}", name)
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise _invalid(f"{name} must be a boolean, got {_show(v)}", name, "invalid_type")
    return v


def _show(v: object) -> str:
    text = json.dumps(v) if isinstance(v, str | int | float | bool | type(None)) else type(v).__name__
    return text if len(text) <= 40 else text[:39] + "…"


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def _stop(body: dict[str, Any], max_count: int = MAX_STOP, max_chars: int = MAX_STOP_CHARS) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _invalid("stop must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > max_count or any(not s for s in v):
        raise _invalid(f"stop: at most {max_count} non-empty strings", "stop")
    if any(len(s) > max_chars for s in v):
        raise _invalid(f"stop: each string at most {max_chars} characters", "stop")
    return list(v)


def _text(value: str, param: str) -> str:
    """`value`, refused (400) when it cannot be UTF-8 (a lone surrogate such as "\\ud800" in the JSON)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _invalid(f"{param} is not valid Unicode text (a lone surrogate at character {exc.start})",
                       param) from None
    return value


def _refuse_unsupported(body: dict[str, Any], supported: tuple[str, ...] = ()) -> None:
    """400 for a field this server does not implement, unless its value is neutral (or it is `supported`
    by the endpoint, which then validates it itself)."""
    neutral: dict[str, Callable[[Any], bool]] = {
        "logit_bias": lambda v: not v,
        "best_of": lambda v: v in (None, 1),
        "suffix": lambda v: v in (None, ""),
        "tools": lambda v: not v,
        "functions": lambda v: not v,
        "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") in (None, "text")),
    }
    for name, ok in neutral.items():
        if name in body and name not in supported and not ok(body[name]):
            raise _invalid(f"{name} is not supported by this server", name, "unsupported_parameter")


_VLLM_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    """One constraint from a request field; 400 naming `param` when its shape is wrong."""
    try:
        if kind == "json":
            if not isinstance(value, dict | str):
                raise StructuredOutputError("a JSON schema must be a JSON object (or its JSON text)")
            return StructuredOutput.json_schema(value)
        if kind == "choice":
            return StructuredOutput.choice(value)
        if kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"the {kind} must be a non-empty string")
            _text(value, param)
        spec = StructuredOutput(kind, value if isinstance(value, str) else "")
        spec.validate()
        return spec
    except StructuredOutputError as exc:
        raise _invalid(f"{param}: {exc}", param) from None


def _structured(body: dict[str, Any]) -> tuple[StructuredOutput, str] | None:
    """The request's output constraint and the field it came from: OpenAI's response_format
    (json_object, json_schema), vLLM's guided_json / guided_regex / guided_choice / guided_grammar, or
    vLLM's structured_outputs {json, regex, choice, grammar, json_object}; at most one of them."""
    found: list[tuple[StructuredOutput, str]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise _invalid("response_format must be an object", "response_format", "invalid_type")
        kind = rf.get("type")
        if kind == "json_object":
            found.append((StructuredOutput("json_object"), "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise _invalid("response_format json_schema needs json_schema.schema, a JSON schema object",
                               "response_format")
            found.append((_constraint("json", schema, "response_format"), "response_format"))
        elif kind not in (None, "text"):
            raise _invalid(f"response_format type {_show(kind)} is not supported (have: text, json_object, "
                           "json_schema)", "response_format", "unsupported_parameter")
    for name, kind in _VLLM_GUIDED.items():
        if body.get(name) is not None:
            found.append((_constraint(kind, body[name], name), name))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _invalid("structured_outputs must be an object", "structured_outputs", "invalid_type")
        for key in ("json", "regex", "choice", "grammar"):
            if so.get(key) is not None:
                found.append((_constraint(key, so[key], f"structured_outputs.{key}"), "structured_outputs"))
        if so.get("json_object"):
            found.append((StructuredOutput("json_object"), "structured_outputs"))
        if so.get("structural_tag"):
            raise _invalid("structured_outputs.structural_tag is not supported", "structured_outputs",
                           "unsupported_parameter")
    if len(found) > 1:
        raise _invalid("give at most one output constraint (response_format json_object/json_schema, guided_json, "
                       f"guided_regex, guided_choice, guided_grammar, structured_outputs); got {len(found)}",
                       found[1][1])
    return found[0] if found else None


# Sampling fields passed on when this runtime's SamplingParams has them: (neutral, min, max).
_OPTIONAL_SAMPLING: dict[str, tuple[float, float, float | None]] = {
    "presence_penalty": (0.0, -2.0, 2.0),
    "frequency_penalty": (0.0, -2.0, 2.0),
    "repetition_penalty": (1.0, 0.0, None),
    "min_p": (0.0, 0.0, 1.0),
}
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass
class _Parsed:
    """A validated request, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: off; N: top-N alternatives per token
    echo_text: str | None  # completions with echo: the prompt text to prepend
    prompt_logprobs: int | None = None  # N: score the prompt (echo + logprobs, or vLLM's prompt_logprobs)
    echo_logprobs: bool = False  # echo + logprobs: the prompt's tokens lead the logprobs object
    vllm_prompt_logprobs: bool = False  # prompt_logprobs: the choice's `prompt_logprobs` list (vLLM's shape)
    score_only: bool = False  # max_tokens 0 with echo: the engine generates one token, which is not returned
    n: int = 1  # choices per prompt
    best_of: int = 1  # samples per prompt (n, or completions' best_of), of which the n most likely are returned
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    more: list[tuple[list[int], str | None]] = dataclasses.field(default_factory=list)  # prompts 2.. (ids, echo)

    def __post_init__(self) -> None:
        self.best_of = max(self.best_of, self.n)  # n samples at least

    @property
    def num_choices(self) -> int:
        return (1 + len(self.more)) * self.n

    @property
    def ranked(self) -> bool:
        """best_of > n: each prompt's samples are ranked by cumulative logprob and the n best returned."""
        return self.best_of > self.n


# --------------------------------------------------------------------------------------------
# Tokenizer and chat template
# --------------------------------------------------------------------------------------------


class TextCodec:
    """The artifact's tokenizer on the HTTP side (encode, decode, one token's text for logprobs)."""

    def __init__(self, folder: Path) -> None:
        from runtime.tokenizer import load_tokenizer

        self._tok = load_tokenizer(folder)
        self.vocab_size = self._tok.get_vocab_size()
        self._pieces: dict[int, str] = {}
        # The longest token in characters: a text of more than max_model_len * this many characters
        # cannot fit the context, so it is refused before it is tokenized.
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_piece_chars = max(1, max((len(t) for t in vocab), default=1))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): the event loop runs while a worker tokenizes.
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        p = self._pieces.get(token_id)
        if p is None:
            p = self._pieces[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return p


def _special(config: dict[str, Any], name: str) -> str:
    v = config.get(name)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


class ChatTemplate:
    """Messages -> prompt text: the tokenizer's Jinja `chat_template`, or the documented fallback."""

    def __init__(self, tokenizer_config: dict[str, Any]) -> None:
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        self.source: str | None = source if isinstance(source, str) and source.strip() else None
        self.bos_token = _special(tokenizer_config, "bos_token")
        self.eos_token = _special(tokenizer_config, "eos_token")
        self._template: Any = None
        if self.source is not None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
            self._template = env.from_string(self.source)

    def render(self, messages: list[dict[str, str]]) -> tuple[str, bool]:
        """(prompt text, whether the tokenizer should add its special tokens such as BOS)."""
        if self._template is None:
            parts = [f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages]
            return "".join(parts) + "### Assistant:\n", True
        from jinja2.exceptions import TemplateError

        try:
            text = self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise _invalid(f"the chat template refused these messages: {exc}", "messages") from exc
        return text, False  # templates write their own special tokens


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _invalid("messages must be a non-empty list", "messages",
                       "missing_field" if msgs is None else "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise _invalid(f"{where}.role must be one of {', '.join(_ROLES)}, got {_show(role)}", f"{where}.role")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _invalid(f"{where}.content: only parts of type 'text' are supported", f"{where}.content")
                texts.append(part["text"])
            content = _text("".join(texts), f"{where}.content")
        elif isinstance(content, str):
            content = _text(content, f"{where}.content")
        else:
            raise _invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content",
                           "invalid_type")
        out.append({"role": role, "content": content})
    return out


# --------------------------------------------------------------------------------------------
# Connections: a cap, and a deadline for each request's headers
# --------------------------------------------------------------------------------------------

_OVER_CAPACITY_BODY = json.dumps({"error": {"message": "too many open connections; retry later",
                                              "type": "service_unavailable_error", "param": None,
                                              "code": "too_many_connections"}}).encode()
_OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(_OVER_CAPACITY_BODY)).encode() + b"\r\n\r\n"
                  + _OVER_CAPACITY_BODY)


class _Connections:
    """Counts open connections against the cap and records the ones the server drops."""

    def __init__(self, limit: int, header_timeout: float, metrics: ServingMetrics) -> None:
        self.limit = limit
        self.header_timeout = header_timeout
        self.metrics = metrics
        self.open = 0

    def enter(self) -> bool:
        if self.open >= self.limit:
            self.metrics.drop("too_many_connections")
            return False
        self.open += 1
        self.metrics.set_open_connections(self.open)
        return True

    def leave(self) -> None:
        self.open -= 1
        self.metrics.set_open_connections(self.open)


class _GuardedHandler(RequestHandler):
    """aiohttp's HTTP/1 protocol, plus: a connection over the cap is answered 503 and closed, and a
    connection whose next request's headers are not complete `header_timeout` seconds after it opened
    (or after its previous response) is closed (slow-header clients, idle keep-alive connections)."""

    def __init__(self, manager: web.Server, guard: _Connections, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._guard.enter():
            assert isinstance(transport, asyncio.Transport)
            transport.write(_OVER_CAPACITY)
            self.force_close()  # closes the transport once the answer is flushed
            return
        self._counted = True
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self._guard.leave()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self._loop.call_later(self._guard.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _busy(self) -> bool:
        """A request is being handled or a parsed one is queued (aiohttp's own state)."""
        return bool(getattr(self, "_request_in_progress", False) or getattr(self, "_messages", None))

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._busy() or self.transport is None:
            return
        self._guard.metrics.drop("header_timeout")
        self.force_close()
        self.transport.abort()

    async def _handle_request(self, request: Any, start_time: Any, request_handler: Any) -> Any:
        self._disarm()
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            if self._counted and not getattr(self, "_messages", None) and self.transport is not None:
                self._arm()  # the next request's headers get header_timeout from now


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_Jobs = list[tuple[GenerateRequest, "_Format"]]  # a request's engine requests, one per sample, with their formats


class ServerShuttingDown(RuntimeError):
    """The drain's grace ran out while this request was still running."""


class _SlowClient(Exception):
    """A write to the client blocked longer than write_timeout (the client is not reading)."""


class Server:
    """One artifact behind the OpenAI API: `await start()` binds, `await load()` makes it ready,
    `begin_drain()` then `await shutdown()` stop it (the sequence `serve()` runs)."""

    def __init__(self, config: ServerConfig) -> None:
        config.validate()
        self.config = config
        manifest = read_manifest(config.artifact)  # fail fast on a missing or foreign artifact
        self.artifact_name = str(manifest["name"])
        self.artifact_version = str(manifest["version"])
        self.manifest_sha256 = sha256_file(Path(config.artifact) / "manifest.json")
        quality = manifest.get("quality")
        # the build's quality gate in one line; a warning when it was not evaluated on the build machine
        level = logging.WARNING if isinstance(quality, dict) and quality.get("evaluated") is False \
            and quality.get("bounds") != {} else logging.INFO
        log.log(level, "quality: %s", quality_line(quality))
        self.model_id = config.served_model_name or self.artifact_name
        self.metrics = ServingMetrics(self.artifact_name, self.artifact_version, self.manifest_sha256)
        self.state = "loading"  # loading -> ready -> draining | failed
        self.exit_code = 0  # what serve() returns: 1 when the engine thread died
        self.engine: AsyncEngine | None = None
        self.kv_publisher: KVEventPublisher | None = None  # with --kv-events
        self.codec: TextCodec | None = None
        self.chat: ChatTemplate | None = None
        self.tokenizer_config: dict[str, Any] = {}
        self.max_model_len = 0
        self.max_prompt_chars = 0  # longer prompt texts cannot fit the context (refused untokenized)
        self.block_size = 1
        self.num_blocks = 0
        self.created = int(time.time())
        self.stopped = asyncio.Event()
        self.app = self._build_app()
        self.runner: web.AppRunner | None = None
        self.bound: tuple[str, int] | None = None
        self.connections = _Connections(config.max_connections, config.header_timeout, self.metrics)
        self._listener: asyncio.Server | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Bind the socket (health answers from here on); returns (host, port)."""
        self.runner = web.AppRunner(self.app, handle_signals=False, handler_cancellation=True,
                                    shutdown_timeout=1.0, access_log=None)
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        manager = self.runner.server
        assert manager is not None

        def protocol() -> _GuardedHandler:
            return _GuardedHandler(manager, self.connections, loop=loop, access_log=None,
                                   keepalive_timeout=self.config.header_timeout + 5.0)  # ours fires first

        self._listener = await loop.create_server(protocol, self.config.host, self.config.port, backlog=1024)
        sockets = self._listener.sockets
        self.bound = tuple(sockets[0].getsockname()[:2]) if sockets else (self.config.host, self.config.port)  # type: ignore[assignment]
        return self.bound  # type: ignore[return-value]

    def _load(self) -> tuple[Any, float]:
        """Worker thread: verify, load and warm up. Returns (LLMEngine, warm-up seconds)."""
        from runtime.engine import LLMEngine

        c = self.config
        artifact = Artifact.open(c.artifact, verify=True)
        engine = LLMEngine(artifact, num_blocks=c.num_kv_blocks, max_num_seqs=c.max_num_seqs,
                           max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len,
                           threads=c.threads, device=c.device, graphs=c.cuda_graphs,
                           speculative=SpeculativeConfig.parse(c.speculative) if c.speculative else None,
                           draft=c.draft_artifact, retune=c.retune)
        self.codec = TextCodec(artifact.tokenizer_dir)
        self.chat = ChatTemplate(engine.tokenizer.config)
        self.tokenizer_config = dict(engine.tokenizer.config)
        if c.kv_events:
            engine.scheduler.enable_kv_events()  # its log opens with AllBlocksCleared: routers forget this worker
            self.kv_publisher = KVEventPublisher(c.kv_events, engine.scheduler_config.block_size)
            log.info("KV-cache events: PUB %s, replay %s", self.kv_publisher.pub_endpoint,
                     self.kv_publisher.replay_endpoint)
        return engine, warm_up(engine) if c.warmup else 0.0

    async def load(self) -> str:
        """Verify, load and warm up the artifact off the event loop, start the engine thread; a summary line."""
        t = time.perf_counter()
        engine, warm = await asyncio.to_thread(self._load)
        self.max_model_len = engine.scheduler_config.max_model_len
        assert self.codec is not None
        self.max_prompt_chars = self.max_model_len * self.codec.max_piece_chars
        self.block_size = engine.scheduler_config.block_size
        self.num_blocks = engine.scheduler_config.num_blocks
        sc = engine.scheduler_config
        self.metrics.set_cache_config(sc.block_size, sc.num_blocks, sc.enable_prefix_caching)
        self.engine = AsyncEngine(engine, self.metrics, max_waiting=self.config.max_waiting,
                                  max_per_client=self.config.max_requests_per_client, on_death=self._engine_died)
        if self.kv_publisher is not None:
            self.engine.kv_sink = self.kv_publisher.put
        self.engine.start(asyncio.get_running_loop())
        if self.state == "loading":
            self.state = "ready"
        return (f"ready: verified, loaded and warmed up in {time.perf_counter() - t:.1f} s (warm-up {warm:.2f} s); "
                f"context {sc.max_model_len}, {sc.num_blocks} KV blocks of {sc.block_size}, "
                f"{sc.max_num_seqs} running / {self.config.max_waiting} waiting at most")

    def _engine_died(self, exc: BaseException) -> None:
        """The engine thread stopped on an error: in-flight requests already got an error; exit non-zero
        (a supervisor restarts the process) instead of answering 503 forever."""
        log.error("the engine thread died (%s: %s); the server exits with status 1", type(exc).__name__, exc)
        self.exit_code = 1
        self.state = "failed"
        self.stopped.set()

    def begin_drain(self) -> None:
        """Stop admitting; `run_until_stopped` then drains and returns."""
        if self.state not in ("draining", "failed"):
            log.info("draining: no new requests; in-flight ones get %.0f s", self.config.shutdown_grace)
            self.state = "draining"
        self.stopped.set()

    async def shutdown(self) -> None:
        """Stop listening, let in-flight requests finish within the grace, then end the rest: streams get
        an error event and [DONE], other requests a 503; close the connections and stop the engine."""
        loop = asyncio.get_running_loop()
        end = loop.time() + (self.config.shutdown_grace if self.state != "failed" else 0.0)
        if self._listener is not None:
            self._listener.close()
        if self.engine is not None:
            while self.engine.num_in_flight and loop.time() < end:
                await asyncio.sleep(0.05)
            if self.engine.num_in_flight:
                log.warning("shutdown grace over: ending %d requests still in flight", self.engine.num_in_flight)
                self.engine.fail_all(ServerShuttingDown("the server is shutting down (the drain's grace is over)"))
            # their handlers write the error and [DONE]; a client that does not read is cut after 1 s
            stop = loop.time() + 1.0
            while self.engine.num_in_flight and loop.time() < stop:
                await asyncio.sleep(0.02)
        if self.runner is not None:
            await self.runner.cleanup()  # close idle connections; cancels a handler still there after 1 s
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.kv_publisher is not None:
            await asyncio.to_thread(self.kv_publisher.close)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the app ------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors_middleware, self._cors_middleware, self._auth_middleware])
        app.router.add_get(HEALTH_PATH, self.health)
        app.router.add_get(READY_PATH, self.ready)
        app.router.add_get(METRICS_PATH, self.metrics_endpoint)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        for prefix in ("", "/v1"):  # vLLM serves these at the root; clients also try them under /v1
            app.router.add_post(f"{prefix}/tokenize", self.tokenize)
            app.router.add_post(f"{prefix}/detokenize", self.detokenize)
            app.router.add_get(f"{prefix}/tokenizer_info", self.tokenizer_info)
        if self.config.cors_origins:
            app.router.add_route("OPTIONS", "/v1/{tail:.*}", self.preflight)
        return app

    def _log_refused(self, request: web.Request, err: APIError) -> None:
        """One line per refused request, no traceback: WARNING for bad input, INFO for capacity (429/503,
        which come in bursts and are counted in /metrics)."""
        level = logging.INFO if err.kind in (ErrorKind.QUEUE_FULL, ErrorKind.UNAVAILABLE) else logging.WARNING
        log.log(level, "%s %s from %s -> %d %s: %s", request.method, request.path, request.remote, err.status,
                err.code or err.kind.value, err.message)

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as err:
            if err.kind not in (ErrorKind.TIMEOUT, ErrorKind.INTERNAL):
                self.metrics.reject(err.kind.value)
            self._log_refused(request, err)
            resp = err.response()
            if err.code == "body_timeout":
                resp.force_close()
            return resp
        except web.HTTPException as exc:  # routing: unknown path, wrong method
            if exc.status == 404:
                err = APIError(ErrorKind.NOT_FOUND, f"no route {request.method} {request.path}", code="not_found")
            elif exc.status == 405:
                err = APIError(ErrorKind.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.path}",
                               code="method_not_allowed")
            elif exc.status == 413:
                err = _invalid(f"request body over {self.config.max_body_bytes} bytes", None, "request_too_large")
            else:
                raise
            self.metrics.reject(err.kind.value)
            self._log_refused(request, err)
            return err.response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("error handling %s %s", request.method, request.path)
            return APIError(ErrorKind.INTERNAL, "internal server error", code="internal_error").response()

    def _cors_origin(self, request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        allowed = self.config.cors_origins
        return origin if origin and ("*" in allowed or origin in allowed) else None

    @web.middleware
    async def _cors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Off unless --cors-origin is set: then allowed origins get Access-Control-Allow-Origin."""
        if not self.config.cors_origins:
            return await handler(request)
        origin = self._cors_origin(request)
        if origin is not None:
            request["cors_origin"] = origin
        resp = await handler(request)
        if not resp.prepared:
            _allow_origin(request, resp)
        return resp

    async def preflight(self, request: web.Request) -> web.Response:
        origin = self._cors_origin(request)
        if origin is None:
            raise APIError(ErrorKind.AUTHENTICATION, "this origin is not allowed (CORS)", code="cors_origin")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Max-Age": "600",
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": "Authorization, Content-Type"})

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.config.api_key
        if key and request.path.startswith("/v1/") and request.method != "OPTIONS":
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth.startswith("Bearer ") else ""
            if not given or not hmac.compare_digest(given.encode(), key.encode()):
                raise APIError(ErrorKind.AUTHENTICATION,
                               "missing or wrong API key (send `Authorization: Bearer <key>`)",
                               code="invalid_api_key")
        return await handler(request)

    # ---- probes and metrics -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.state == "failed" or (self.engine is not None and not self.engine.alive and self.state != "draining"):
            return web.json_response({"status": "unhealthy", "error": str(self.engine.error if self.engine else "")},
                                     status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        ok = self.state == "ready" and self.engine is not None and self.engine.alive
        return web.json_response({"status": self.state if not ok else "ready", "model": self.model_id},
                                 status=200 if ok else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render().encode("utf-8"), headers={"Content-Type": CONTENT_TYPE})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "optimize",
                "root": self.artifact_name, "max_model_len": self.max_model_len or None,
                "artifact": {"name": self.artifact_name, "version": self.artifact_version,
                             "manifest_sha256": self.manifest_sha256}}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]}, dumps=_dumps)

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_id:
            raise APIError(ErrorKind.NOT_FOUND, f"model {request.match_info['model']!r} is not served here "
                           f"(serving {self.model_id!r})", param="model", code="model_not_found")
        return web.json_response(self._model_card(), dumps=_dumps)

    # ---- the tokenizer (vLLM's /tokenize, /detokenize, /tokenizer_info) -------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        """{"prompt": text} or {"messages": [...]} (rendered with the chat template, add_generation_prompt)
        -> {"count", "max_model_len", "tokens"[, "token_strs"]}. `add_special_tokens` (default: true for a
        prompt, the template's own choice for messages) says whether the tokenizer adds BOS and the like,
        exactly as the completion endpoints do for the same text."""
        _engine, codec = self._admitting()
        body = await self._body(request)
        if "messages" in body:
            messages = _messages(body)
            if self.chat is None:  # pragma: no cover - set together with the codec
                raise APIError(ErrorKind.UNAVAILABLE, "the model is loading", code="not_ready", retry_after=1)
            self._fits(sum(len(m["content"]) for m in messages), "messages")
            loop = asyncio.get_running_loop()
            text, add_special = await loop.run_in_executor(self._pool, self.chat.render, messages)
        else:
            text = body.get("prompt", _MISSING)
            if text is _MISSING:
                raise _invalid("prompt (a string) or messages is required", "prompt", "missing_field")
            _text(text, "prompt")
            self._fits(len(text), "prompt")
            add_special = True
        if "add_special_tokens" in body:
            add_special = _bool(body, "add_special_tokens", True)
        ids = await self._encode(codec, text, add_special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if _bool(body, "return_token_strs", False):
            out["token_strs"] = [codec.piece(t) for t in ids]
        return web.json_response(out, dumps=_dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        """{"tokens": [ids]} -> {"prompt": text} (special tokens kept, as the completion endpoints decode)."""
        _engine, codec = self._admitting()
        body = await self._body(request)
        tokens = body.get("tokens", _MISSING)
        if tokens is _MISSING:
            raise _invalid("tokens (a list of token ids) is required", "tokens", "missing_field")
        if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < codec.vocab_size for t in tokens):
            raise _invalid(f"tokens must be a list of token ids in [0, {codec.vocab_size})", "tokens")
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self._pool, codec.decode, list(tokens))
        return web.json_response({"prompt": text}, dumps=_dumps)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """The artifact's tokenizer_config.json (special tokens, chat template, tokenizer class) plus the
        served context and vocabulary size."""
        _engine, codec = self._admitting()
        config = dict(self.tokenizer_config)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # as strings (an AddedToken dict there)
            if name in config:
                config[name] = _special(config, name) or None
        config.setdefault("model_max_length", self.max_model_len)
        return web.json_response({**config, "max_model_len": self.max_model_len, "vocab_size": codec.vocab_size},
                                 dumps=_dumps)

    # ---- request parsing ----------------------------------------------------------------------

    def _admitting(self) -> tuple[AsyncEngine, TextCodec]:
        if self.state == "draining":
            raise APIError(ErrorKind.UNAVAILABLE, "the server is shutting down", code="shutting_down", retry_after=1)
        if self.state != "ready" or self.engine is None or self.codec is None:
            raise APIError(ErrorKind.UNAVAILABLE, "the model is loading", code="not_ready", retry_after=1)
        if not self.engine.alive:
            raise APIError(ErrorKind.UNAVAILABLE, f"the engine stopped: {self.engine.error}", code="engine_dead")
        return self.engine, self.codec

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if request.content_type != "application/json":  # a browser cannot send this cross-site unasked
            raise APIError(ErrorKind.UNSUPPORTED_MEDIA_TYPE,
                           f"Content-Type must be application/json, got {_show(request.content_type)}",
                           code="unsupported_media_type")
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _invalid(f"request body of {request.content_length} bytes is over the limit of {limit}",
                           None, "request_too_large")
        try:
            async with asyncio.timeout(self.config.body_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _invalid(f"request body over the limit of {limit} bytes", None, "request_too_large") from None
        except TimeoutError:
            self.metrics.drop("body_timeout")
            raise APIError(ErrorKind.TIMEOUT, f"the request body did not arrive within {self.config.body_timeout:g} s",
                           code="body_timeout") from None
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except RecursionError:
            raise _invalid("the body is not valid JSON: nested too deeply", None, "invalid_json") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise _invalid(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _invalid("the body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise APIError(ErrorKind.NOT_FOUND, f"model {model!r} is not served here (serving {self.model_id!r})",
                           param="model", code="model_not_found")
        return body

    def _sampling(self, body: dict[str, Any], prompt_len: int, max_tokens: int | None, vocab: int,
                  prompt_param: str) -> SamplingParams:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise _invalid(f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens "
                           "(prompt + output)", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise _invalid(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                           f"is over this model's context of {limit} tokens", "max_tokens", "context_length_exceeded")
        blocks = -(-(prompt_len + max_tokens) // self.block_size)
        if blocks > self.num_blocks:  # one sequence alone would outgrow the KV pool
            raise _invalid(f"prompt + max_tokens = {prompt_len + max_tokens} tokens need {blocks} KV blocks of "
                           f"{self.block_size}; this server's pool has {self.num_blocks}", "max_tokens",
                           "context_length_exceeded")
        top_k = _int(body, "top_k", 0, lo=-1)
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < vocab for t in ids):
            raise _invalid(f"stop_token_ids must be a list of token ids in [0, {vocab})", "stop_token_ids")
        extra: dict[str, float] = {}
        for name, (neutral, lo, hi) in _OPTIONAL_SAMPLING.items():
            value = _number(body, name, neutral, lo=lo, hi=hi)
            if value == neutral:
                continue
            if name not in _SAMPLING_FIELDS:
                raise _invalid(f"{name} is not supported by this runtime", name, "unsupported_parameter")
            extra[name] = value
        constraint = _structured(body)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, lo=0.0),
            top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
            top_k=0 if top_k == -1 else top_k,
            seed=_int(body, "seed", None, lo=0, hi=2**63 - 1),
            stop=_stop(body, self.config.max_stop_strings, self.config.max_stop_chars),
            stop_token_ids=list(ids),
            ignore_eos=_bool(body, "ignore_eos", False),
            structured=constraint[0] if constraint else None,
            **extra,
        )
        try:
            params.validate()
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise _invalid(str(exc), name if name in _SAMPLING_FIELDS else None) from None
        return params

    @staticmethod
    def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        stream = _bool(body, "stream", False)
        opts = body.get("stream_options")
        if opts is None:
            return stream, False
        if not isinstance(opts, dict):
            raise _invalid("stream_options must be an object", "stream_options", "invalid_type")
        if not stream:
            raise _invalid("stream_options is only allowed with stream=true", "stream_options")
        return stream, _bool(opts, "include_usage", False)

    @staticmethod
    def _continuous_usage(body: dict[str, Any]) -> bool:
        """stream_options.continuous_usage_stats (vLLM): every chunk carries the usage so far."""
        opts = body.get("stream_options")
        return isinstance(opts, dict) and _bool(opts, "continuous_usage_stats", False)

    def _fits(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it (cheap, on the event loop)."""
        if chars > self.max_prompt_chars:
            raise _invalid(f"the prompt has {chars} characters; this model's context is {self.max_model_len} tokens "
                           f"(at most {self.max_prompt_chars} characters)", param, "context_length_exceeded")

    async def _encode(self, codec: TextCodec, text: str, add_special: bool = True) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, codec.encode, text, add_special)

    async def _parse_completion(self, body: dict[str, Any], codec: TextCodec) -> _Parsed:
        _refuse_unsupported(body, supported=("best_of", "response_format"))
        prompt = body.get("prompt", _MISSING)
        if prompt is _MISSING or prompt is None:
            raise _invalid("prompt is required", "prompt", "missing_field")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt given as a batch of one
        add_special = _bool(body, "add_special_tokens", True)  # BOS and the like on string prompts (vLLM's default)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, str | list) for t in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise _invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
            batch = [await self._one_prompt(item, codec, add_special) for item in prompt]
        else:
            batch = [await self._one_prompt(prompt, codec, add_special)]
        ids = batch[0]
        stream, include_usage = self._stream_flags(body)
        n = _int(body, "n", 1, lo=1, hi=MAX_N)
        best_of = _int(body, "best_of", n, lo=1, hi=MAX_N)
        if best_of < n:
            raise _invalid(f"best_of ({best_of}) must be >= n ({n})", "best_of")
        if best_of > n and stream:
            raise _invalid("best_of > n is not streamed (the best are known at the end); send the request with "
                           "stream=false", "stream", "unsupported_value")
        logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
        echo = _bool(body, "echo", False)
        vllm_prompt = _int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        echo_logprobs = echo and logprobs is not None
        scored = [k for k in (logprobs if echo_logprobs else None, vllm_prompt) if k is not None]
        if scored and stream:
            raise _invalid("prompt logprobs (echo with logprobs, or prompt_logprobs) are not streamed; "
                           "send the request with stream=false", "stream", "unsupported_value")
        max_tokens = _int(body, "max_tokens", 16, lo=0)
        score_only = max_tokens == 0
        if score_only and (not echo or stream):
            raise _invalid("max_tokens 0 is only allowed with echo=true (the prompt alone) and stream=false",
                           "max_tokens")
        params = self._sampling(body, max(len(b) for b in batch), max(max_tokens, 1), codec.vocab_size, "prompt")
        texts = [(item if isinstance(item, str) else codec.decode(b)) if echo else None
                 for item, b in zip(prompt if len(batch) > 1 else [prompt], batch, strict=True)]
        return _Parsed(ids, params, stream, include_usage, logprobs, texts[0], max(scored) if scored else None,
                       echo_logprobs, vllm_prompt is not None, score_only, n, best_of, self._continuous_usage(body),
                       list(zip(batch[1:], texts[1:], strict=True)))

    async def _one_prompt(self, prompt: Any, codec: TextCodec, add_special: bool = True) -> list[int]:
        """The token ids of one prompt: a string (tokenized, with special tokens unless add_special is false)
        or a list of token ids (taken as they are)."""
        if isinstance(prompt, str):
            _text(prompt, "prompt")
            self._fits(len(prompt), "prompt")
            ids = await self._encode(codec, prompt, add_special)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            if not all(0 <= t < codec.vocab_size for t in prompt):
                raise _invalid(f"prompt token ids must be in [0, {codec.vocab_size})", "prompt")
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int | float) and not isinstance(t, bool)
                                                         for t in prompt):
            bad = next(i for i, t in enumerate(prompt) if not _is_int(t))
            raise _invalid(f"prompt token ids must be integers, got {_show(prompt[bad])} at prompt[{bad}]", "prompt",
                           "invalid_type")
        else:
            raise _invalid("prompt must be a string, a list of token ids, or a list of those",
                           "prompt", "invalid_type")
        if not ids:
            raise _invalid("the prompt is empty", "prompt")
        return ids

    async def _parse_chat(self, body: dict[str, Any], codec: TextCodec) -> _Parsed:
        _refuse_unsupported(body, supported=("response_format",))
        messages = _messages(body)
        if self.chat is None:  # set together with the codec at load
            raise APIError(ErrorKind.UNAVAILABLE, "the model is loading", code="not_ready", retry_after=1)
        self._fits(sum(len(m["content"]) for m in messages), "messages")
        loop = asyncio.get_running_loop()
        text, add_special = await loop.run_in_executor(self._pool, self.chat.render, messages)
        if "add_special_tokens" in body:  # else the template's own choice (ChatTemplate.render)
            add_special = _bool(body, "add_special_tokens", False)
        ids = await self._encode(codec, text, add_special)
        if not ids:
            raise _invalid("the rendered chat prompt is empty", "messages")
        stream, include_usage = self._stream_flags(body)
        want = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want:
            raise _invalid("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = _int(body, "max_completion_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, lo=1)
        params = self._sampling(body, len(ids), max_tokens, codec.vocab_size, "messages")
        n = _int(body, "n", 1, lo=1, hi=MAX_N)
        return _Parsed(ids, params, stream, include_usage, (top or 0) if want else None, None, n=n, best_of=n,
                       continuous_usage=self._continuous_usage(body))

    async def _compile(self, engine: AsyncEngine, spec: StructuredOutput, body: dict[str, Any]) -> None:
        """Compile the request's constraint on the thread pool (cached per constraint, so the engine thread
        only copies it): an invalid schema, regex or grammar is a 400 before anything is admitted."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, engine.engine.grammars.compile, spec)
        except StructuredOutputError as exc:
            param = (_structured(body) or (spec, None))[1]
            raise _invalid(str(exc), param, "invalid_structured_output") from None

    def _cache_salt(self, request: web.Request, body: dict[str, Any]) -> str | None:
        """The request's prefix-cache salt: the --cache-salt-header value and the body's cache_salt."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 1024):
            raise _invalid("cache_salt must be a non-empty string of at most 1024 characters", "cache_salt",
                           "invalid_type" if not isinstance(salt, str) else "invalid_value")
        parts = []
        if self.config.cache_salt_header:
            parts.append("h:" + request.headers.get(self.config.cache_salt_header, ""))
        if salt:
            parts.append("b:" + salt)
        return "\x00".join(parts) or None

    # ---- generation ---------------------------------------------------------------------------

    def _queue_full(self, engine: AsyncEngine, exc: QueueFull) -> APIError:
        mean = self.metrics.mean_e2e()
        seqs = max(1, engine.engine.scheduler_config.max_num_seqs)
        wait = 1 if mean is None else min(60, max(1, math.ceil(mean * engine.num_waiting / seqs)))
        return APIError(ErrorKind.QUEUE_FULL, f"the server is at capacity: {exc}; retry later",
                        code="queue_full", retry_after=wait)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.perf_counter()
        engine, codec = self._admitting()
        body = await self._body(request)
        parsed = await (self._parse_chat(body, codec) if chat else self._parse_completion(body, codec))
        if parsed.params.structured is not None:
            await self._compile(engine, parsed.params.structured, body)
        salt = self._cache_salt(request, body)
        speculative = _speculative(body)
        if isinstance(speculative, SpeculativeConfig) and speculative.method == "draft" \
                and engine.engine.draft_model is None:
            raise _invalid("speculative: method 'draft' needs a draft model; this server has none loaded "
                           "(optimize serve --draft-artifact, or --speculative draft)", "speculative")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        jobs = self._jobs(request, codec, parsed, rid, salt, arrival, chat, speculative)
        if parsed.stream:
            return await self._stream(request, engine, jobs, parsed, rid)
        return await self._respond(request, engine, jobs, parsed, rid, chat)

    def _jobs(self, request: web.Request, codec: TextCodec, parsed: _Parsed, rid: str, salt: str | None,
              arrival: float, chat: bool, speculative: SpeculativeConfig | bool | None = None) -> _Jobs:
        """One engine request per sample: sample j (0 <= j < best_of, which is n unless best_of is given) of
        prompt i is job i * best_of + j. With a seed, sample j samples with seed_for(seed, j) (j = 0 keeps the
        seed itself, so n = 1 gives what a single request gives, and best_of draws the samples n = best_of
        draws). A request of one job keeps the response id as its engine request id."""
        prompts = [(parsed.prompt_ids, parsed.echo_text), *parsed.more]
        single = len(prompts) * parsed.best_of == 1
        # ranking needs each sampled token's logprob: asked of the engine even when the client did not ask
        logprobs = 0 if parsed.logprobs is None and parsed.ranked else parsed.logprobs
        jobs: _Jobs = []
        for ids, echo in prompts:
            for j in range(parsed.best_of):
                params = parsed.params if j == 0 or parsed.params.seed is None else \
                    dataclasses.replace(parsed.params, seed=seed_for(parsed.params.seed, j))
                one = dataclasses.replace(parsed, prompt_ids=ids, echo_text=echo, params=params, n=1, best_of=1,
                                          more=[])
                req = GenerateRequest(rid if single else f"{rid}-{len(jobs)}", ids, params, logprobs, arrival,
                                      cache_salt=salt, client=request.remote or "",
                                      prompt_logprobs=parsed.prompt_logprobs, speculative=speculative)
                fmt: _Format = _ChatFormat(self, rid, codec) if chat else \
                    _CompletionFormat(self, rid, codec, echo, one)
                jobs.append((req, fmt))
        return jobs

    def _engine_error(self, engine: AsyncEngine, exc: Exception) -> APIError:
        """The HTTP error for an admission or engine failure (ValueError: refused by the engine itself)."""
        if isinstance(exc, QueueFull):
            return self._queue_full(engine, exc)
        if isinstance(exc, EngineDeadError):
            return APIError(ErrorKind.UNAVAILABLE, str(exc), code="engine_dead")
        if isinstance(exc, ServerShuttingDown):
            return APIError(ErrorKind.UNAVAILABLE, str(exc), code="shutting_down")
        return _invalid(str(exc))

    async def _write(self, request: web.Request, resp: web.Response, rid: str) -> web.Response:
        """Send a whole response here, under the write timeout, rather than by aiohttp after the handler
        returns (a client that stops reading is cut)."""
        _allow_origin(request, resp)
        try:
            async with asyncio.timeout(self.config.write_timeout):
                await resp.prepare(request)
                await resp.write_eof()
        except TimeoutError:
            self._cut(request, rid)
        return resp

    async def _respond(self, request: web.Request, engine: AsyncEngine, jobs: _Jobs, parsed: _Parsed, rid: str,
                       chat: bool) -> web.StreamResponse:
        """A whole (not streamed) response: the jobs (`_jobs`; several for several prompts, n > 1 or
        best_of > n) run together. Choice
        k = prompt index * n + rank: without best_of the ranks are the samples in order; with best_of > n
        they are the n samples of highest cumulative logprob (the sum of the logprobs of the tokens each
        sampled, EOS or the stop token included), the most likely first (vLLM's best_of). Usage counts each
        prompt once and every sample's completion tokens, best_of's unreturned samples too (they were
        generated)."""

        async def collect(stream: RequestStream) -> tuple[RequestOutput, list[TokenLogprob]]:
            lps: list[TokenLogprob] = []
            final: RequestOutput | None = None
            async for out in stream:
                lps.extend(out.new_logprobs or [])
                if out.stop_logprob is not None and not chat:
                    lps.append(out.stop_logprob)
                final = out
            if final is None or not final.finished:
                raise APIError(ErrorKind.INTERNAL, "the engine ended a request without a final output",
                               code="internal_error")
            return final, lps

        deadline = self.config.request_timeout
        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = [await stack.enter_async_context(engine.generate(req)) for req, _ in jobs]
                try:
                    async with asyncio.timeout(deadline):
                        results = await asyncio.gather(*(collect(st) for st in streams))
                except TimeoutError:
                    for st in streams:
                        st.abort_reason = "timeout"
                    raise APIError(ErrorKind.TIMEOUT, f"the request took longer than {deadline:g} s",
                                   code="request_timeout") from None
        except (QueueFull, EngineDeadError, ServerShuttingDown, ValueError) as exc:
            raise self._engine_error(engine, exc) from None
        bodies = [fmt.response(final, lps if parsed.logprobs is not None else None)
                  for (_, fmt), (final, lps) in zip(jobs, results, strict=True)]
        per = parsed.best_of
        choices = []
        for first in range(0, len(jobs), per):
            samples = list(range(first, first + per))
            if parsed.ranked:  # a stable sort: equally likely samples keep their order
                samples.sort(key=lambda j: -math.fsum(lp.logprob for lp in results[j][1]))
            for rank, j in enumerate(samples[:parsed.n]):
                choices.append({**bodies[j]["choices"][0], "index": first // per * parsed.n + rank})
        usage = _total_usage([b["usage"] for b in bodies], per)
        envelope = jobs[0][1].envelope("chat.completion" if chat else "text_completion", choices)
        resp = web.json_response({**envelope, "usage": usage}, dumps=_dumps)
        return await self._write(request, resp, rid)

    def _cut(self, request: web.Request, rid: str) -> None:
        """Drop the connection of a client that stopped reading (write_timeout): its request is aborted."""
        log.warning("%s: the client has not read for %g s; closing its connection", rid, self.config.write_timeout)
        self.metrics.drop("write_timeout")
        if request.transport is not None:
            request.transport.abort()  # aiohttp then sees a closed connection, not an error

    async def _send(self, resp: web.StreamResponse, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.config.write_timeout):
                await resp.write(data)
        except TimeoutError:
            raise _SlowClient from None

    async def _stream(self, request: web.Request, engine: AsyncEngine, jobs: _Jobs, parsed: _Parsed,
                      rid: str) -> web.StreamResponse:
        """Server-sent events. Several jobs (prompts, n > 1) stream interleaved as their tokens come, as
        OpenAI streams several choices: each chunk carries one choice, with its index and, on its last
        chunk, its finish_reason; include_usage's final chunk sums the choices as the response without
        stream does (each prompt once)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = [await stack.enter_async_context(engine.generate(req)) for req, _ in jobs]
                return await self._events(request, streams, [fmt for _, fmt in jobs], parsed, rid)
        except (QueueFull, EngineDeadError, ServerShuttingDown, ValueError) as exc:
            raise self._engine_error(engine, exc) from None

    async def _events(self, request: web.Request, streams: list[RequestStream], fmts: list[_Format],
                      parsed: _Parsed, rid: str) -> web.StreamResponse:
        deadline = self.config.request_timeout
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        _allow_origin(request, resp)
        logprobs = parsed.logprobs is not None
        try:
            async with asyncio.timeout(self.config.write_timeout):
                await resp.prepare(request)
            for k, fmt in enumerate(fmts):
                for chunk in fmt.start():
                    await self._send(resp, _event(_indexed(chunk, k)))
            finals: dict[int, RequestOutput] = {}
            try:
                async with asyncio.timeout(deadline), contextlib.aclosing(_merged(streams)) as outputs:
                    async for k, out in outputs:
                        chunk = fmts[k].chunk(out, logprobs)
                        if chunk is not None:
                            if parsed.continuous_usage:  # this choice's usage so far (vLLM's, per choice)
                                chunk["usage"] = fmts[k].usage(out)
                            await self._send(resp, _event(_indexed(chunk, k)))
                        if out.finished:
                            finals[k] = out
                if parsed.include_usage and len(finals) == len(fmts):
                    usage = _total_usage([fmts[k].usage(finals[k]) for k in range(len(fmts))], parsed.n)
                    last = fmts[0].envelope(fmts[0].chunk_object, [])
                    await self._send(resp, _event({**last, "usage": usage}))
            except TimeoutError:
                for stream in streams:
                    stream.abort_reason = "timeout"
                await self._send(resp, _event(APIError(ErrorKind.TIMEOUT, f"the request took longer than {deadline:g} s",
                                                       code="request_timeout").error_body()))
            except (EngineDeadError, ServerShuttingDown, ValueError) as exc:
                kind, code = ((ErrorKind.INVALID_REQUEST, "invalid_value") if isinstance(exc, ValueError) else
                              (ErrorKind.UNAVAILABLE, "shutting_down" if isinstance(exc, ServerShuttingDown)
                               else "engine_dead"))
                await self._send(resp, _event(APIError(kind, str(exc), code=code).error_body()))
            await self._send(resp, b"data: [DONE]\n\n")
            async with asyncio.timeout(self.config.write_timeout):
                await resp.write_eof()
        except (_SlowClient, TimeoutError):
            self._cut(request, rid)
        except ConnectionResetError:
            log.debug("client of %s went away", rid)  # the context managers abort its requests
        return resp


def _allow_origin(request: web.Request, resp: web.StreamResponse) -> None:
    """CORS: the allowed origin the middleware found for this request, if any (--cors-origin)."""
    origin = request.get("cors_origin")
    if origin:
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Vary"] = "Origin"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def seed_for(seed: int, choice: int) -> int:
    """The seed of choice `choice` (>= 1) of a request with `seed`: distinct per choice, the same every time."""
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8, person=b"choice-seed").digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several request streams as the outputs come (the lower index first among those
    ready together), until every stream has finished; an error of any stream is raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    iters = [aiter(s) for s in streams]
    pending: dict[asyncio.Future[RequestOutput], int] = {
        asyncio.ensure_future(anext(it)): k for k, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                k = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield k, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(iters[k]))] = k
    finally:
        for fut in pending:
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: a second failure is not logged as never retrieved


def _indexed(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    """A one-choice chunk as choice `index` of its request."""
    chunk["choices"][0]["index"] = index
    return chunk


def _total_usage(usages: list[dict[str, Any]], per_prompt: int) -> dict[str, Any]:
    """The usage of a request from its samples' usages (`per_prompt` samples of each prompt in a row): each
    prompt's tokens (and cached tokens) once, every sample's completion tokens."""
    prompt = sum(u["prompt_tokens"] for u in usages[::per_prompt])
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages[::per_prompt])
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj).encode("utf-8") + b"\n\n"


# --------------------------------------------------------------------------------------------
# Response shapes
# --------------------------------------------------------------------------------------------


class _Format:
    object_name = ""
    chunk_object = ""

    def __init__(self, server: Server, rid: str, codec: TextCodec) -> None:
        self.server = server
        self.rid = rid
        self.codec = codec
        self.created = int(time.time())

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.server.model_id,
                "choices": choices}

    def start(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, out: RequestOutput, logprobs: bool) -> dict[str, Any] | None:
        raise NotImplementedError

    def response(self, out: RequestOutput, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    chunk_object = "text_completion"

    def __init__(self, server: Server, rid: str, codec: TextCodec, echo: str | None,
                 parsed: _Parsed | None = None) -> None:
        super().__init__(server, rid, codec)
        self.echo = echo
        self.parsed = parsed
        self.offset = len(echo) if echo else 0  # text_offset of the next token

    def _logprobs(self, lps: list[TokenLogprob], prompt: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; with `prompt` (echo + logprobs) the prompt's tokens come first,
        the first with null logprobs (nothing predicts it). text_offset counts the characters of the
        tokens' own pieces from 0 (a piece's text can differ from what decoding a whole sequence gives)."""
        tokens, values, tops, offsets = [], [], [], []
        if prompt is not None:
            pos = 0
            for tid, lp in zip(self.parsed.prompt_ids if self.parsed else [], prompt, strict=True):
                piece = self.codec.piece(tid)
                tokens.append(piece)
                values.append(None if lp is None else lp.logprob)
                tops.append(None if lp is None else self._top(lp))
                offsets.append(pos)
                pos += len(piece)
            self.offset = pos  # the generated tokens' offsets continue from the prompt pieces' own length
        for lp in lps:
            piece = self.codec.piece(lp.token_id)
            tokens.append(piece)
            values.append(lp.logprob)
            tops.append(self._top(lp))
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, lp: TokenLogprob) -> dict[str, float]:
        return {self.codec.piece(t): v for t, v in lp.top}

    def _vllm_prompt_logprobs(self, prompt: list[TokenLogprob | None]) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} for the token itself
        and the top N (null for the first token)."""
        out: list[dict[str, Any] | None] = []
        for lp in prompt:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.codec.piece(lp.token_id)}}
            for rank, (t, v) in enumerate(lp.top, start=1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": self.codec.piece(t)})
            out.append(entry)
        return out

    def _choice(self, text: str, lps: list[TokenLogprob] | None, reason: str | None,
                prompt: list[TokenLogprob | None] | None = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(lps, prompt) if lps is not None else None,
                "finish_reason": reason}

    def start(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        return [self.envelope(self.chunk_object, [self._choice(self.echo, None, None)])]

    def chunk(self, out: RequestOutput, logprobs: bool) -> dict[str, Any] | None:
        lps = (out.new_logprobs or []) + ([out.stop_logprob] if out.stop_logprob else []) if logprobs else None
        if not out.new_text and not out.finished and not lps:
            return None
        return self.envelope(self.chunk_object, [self._choice(out.new_text, lps, out.finish_reason)])

    def response(self, out: RequestOutput, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        parsed = self.parsed
        usage = self.usage(out)
        generated, reason = out.text, out.finish_reason
        if parsed is not None and parsed.score_only:  # max_tokens 0: the prompt alone
            generated, lps, reason = "", [] if lps is not None else None, "length"
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
        prompt = out.prompt_logprobs if parsed is not None and parsed.echo_logprobs else None
        choice = self._choice((self.echo or "") + generated, lps, reason, prompt)
        if parsed is not None and parsed.vllm_prompt_logprobs and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
        return {**self.envelope("text_completion", [choice]), "usage": usage}


class _ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, value: float) -> dict[str, Any]:
            piece = self.codec.piece(tid)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    def start(self) -> list[dict[str, Any]]:
        return [self.envelope(self.chunk_object, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])]

    def chunk(self, out: RequestOutput, logprobs: bool) -> dict[str, Any] | None:
        lps = (out.new_logprobs or []) if logprobs else None
        if not out.new_text and not out.finished and not lps:
            return None
        delta = {"content": out.new_text} if out.new_text else {}
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta,
                                                  "logprobs": self._logprobs(lps) if lps is not None else None,
                                                  "finish_reason": out.finish_reason}])

    def response(self, out: RequestOutput, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": self._logprobs(lps) if lps is not None else None, "finish_reason": out.finish_reason}
        return {**self.envelope("chat.completion", [choice]), "usage": self.usage(out)}


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


async def _main(config: ServerConfig, announce: Callable[[str], None], server: Server | None = None) -> int:
    server = server or Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, server.begin_drain)
        except (RuntimeError, ValueError):  # not the main thread (an embedded server): no signals
            log.debug("no handler for %s outside the main thread", sig.name)
    host, port = await server.start()
    announce(f"serving {server.model_id} ({server.artifact_name} {server.artifact_version}) on "
             f"http://{host}:{port}  (ready after verify + load + warm-up: GET {READY_PATH})")
    async def load_and_announce() -> None:
        announce(await server.load())

    load = asyncio.create_task(load_and_announce())
    stop = asyncio.create_task(server.stopped.wait())
    await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        exc = load.exception()
        server.state = "failed"
        announce(f"error: could not load {config.artifact}: {exc}")
        stop.cancel()
        await server.shutdown()
        return 1
    await stop
    if server.exit_code:
        announce(f"error: the engine stopped ({server.engine.error if server.engine else 'unknown'}); exiting "
                 f"with status {server.exit_code} so that the supervisor restarts the server")
    else:
        announce("SIGTERM: draining in-flight requests, then exiting")
    if not load.done():
        load.cancel()
    await server.shutdown()
    announce("stopped")
    return server.exit_code


def serve(config: ServerConfig, announce: Callable[[str], None] = print) -> int:
    """Run the server until SIGTERM/SIGINT; the process exit code (0 after a drain, 1 if loading failed or
    the engine thread died)."""
    try:
        return asyncio.run(_main(config, announce))
    except ArtifactError as exc:
        announce(f"error: {exc}")
        return 1
