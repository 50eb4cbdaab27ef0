"""The connection guard and its limits: a cap on open connections (one more is answered 503 and closed), a
deadline for each request's headers (slow-header clients, idle keep-alive connections), and the cut of a client
that stops reading (write_timeout). Each drop is counted in /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from runtime.metrics import ServingMetrics

log = logging.getLogger("runtime.server")  # the package's one logger name, as its log lines have always read

_OVER_CAPACITY_BODY = json.dumps({"error": {"message": "too many open connections; retry later",
                                              "type": "service_unavailable_error", "param": None,
                                              "code": "too_many_connections"}}).encode()
_OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(_OVER_CAPACITY_BODY)).encode() + b"\r\n\r\n"
                  + _OVER_CAPACITY_BODY)


class Connections:
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


class GuardedHandler(RequestHandler):
    """aiohttp's HTTP/1 protocol, plus: a connection over the cap is answered 503 and closed, and a
    connection whose next request's headers are not complete `header_timeout` seconds after it opened
    (or after its previous response) is closed (slow-header clients, idle keep-alive connections)."""

    def __init__(self, manager: web.Server, guard: Connections, **kwargs: Any) -> None:
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


class SlowClient(Exception):
    """A write to the client blocked longer than write_timeout (the client is not reading)."""


def cut(request: web.Request, rid: str, write_timeout: float, metrics: ServingMetrics) -> None:
    """Drop the connection of a client that stopped reading (write_timeout): its request is aborted."""
    log.warning("%s: the client has not read for %g s; closing its connection", rid, write_timeout)
    metrics.drop("write_timeout")
    if request.transport is not None:
        request.transport.abort()  # aiohttp then sees a closed connection, not an error
