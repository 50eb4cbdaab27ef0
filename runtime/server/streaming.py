"""Streaming: a request's choices as server-sent events (`data: {json}\n\n` ... `data: [DONE]\n\n`), interleaved as
their tokens come, each write under the write timeout; a timeout or an engine failure mid-stream is an error
event before [DONE]."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from runtime.async_engine import AsyncEngine, EngineDeadError, QueueFull, RequestStream
from runtime.engine import RequestOutput
from runtime.metrics import ServingMetrics
from runtime.server.config import ServerConfig
from runtime.server.errors import APIError, ErrorKind, ServerShuttingDown, dumps, engine_error
from runtime.server.guard import SlowClient, cut
from runtime.server.middleware import allow_origin
from runtime.server.requests import Parsed
from runtime.server.wire import Format, Jobs, indexed, total_usage

log = logging.getLogger("runtime.server")  # the package's one logger name, as its log lines have always read


class Streamer:
    """Writes a streamed response (stream=true) for one server's timeouts and metrics."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics) -> None:
        self.config = config
        self.metrics = metrics

    async def _send(self, resp: web.StreamResponse, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.config.write_timeout):
                await resp.write(data)
        except TimeoutError:
            raise SlowClient from None

    async def stream(self, request: web.Request, engine: AsyncEngine, jobs: Jobs, parsed: Parsed,
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
            raise engine_error(engine, self.metrics, exc) from None

    async def _events(self, request: web.Request, streams: list[RequestStream], fmts: list[Format],
                      parsed: Parsed, rid: str) -> web.StreamResponse:
        deadline = self.config.request_timeout
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        allow_origin(request, resp)
        logprobs = parsed.logprobs is not None
        try:
            async with asyncio.timeout(self.config.write_timeout):
                await resp.prepare(request)
            for k, fmt in enumerate(fmts):
                for chunk in fmt.start():
                    await self._send(resp, event(indexed(chunk, k)))
            finals: dict[int, RequestOutput] = {}
            try:
                async with asyncio.timeout(deadline), contextlib.aclosing(merged(streams)) as outputs:
                    async for k, out in outputs:
                        chunk = fmts[k].chunk(out, logprobs)
                        if chunk is not None:
                            if parsed.continuous_usage:  # this choice's usage so far (vLLM's, per choice)
                                chunk["usage"] = fmts[k].usage(out)
                            await self._send(resp, event(indexed(chunk, k)))
                        if out.finished:
                            finals[k] = out
                if parsed.include_usage and len(finals) == len(fmts):
                    usage = total_usage([fmts[k].usage(finals[k]) for k in range(len(fmts))], parsed.n)
                    last = fmts[0].envelope(fmts[0].chunk_object, [])
                    await self._send(resp, event({**last, "usage": usage}))
            except TimeoutError:
                for stream in streams:
                    stream.abort_reason = "timeout"
                await self._send(resp, event(APIError(ErrorKind.TIMEOUT, f"the request took longer than {deadline:g} s",
                                                      code="request_timeout").error_body()))
            except (EngineDeadError, ServerShuttingDown, ValueError) as exc:
                kind, code = ((ErrorKind.INVALID_REQUEST, "invalid_value") if isinstance(exc, ValueError) else
                              (ErrorKind.UNAVAILABLE, "shutting_down" if isinstance(exc, ServerShuttingDown)
                               else "engine_dead"))
                await self._send(resp, event(APIError(kind, str(exc), code=code).error_body()))
            await self._send(resp, b"data: [DONE]\n\n")
            async with asyncio.timeout(self.config.write_timeout):
                await resp.write_eof()
        except (SlowClient, TimeoutError):
            cut(request, rid, self.config.write_timeout, self.metrics)
        except ConnectionResetError:
            log.debug("client of %s went away", rid)  # the context managers abort its requests
        return resp


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"
