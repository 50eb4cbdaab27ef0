"""The server: `Server` owns one artifact's lifecycle (bind, verify + load + warm up, drain, stop), its state
(/health, /ready), the route table and the admission check every API route starts with; `serve` runs it until
SIGTERM. The routes themselves are in routes.py, the middlewares in middleware.py, the connection guard in
guard.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from runtime.artifact import Artifact, ArtifactError, quality_line, read_manifest, sha256_file
from runtime.async_engine import AsyncEngine, warm_up
from runtime.engine import LLMEngine
from runtime.kv_events import KVEventPublisher
from runtime.metrics import CONTENT_TYPE, ServingMetrics
from runtime.server.codec import ChatTemplate, TextCodec
from runtime.server.config import HEALTH_PATH, METRICS_PATH, READY_PATH, ServerConfig
from runtime.server.errors import APIError, ErrorKind, ServerShuttingDown, dumps
from runtime.server.guard import Connections, GuardedHandler
from runtime.server.middleware import Middlewares
from runtime.server.requests import RequestParser
from runtime.server.routes import Generation, TokenizerRoutes
from runtime.speculative import SpeculativeConfig

log = logging.getLogger("runtime.server")  # the package's one logger name, as its log lines have always read


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
        self.parser: RequestParser | None = None  # the loaded model's request parser, made at load
        self.max_model_len = 0
        self.block_size = 1
        self.num_blocks = 0
        self.created = int(time.time())
        self.stopped = asyncio.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.middlewares = Middlewares(config, self.metrics)
        self.generation = Generation(config, self.metrics, self.model_id, self._admitting)
        self.tokenizer_routes = TokenizerRoutes(self._admitting, self._pool)
        self.app = self._build_app()
        self.runner: web.AppRunner | None = None
        self.bound: tuple[str, int] | None = None
        self.connections = Connections(config.max_connections, config.header_timeout, self.metrics)
        self._listener: asyncio.Server | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Bind the socket (health answers from here on); returns (host, port)."""
        self.runner = web.AppRunner(self.app, handle_signals=False, handler_cancellation=True,
                                    shutdown_timeout=1.0, access_log=None)
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        manager = self.runner.server
        assert manager is not None

        def protocol() -> GuardedHandler:
            return GuardedHandler(manager, self.connections, loop=loop, access_log=None,
                                   keepalive_timeout=self.config.header_timeout + 5.0)  # ours fires first

        self._listener = await loop.create_server(protocol, self.config.host, self.config.port, backlog=1024)
        sockets = self._listener.sockets
        self.bound = tuple(sockets[0].getsockname()[:2]) if sockets else (self.config.host, self.config.port)  # type: ignore[assignment]
        return self.bound  # type: ignore[return-value]

    def _load(self) -> tuple[Any, float]:
        """Worker thread: verify, load and warm up. Returns (LLMEngine, warm-up seconds)."""
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
        assert self.codec is not None and self.chat is not None
        self.block_size = engine.scheduler_config.block_size
        self.num_blocks = engine.scheduler_config.num_blocks
        self.parser = RequestParser(self.config, self.model_id, self.metrics, self._pool, self.codec, self.chat,
                                    self.tokenizer_config, self.max_model_len, self.block_size, self.num_blocks)
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
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=self.middlewares.chain)
        app.router.add_get(HEALTH_PATH, self.health)
        app.router.add_get(READY_PATH, self.ready)
        app.router.add_get(METRICS_PATH, self.metrics_endpoint)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.generation.completions)
        app.router.add_post("/v1/chat/completions", self.generation.chat_completions)
        for prefix in ("", "/v1"):  # vLLM serves these at the root; clients also try them under /v1
            app.router.add_post(f"{prefix}/tokenize", self.tokenizer_routes.tokenize)
            app.router.add_post(f"{prefix}/detokenize", self.tokenizer_routes.detokenize)
            app.router.add_get(f"{prefix}/tokenizer_info", self.tokenizer_routes.tokenizer_info)
        if self.config.cors_origins:
            app.router.add_route("OPTIONS", "/v1/{tail:.*}", self.middlewares.preflight)
        return app

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
        return web.json_response({"object": "list", "data": [self._model_card()]}, dumps=dumps)

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_id:
            raise APIError(ErrorKind.NOT_FOUND, f"model {request.match_info['model']!r} is not served here "
                           f"(serving {self.model_id!r})", param="model", code="model_not_found")
        return web.json_response(self._model_card(), dumps=dumps)

    def _admitting(self) -> tuple[AsyncEngine, RequestParser]:
        """The engine and the loaded model's parser, or 503 while loading, draining or after the engine died."""
        if self.state == "draining":
            raise APIError(ErrorKind.UNAVAILABLE, "the server is shutting down", code="shutting_down", retry_after=1)
        if self.state != "ready" or self.engine is None or self.parser is None:
            raise APIError(ErrorKind.UNAVAILABLE, "the model is loading", code="not_ready", retry_after=1)
        if not self.engine.alive:
            raise APIError(ErrorKind.UNAVAILABLE, f"the engine stopped: {self.engine.error}", code="engine_dead")
        return self.engine, self.parser


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
