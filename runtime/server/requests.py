"""Request parsing: `RequestParser` turns a completions or chat request's JSON body into a validated `Parsed`
(prompt token ids, SamplingParams, streaming and logprobs options, choices), within the loaded model's context
and KV pool; the tokenizer and the chat template run on its worker threads, off the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from runtime.async_engine import AsyncEngine
from runtime.metrics import ServingMetrics
from runtime.sampling import SamplingParams
from runtime.server.codec import ChatTemplate, TextCodec
from runtime.server.config import MAX_LOGPROBS, MAX_N, MAX_PROMPTS, ServerConfig
from runtime.server.errors import APIError, ErrorKind, invalid
from runtime.server.fields import (
    MISSING,
    OPTIONAL_SAMPLING,
    SAMPLING_FIELDS,
    bool_field,
    int_field,
    is_int,
    messages_field,
    no_constant,
    number_field,
    refuse_unsupported,
    show,
    stop_field,
    structured,
    text_field,
)
from runtime.structured import StructuredOutput, StructuredOutputError


@dataclass
class Parsed:
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


class RequestParser:
    """The loaded model as requests see it (its tokenizer, chat template, context and KV pool): reads a body
    (content type, size, deadline, JSON, model) and parses completions and chat requests against them."""

    def __init__(self, config: ServerConfig, model_id: str, metrics: ServingMetrics,
                 pool: concurrent.futures.ThreadPoolExecutor, codec: TextCodec, chat: ChatTemplate,
                 tokenizer_config: dict[str, Any], max_model_len: int, block_size: int, num_blocks: int) -> None:
        self.config = config
        self.model_id = model_id
        self.metrics = metrics
        self.codec = codec
        self.chat = chat
        self.tokenizer_config = tokenizer_config  # the artifact's tokenizer_config.json (/tokenizer_info)
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * codec.max_piece_chars  # longer texts cannot fit (refused untokenized)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._pool = pool

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        if request.content_type != "application/json":  # a browser cannot send this cross-site unasked
            raise APIError(ErrorKind.UNSUPPORTED_MEDIA_TYPE,
                           f"Content-Type must be application/json, got {show(request.content_type)}",
                           code="unsupported_media_type")
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise invalid(f"request body of {request.content_length} bytes is over the limit of {limit}",
                          None, "request_too_large")
        try:
            async with asyncio.timeout(self.config.body_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise invalid(f"request body over the limit of {limit} bytes", None, "request_too_large") from None
        except TimeoutError:
            self.metrics.drop("body_timeout")
            raise APIError(ErrorKind.TIMEOUT, f"the request body did not arrive within {self.config.body_timeout:g} s",
                           code="body_timeout") from None
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
        except RecursionError:
            raise invalid("the body is not valid JSON: nested too deeply", None, "invalid_json") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise invalid(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise APIError(ErrorKind.NOT_FOUND, f"model {model!r} is not served here (serving {self.model_id!r})",
                           param="model", code="model_not_found")
        return body

    def _sampling(self, body: dict[str, Any], prompt_len: int, max_tokens: int | None, vocab: int,
                  prompt_param: str) -> SamplingParams:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise invalid(f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens "
                          "(prompt + output)", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise invalid(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                          f"is over this model's context of {limit} tokens", "max_tokens", "context_length_exceeded")
        blocks = -(-(prompt_len + max_tokens) // self.block_size)
        if blocks > self.num_blocks:  # one sequence alone would outgrow the KV pool
            raise invalid(f"prompt + max_tokens = {prompt_len + max_tokens} tokens need {blocks} KV blocks of "
                          f"{self.block_size}; this server's pool has {self.num_blocks}", "max_tokens",
                          "context_length_exceeded")
        top_k = int_field(body, "top_k", 0, lo=-1)
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise invalid(f"stop_token_ids must be a list of token ids in [0, {vocab})", "stop_token_ids")
        extra: dict[str, float] = {}
        for name, (neutral, lo, hi) in OPTIONAL_SAMPLING.items():
            value = number_field(body, name, neutral, lo=lo, hi=hi)
            if value == neutral:
                continue
            if name not in SAMPLING_FIELDS:
                raise invalid(f"{name} is not supported by this runtime", name, "unsupported_parameter")
            extra[name] = value
        constraint = structured(body)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=number_field(body, "temperature", 1.0, lo=0.0),
            top_p=number_field(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
            top_k=0 if top_k == -1 else top_k,
            seed=int_field(body, "seed", None, lo=0, hi=2**63 - 1),
            stop=stop_field(body, self.config.max_stop_strings, self.config.max_stop_chars),
            stop_token_ids=list(ids),
            ignore_eos=bool_field(body, "ignore_eos", False),
            structured=constraint[0] if constraint else None,
            **extra,
        )
        try:
            params.validate()
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise invalid(str(exc), name if name in SAMPLING_FIELDS else None) from None
        return params

    @staticmethod
    def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        stream = bool_field(body, "stream", False)
        opts = body.get("stream_options")
        if opts is None:
            return stream, False
        if not isinstance(opts, dict):
            raise invalid("stream_options must be an object", "stream_options", "invalid_type")
        if not stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")
        return stream, bool_field(opts, "include_usage", False)

    @staticmethod
    def _continuous_usage(body: dict[str, Any]) -> bool:
        """stream_options.continuous_usage_stats (vLLM): every chunk carries the usage so far."""
        opts = body.get("stream_options")
        return isinstance(opts, dict) and bool_field(opts, "continuous_usage_stats", False)

    def fits(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it (cheap, on the event loop)."""
        if chars > self.max_prompt_chars:
            raise invalid(f"the prompt has {chars} characters; this model's context is {self.max_model_len} tokens "
                          f"(at most {self.max_prompt_chars} characters)", param, "context_length_exceeded")

    async def encode(self, text: str, add_special: bool = True) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.codec.encode, text, add_special)

    async def parse_completion(self, body: dict[str, Any]) -> Parsed:
        refuse_unsupported(body, supported=("best_of", "response_format"))
        prompt = body.get("prompt", MISSING)
        if prompt is MISSING or prompt is None:
            raise invalid("prompt is required", "prompt", "missing_field")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt given as a batch of one
        add_special = bool_field(body, "add_special_tokens", True)  # BOS and the like on string prompts (vLLM's default)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, str | list) for t in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
            batch = [await self._one_prompt(item, add_special) for item in prompt]
        else:
            batch = [await self._one_prompt(prompt, add_special)]
        ids = batch[0]
        stream, include_usage = self._stream_flags(body)
        n = int_field(body, "n", 1, lo=1, hi=MAX_N)
        best_of = int_field(body, "best_of", n, lo=1, hi=MAX_N)
        if best_of < n:
            raise invalid(f"best_of ({best_of}) must be >= n ({n})", "best_of")
        if best_of > n and stream:
            raise invalid("best_of > n is not streamed (the best are known at the end); send the request with "
                          "stream=false", "stream", "unsupported_value")
        logprobs = int_field(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
        echo = bool_field(body, "echo", False)
        vllm_prompt = int_field(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        echo_logprobs = echo and logprobs is not None
        scored = [k for k in (logprobs if echo_logprobs else None, vllm_prompt) if k is not None]
        if scored and stream:
            raise invalid("prompt logprobs (echo with logprobs, or prompt_logprobs) are not streamed; "
                          "send the request with stream=false", "stream", "unsupported_value")
        max_tokens = int_field(body, "max_tokens", 16, lo=0)
        score_only = max_tokens == 0
        if score_only and (not echo or stream):
            raise invalid("max_tokens 0 is only allowed with echo=true (the prompt alone) and stream=false",
                          "max_tokens")
        params = self._sampling(body, max(len(b) for b in batch), max(max_tokens, 1), self.codec.vocab_size,
                                "prompt")
        texts = [(item if isinstance(item, str) else self.codec.decode(b)) if echo else None
                 for item, b in zip(prompt if len(batch) > 1 else [prompt], batch, strict=True)]
        return Parsed(ids, params, stream, include_usage, logprobs, texts[0], max(scored) if scored else None,
                      echo_logprobs, vllm_prompt is not None, score_only, n, best_of, self._continuous_usage(body),
                      list(zip(batch[1:], texts[1:], strict=True)))

    async def _one_prompt(self, prompt: Any, add_special: bool = True) -> list[int]:
        """The token ids of one prompt: a string (tokenized, with special tokens unless add_special is false)
        or a list of token ids (taken as they are)."""
        if isinstance(prompt, str):
            text_field(prompt, "prompt")
            self.fits(len(prompt), "prompt")
            ids = await self.encode(prompt, add_special)
        elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            if not all(0 <= t < self.codec.vocab_size for t in prompt):
                raise invalid(f"prompt token ids must be in [0, {self.codec.vocab_size})", "prompt")
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int | float) and not isinstance(t, bool)
                                                         for t in prompt):
            bad = next(i for i, t in enumerate(prompt) if not is_int(t))
            raise invalid(f"prompt token ids must be integers, got {show(prompt[bad])} at prompt[{bad}]", "prompt",
                          "invalid_type")
        else:
            raise invalid("prompt must be a string, a list of token ids, or a list of those",
                          "prompt", "invalid_type")
        if not ids:
            raise invalid("the prompt is empty", "prompt")
        return ids

    async def parse_chat(self, body: dict[str, Any]) -> Parsed:
        refuse_unsupported(body, supported=("response_format",))
        messages = messages_field(body)
        self.fits(sum(len(m["content"]) for m in messages), "messages")
        loop = asyncio.get_running_loop()
        text, add_special = await loop.run_in_executor(self._pool, self.chat.render, messages)
        if "add_special_tokens" in body:  # else the template's own choice (ChatTemplate.render)
            add_special = bool_field(body, "add_special_tokens", False)
        ids = await self.encode(text, add_special)
        if not ids:
            raise invalid("the rendered chat prompt is empty", "messages")
        stream, include_usage = self._stream_flags(body)
        want = bool_field(body, "logprobs", False)
        top = int_field(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = int_field(body, "max_completion_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = int_field(body, "max_tokens", None, lo=1)
        params = self._sampling(body, len(ids), max_tokens, self.codec.vocab_size, "messages")
        n = int_field(body, "n", 1, lo=1, hi=MAX_N)
        return Parsed(ids, params, stream, include_usage, (top or 0) if want else None, None, n=n, best_of=n,
                      continuous_usage=self._continuous_usage(body))

    async def compile_constraint(self, engine: AsyncEngine, spec: StructuredOutput, body: dict[str, Any]) -> None:
        """Compile the request's constraint on the thread pool (cached per constraint, so the engine thread
        only copies it): an invalid schema, regex or grammar is a 400 before anything is admitted."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, engine.engine.grammars.compile, spec)
        except StructuredOutputError as exc:
            param = (structured(body) or (spec, None))[1]
            raise invalid(str(exc), param, "invalid_structured_output") from None

    def cache_salt(self, request: web.Request, body: dict[str, Any]) -> str | None:
        """The request's prefix-cache salt: the --cache-salt-header value and the body's cache_salt."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 1024):
            raise invalid("cache_salt must be a non-empty string of at most 1024 characters", "cache_salt",
                          "invalid_type" if not isinstance(salt, str) else "invalid_value")
        parts = []
        if self.config.cache_salt_header:
            parts.append("h:" + request.headers.get(self.config.cache_salt_header, ""))
        if salt:
            parts.append("b:" + salt)
        return "\x00".join(parts) or None
