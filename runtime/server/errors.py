"""Errors on the wire: `ErrorKind`, the one table from kind to HTTP status and OpenAI error type, `APIError`
(`{"error": {"message", "type", "param", "code"}}`), the HTTP error of an engine failure, and `dumps`, the
compact JSON every response body is written with."""

from __future__ import annotations

import enum
import json
import math
from typing import Any

from aiohttp import web

from runtime.async_engine import AsyncEngine, EngineDeadError, QueueFull
from runtime.metrics import ServingMetrics


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


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


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
        return web.json_response(self.error_body(), status=self.status, headers=headers, dumps=dumps)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(ErrorKind.INVALID_REQUEST, message, param=param, code=code)


class ServerShuttingDown(RuntimeError):
    """The drain's grace ran out while this request was still running."""


def queue_full(engine: AsyncEngine, metrics: ServingMetrics, exc: QueueFull) -> APIError:
    """429 with a Retry-After of the waiting requests' expected share of the running batch (1..60 s)."""
    mean = metrics.mean_e2e()
    seqs = max(1, engine.engine.scheduler_config.max_num_seqs)
    wait = 1 if mean is None else min(60, max(1, math.ceil(mean * engine.num_waiting / seqs)))
    return APIError(ErrorKind.QUEUE_FULL, f"the server is at capacity: {exc}; retry later",
                    code="queue_full", retry_after=wait)


def engine_error(engine: AsyncEngine, metrics: ServingMetrics, exc: Exception) -> APIError:
    """The HTTP error for an admission or engine failure (ValueError: refused by the engine itself)."""
    if isinstance(exc, QueueFull):
        return queue_full(engine, metrics, exc)
    if isinstance(exc, EngineDeadError):
        return APIError(ErrorKind.UNAVAILABLE, str(exc), code="engine_dead")
    if isinstance(exc, ServerShuttingDown):
        return APIError(ErrorKind.UNAVAILABLE, str(exc), code="shutting_down")
    return invalid(str(exc))
