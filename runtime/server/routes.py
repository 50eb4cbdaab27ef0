"""The API's request handlers: `Generation` (/v1/completions and /v1/chat/completions: parse, admit one engine
request per sample, answer whole or streamed) and `TokenizerRoutes` (vLLM's /tokenize, /detokenize and
/tokenizer_info). Each first asks the server's `admit` for the engine and the loaded model's parser, which
refuses with 503 while loading or draining."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from runtime.async_engine import AsyncEngine, EngineDeadError, GenerateRequest, QueueFull, RequestStream
from runtime.engine import RequestOutput, TokenLogprob
from runtime.metrics import ServingMetrics
from runtime.server.codec import TextCodec, special_token
from runtime.server.config import ServerConfig
from runtime.server.errors import APIError, ErrorKind, ServerShuttingDown, dumps, engine_error, invalid
from runtime.server.fields import MISSING, bool_field, is_int, messages_field, speculative_field, text_field
from runtime.server.guard import cut
from runtime.server.middleware import allow_origin
from runtime.server.requests import Parsed, RequestParser
from runtime.server.streaming import Streamer
from runtime.server.wire import ChatFormat, CompletionFormat, Format, Jobs, total_usage
from runtime.speculative import SpeculativeConfig

Admit = Callable[[], tuple[AsyncEngine, RequestParser]]  # the engine and parser, or a 503 while not ready


def seed_for(seed: int, choice: int) -> int:
    """The seed of choice `choice` (>= 1) of a request with `seed`: distinct per choice, the same every time."""
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8, person=b"choice-seed").digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Generation:
    """/v1/completions and /v1/chat/completions: one engine request per sample (prompts x best_of), run
    together; a whole response here, a streamed one by the `Streamer`."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics, model_id: str, admit: Admit) -> None:
        self.config = config
        self.metrics = metrics
        self.model_id = model_id
        self.admit = admit
        self.streamer = Streamer(config, metrics)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.perf_counter()
        engine, parser = self.admit()
        codec = parser.codec
        body = await parser.read_body(request)
        parsed = await (parser.parse_chat(body) if chat else parser.parse_completion(body))
        if parsed.params.structured is not None:
            await parser.compile_constraint(engine, parsed.params.structured, body)
        salt = parser.cache_salt(request, body)
        speculative = speculative_field(body)
        if isinstance(speculative, SpeculativeConfig) and speculative.method == "draft" \
                and engine.engine.draft_model is None:
            raise invalid("speculative: method 'draft' needs a draft model; this server has none loaded "
                          "(optimize serve --draft-artifact, or --speculative draft)", "speculative")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        jobs = self._jobs(request, codec, parsed, rid, salt, arrival, chat, speculative)
        if parsed.stream:
            return await self.streamer.stream(request, engine, jobs, parsed, rid)
        return await self._respond(request, engine, jobs, parsed, rid, chat)

    def _jobs(self, request: web.Request, codec: TextCodec, parsed: Parsed, rid: str, salt: str | None,
              arrival: float, chat: bool, speculative: SpeculativeConfig | bool | None = None) -> Jobs:
        """One engine request per sample: sample j (0 <= j < best_of, which is n unless best_of is given) of
        prompt i is job i * best_of + j. With a seed, sample j samples with seed_for(seed, j) (j = 0 keeps the
        seed itself, so n = 1 gives what a single request gives, and best_of draws the samples n = best_of
        draws). A request of one job keeps the response id as its engine request id."""
        prompts = [(parsed.prompt_ids, parsed.echo_text), *parsed.more]
        single = len(prompts) * parsed.best_of == 1
        # ranking needs each sampled token's logprob: asked of the engine even when the client did not ask
        logprobs = 0 if parsed.logprobs is None and parsed.ranked else parsed.logprobs
        jobs: Jobs = []
        for ids, echo in prompts:
            for j in range(parsed.best_of):
                params = parsed.params if j == 0 or parsed.params.seed is None else \
                    dataclasses.replace(parsed.params, seed=seed_for(parsed.params.seed, j))
                one = dataclasses.replace(parsed, prompt_ids=ids, echo_text=echo, params=params, n=1, best_of=1,
                                          more=[])
                req = GenerateRequest(rid if single else f"{rid}-{len(jobs)}", ids, params, logprobs, arrival,
                                      cache_salt=salt, client=request.remote or "",
                                      prompt_logprobs=parsed.prompt_logprobs, speculative=speculative)
                fmt: Format = ChatFormat(self.model_id, rid, codec) if chat else \
                    CompletionFormat(self.model_id, rid, codec, echo, one)
                jobs.append((req, fmt))
        return jobs


    async def _write(self, request: web.Request, resp: web.Response, rid: str) -> web.Response:
        """Send a whole response here, under the write timeout, rather than by aiohttp after the handler
        returns (a client that stops reading is cut)."""
        allow_origin(request, resp)
        try:
            async with asyncio.timeout(self.config.write_timeout):
                await resp.prepare(request)
                await resp.write_eof()
        except TimeoutError:
            cut(request, rid, self.config.write_timeout, self.metrics)
        return resp

    async def _respond(self, request: web.Request, engine: AsyncEngine, jobs: Jobs, parsed: Parsed, rid: str,
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
            raise engine_error(engine, self.metrics, exc) from None
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
        usage = total_usage([b["usage"] for b in bodies], per)
        envelope = jobs[0][1].envelope("chat.completion" if chat else "text_completion", choices)
        resp = web.json_response({**envelope, "usage": usage}, dumps=dumps)
        return await self._write(request, resp, rid)


class TokenizerRoutes:
    """vLLM's /tokenize, /detokenize and /tokenizer_info (also under /v1): the served tokenizer, on the
    tokenizer threads."""

    def __init__(self, admit: Admit, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.admit = admit
        self._pool = pool

    async def tokenize(self, request: web.Request) -> web.Response:
        """{"prompt": text} or {"messages": [...]} (rendered with the chat template, add_generation_prompt)
        -> {"count", "max_model_len", "tokens"[, "token_strs"]}. `add_special_tokens` (default: true for a
        prompt, the template's own choice for messages) says whether the tokenizer adds BOS and the like,
        exactly as the completion endpoints do for the same text."""
        _engine, parser = self.admit()
        codec = parser.codec
        body = await parser.read_body(request)
        if "messages" in body:
            messages = messages_field(body)
            parser.fits(sum(len(m["content"]) for m in messages), "messages")
            loop = asyncio.get_running_loop()
            text, add_special = await loop.run_in_executor(self._pool, parser.chat.render, messages)
        else:
            text = body.get("prompt", MISSING)
            if text is MISSING:
                raise invalid("prompt (a string) or messages is required", "prompt", "missing_field")
            text_field(text, "prompt")
            parser.fits(len(text), "prompt")
            add_special = True
        if "add_special_tokens" in body:
            add_special = bool_field(body, "add_special_tokens", True)
        ids = await parser.encode(text, add_special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": parser.max_model_len, "tokens": ids}
        if bool_field(body, "return_token_strs", False):
            out["token_strs"] = [codec.piece(t) for t in ids]
        return web.json_response(out, dumps=dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        """{"tokens": [ids]} -> {"prompt": text} (special tokens kept, as the completion endpoints decode)."""
        _engine, parser = self.admit()
        codec = parser.codec
        body = await parser.read_body(request)
        tokens = body.get("tokens", MISSING)
        if tokens is MISSING:
            raise invalid("tokens (a list of token ids) is required", "tokens", "missing_field")
        if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < codec.vocab_size for t in tokens):
            raise invalid(f"tokens must be a list of token ids in [0, {codec.vocab_size})", "tokens")
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self._pool, codec.decode, list(tokens))
        return web.json_response({"prompt": text}, dumps=dumps)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """The artifact's tokenizer_config.json (special tokens, chat template, tokenizer class) plus the
        served context and vocabulary size."""
        _engine, parser = self.admit()
        config = dict(parser.tokenizer_config)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # as strings (an AddedToken dict there)
            if name in config:
                config[name] = special_token(config, name) or None
        config.setdefault("model_max_length", parser.max_model_len)
        return web.json_response({**config, "max_model_len": parser.max_model_len,
                                  "vocab_size": parser.codec.vocab_size},
                                 dumps=dumps)
