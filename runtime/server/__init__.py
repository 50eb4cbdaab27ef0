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

Errors are OpenAI-style: `{"error": {"message", "type", "param", "code"}}`; errors.py maps each
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
guard.py). Prefix-cache isolation: `cache_salt` and --cache-salt-header. CORS: off unless
--cors-origin.

Lifecycle: the socket is bound first (so /health answers during loading), then the artifact is
verified (sha256 of every file), loaded and warmed up on a worker thread, and /ready turns 200.
SIGTERM (or SIGINT) stops admitting (/ready 503, new connections refused), lets in-flight requests
finish for up to --shutdown-grace seconds (then ends them: streams get an error event and [DONE],
others a 503), stops the engine and exits 0. If the engine thread dies, requests in flight get an
error and the process exits 1 (its supervisor restarts it).

Layout (one concern per file; each imports only those listed before it):

    config.py      ServerConfig and the defaults and limits (port, probe paths, MAX_*)
    errors.py      ErrorKind -> status and OpenAI error type, APIError, engine failures -> errors, dumps
    codec.py       TextCodec (the tokenizer on the HTTP side), ChatTemplate
    fields.py      each body field read and checked (400 naming it): numbers, stop, messages, constraints
    requests.py    RequestParser: a body -> Parsed (prompt ids, SamplingParams, options), within the context
    wire.py        the OpenAI response schemas: envelope, choices, chunks, usage, logprobs shapes
    guard.py       the connection guard and limits: the connection cap, header deadline, slow-reader cut
    middleware.py  errors, CORS and API-key middlewares
    streaming.py   server-sent events: the choices interleaved, error events, [DONE]
    routes.py      Generation (/v1/completions, /v1/chat/completions), TokenizerRoutes (/tokenize, ...)
    app.py         Server (lifecycle, probes, route table, admission), serve()
"""

from __future__ import annotations

from runtime.server.app import Server, _main, serve
from runtime.server.codec import ChatTemplate, TextCodec
from runtime.server.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_GRACE,
    HEALTH_PATH,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_CHARS,
    METRICS_PATH,
    READY_PATH,
    ServerConfig,
)
from runtime.server.errors import APIError, ErrorKind, ServerShuttingDown
from runtime.server.routes import seed_for

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DEFAULT_SHUTDOWN_GRACE",
    "HEALTH_PATH",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "METRICS_PATH",
    "READY_PATH",
    "APIError",
    "ChatTemplate",
    "ErrorKind",
    "Server",
    "ServerConfig",
    "ServerShuttingDown",
    "TextCodec",
    "_main",
    "seed_for",
    "serve",
]
