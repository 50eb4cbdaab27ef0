"""The app's middlewares, outermost first: errors (an APIError or a routing error becomes the OpenAI error object,
counted and logged in one line; anything else a 500 with its traceback in the log), CORS (off unless
--cors-origin; also the OPTIONS preflight) and the API key (--api-key, on /v1/* only)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from runtime.metrics import ServingMetrics
from runtime.server.config import ServerConfig
from runtime.server.errors import APIError, ErrorKind, invalid

log = logging.getLogger("runtime.server")  # the package's one logger name, as its log lines have always read

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Middlewares:
    """The middlewares (`chain`, in the app's order) and the CORS preflight route, for one server's config."""

    def __init__(self, config: ServerConfig, metrics: ServingMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.chain = [self._errors_middleware, self._cors_middleware, self._auth_middleware]

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
                err = invalid(f"request body over {self.config.max_body_bytes} bytes", None, "request_too_large")
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
            allow_origin(request, resp)
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


def allow_origin(request: web.Request, resp: web.StreamResponse) -> None:
    """CORS: the allowed origin the middleware found for this request, if any (--cors-origin)."""
    origin = request.get("cors_origin")
    if origin:
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Vary"] = "Origin"
