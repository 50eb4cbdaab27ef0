"""The engine thread: one `LLMEngine` stepping apart from the HTTP event loop.

    HTTP event loop (asyncio)                         engine thread (owns the LLMEngine)
    -------------------------                         ----------------------------------
    AsyncEngine.generate(req) ──> inbox (SimpleQueue) ──> drain: add_request / abort
            ^                                               step() -> outputs, metrics
            └── RequestStream.queue <── loop.call_soon_threadsafe(dispatch, [(id, output), ...])

Only the engine thread touches the `LLMEngine`. The HTTP side hands requests and aborts over
through a thread-safe queue and receives each step's outputs on its event loop, one callback per
step. Between steps the thread drains the inbox, so an abort (a client that went away, a
timeout) frees the request's KV blocks before the next step runs. When nothing is in flight the
thread blocks on the inbox and costs nothing.

Admission (the bounded waiting queue) is decided on the HTTP side: requests the engine has not
finished and that are not in its running batch may not exceed `max_waiting`; one more raises
`QueueFull` (the server answers 429). A request counts from admission until the engine finished it
(its last output, an error, or an abort), not until its handler returns: a finished request whose
client is slow to read holds no slot. With `max_per_client`, one client (a key the server picks:
peer address or tenant) may have at most that many unfinished requests.

If the engine thread dies (an error in a step), every request in flight gets `EngineDeadError` and
`on_death` is called on the event loop; the server then exits non-zero so its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.engine import LLMEngine, RequestOutput
from runtime.metrics import EngineSnapshot, ServingMetrics
from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "GenerateRequest", "QueueFull", "RequestStream", "warm_up"]


class QueueFull(Exception):
    """The waiting queue is at capacity; try again later."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an error in a step, or shutdown); no request can run."""


@dataclass
class GenerateRequest:
    """One request handed to the engine thread, fully validated and tokenized."""

    request_id: str  # unique while in flight
    prompt_ids: list[int]  # token ids (BOS included where the tokenizer adds one)
    params: SamplingParams
    logprobs: int | None = None  # None: none; N: each token's logprob plus the top N
    arrival: float = field(default_factory=time.perf_counter)  # perf_counter() at receipt
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    client: str | None = None  # the per-client admission key (None: not counted per client)
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's logprob plus the top N
    speculative: Any = None  # SpeculativeConfig | bool | None: LLMEngine.add_request's (None: the engine's default)


@dataclass
class _Abort:
    request_id: str
    reason: str  # finish reason recorded in metrics: "abort" (client gone) | "timeout"


@dataclass
class _Live:
    """Engine-thread bookkeeping of a request in the engine."""

    prompt_len: int
    scheduled: bool = False  # its first chunk was seen scheduled (prefix-cache counters done)
    last_token: float | None = None  # perf_counter() of its previous token (inter-token latency)


_STOP = object()


class RequestStream:
    """The HTTP side of one request: `async for out in stream` yields its RequestOutputs."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # the consumer saw its last item
        self.engine_done = False  # the engine finished it (or failed it): it holds no admission slot
        self.abort_reason = "abort"  # what an early exit is recorded as ("timeout" after a timeout)
        self.client: str | None = None  # its per-client admission key

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item


class AsyncEngine:
    """Runs `engine` on its own thread; `generate()` from the event loop streams a request's outputs."""

    def __init__(self, engine: LLMEngine, metrics: ServingMetrics, *, max_waiting: int, max_per_client: int = 0,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_per_client = max_per_client  # 0: no per-client bound
        self.on_death = on_death
        self._unfinished = 0  # event-loop thread only: admitted and not finished by the engine
        self._per_client: dict[str, int] = {}  # event-loop thread only: unfinished requests per client
        self.snapshot = EngineSnapshot()  # replaced (not mutated) by the engine thread
        # where the core's KV-cache event log goes after each step (runtime/kv_events.py); None: off
        self.kv_sink: Callable[[bytes], None] | None = None
        self.error: BaseException | None = None  # set when the engine thread died
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._in_flight = 0  # event-loop thread only: accepted and not yet released
        self._pending_adds = 0  # handed over, not yet in the engine (guarded by _lock)
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle (event-loop thread) --------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._publish()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a step that never returns
            log.warning("engine thread did not stop within %.0f s", timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def num_unfinished(self) -> int:
        """Admitted requests the engine has not finished (their handlers may still be writing)."""
        return self._unfinished

    @property
    def num_waiting(self) -> int:
        """Unfinished requests not in the running batch (an upper bound between engine steps)."""
        return max(0, self._unfinished - self.snapshot.running)

    def fail_all(self, exc: BaseException) -> None:
        """End every request in flight with `exc` (their handlers then abort them in the engine)."""
        for stream in list(self._streams.values()):
            if not stream.engine_done:
                self._engine_done(stream)
                self._inbox.put(_Abort(stream.request_id, "abort"))
                stream._put(exc)

    def _engine_done(self, stream: RequestStream) -> None:
        if stream.engine_done:
            return
        stream.engine_done = True
        self._unfinished -= 1
        key = stream.client
        if key is not None:
            left = self._per_client.get(key, 1) - 1
            if left > 0:
                self._per_client[key] = left
            else:
                self._per_client.pop(key, None)

    # ---- requests (event-loop thread) ---------------------------------------------------------

    @contextlib.asynccontextmanager
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestStream]:
        """Admit `req` (or raise QueueFull / EngineDeadError) and yield its stream.

        Leaving the block before the request finished (client gone, timeout, error) aborts it in
        the engine, which frees its KV blocks before its next step.
        """
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (capacity {self.max_waiting})")
        client = req.client if self.max_per_client > 0 else None
        if client is not None and self._per_client.get(client, 0) >= self.max_per_client:
            raise QueueFull(f"this client has {self._per_client[client]} requests in flight "
                            f"(at most {self.max_per_client} per client)")
        if req.request_id in self._streams:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        stream = RequestStream(req.request_id)
        stream.client = client
        self._streams[req.request_id] = stream
        self._in_flight += 1
        self._unfinished += 1
        if client is not None:
            self._per_client[client] = self._per_client.get(client, 0) + 1
        with self._lock:
            self._pending_adds += 1
        self._inbox.put(req)
        try:
            yield stream
        finally:
            if not stream.engine_done:  # left early: the engine still has it
                self._engine_done(stream)
                self._inbox.put(_Abort(req.request_id, stream.abort_reason))
            self._streams.pop(req.request_id, None)
            self._in_flight -= 1

    def _dispatch(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None and not stream.engine_done:
                if isinstance(item, BaseException) or item.finished:
                    self._engine_done(stream)
                stream._put(item)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        if not items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._drain(block=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    self._on_outputs(self.engine.step())
                self._publish()
        except BaseException as exc:  # a broken step: fail every request, report unhealthy
            log.exception("engine thread stopped by an error")
            self.error = exc
        finally:
            err = EngineDeadError(f"the engine stopped: {self.error}" if self.error else "the server is stopping")
            pending = []  # handed over but never added: fail them too, nobody will step them
            while True:
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, GenerateRequest):
                    pending.append(msg.request_id)
            self._deliver([(rid, err) for rid in [*self._live, *pending]])
            try:
                for rid in list(self._live):
                    self._finish_aborted(rid, "abort")
                self._publish()
            except Exception:  # pragma: no cover - the engine is already broken
                log.exception("cleaning up after the engine thread failed")
            if self.error is not None and self.on_death is not None and self._loop is not None:
                try:  # after the errors above were handed over, so requests see the engine's error first
                    self._loop.call_soon_threadsafe(self.on_death, self.error)
                except RuntimeError:  # the event loop is closed
                    pass

    def _drain(self, block: bool) -> bool:
        """Apply every pending add/abort (waiting for one when idle); False when told to stop."""
        msgs = [self._inbox.get()] if block else []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        errors: list[tuple[str, RequestOutput | BaseException]] = []
        for msg in msgs:
            if msg is _STOP:
                return False
            if isinstance(msg, _Abort):
                self._finish_aborted(msg.request_id, msg.reason)
                continue
            req: GenerateRequest = msg
            try:
                extra: dict[str, Any] = {"cache_salt": req.cache_salt} if req.cache_salt else {}
                if req.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = req.prompt_logprobs
                if req.speculative is not None:
                    extra["speculative"] = req.speculative
                self.engine.add_request(req.request_id, req.prompt_ids, req.params, arrival=req.arrival,
                                        logprobs=req.logprobs, **extra)
            except ValueError as exc:
                errors.append((req.request_id, exc))
            else:
                self._live[req.request_id] = _Live(len(req.prompt_ids))
                self.metrics.add_prompt_tokens(len(req.prompt_ids))
            finally:
                with self._lock:
                    self._pending_adds -= 1
        self._deliver(errors)
        return True

    def _finish_aborted(self, rid: str, reason: str) -> None:
        if self._live.pop(rid, None) is None:
            return  # already finished (the abort crossed its last output) or never added
        self.engine.abort(rid)
        self.metrics.request_finished(reason)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        items: list[tuple[str, RequestOutput | BaseException]] = []
        new_tokens = 0
        gaps: list[float] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # pragma: no cover - aborted requests produce no outputs
                continue
            m = out.metrics
            if not live.scheduled and m is not None and m.first_scheduled is not None:
                live.scheduled = True
                self.metrics.request_scheduled(live.prompt_len, m.num_cached_tokens)
            n = len(out.new_token_ids)
            if n:
                new_tokens += n
                if live.last_token is not None:
                    gaps.append(now - live.last_token)
                live.last_token = now
            if out.finished:
                del self._live[out.request_id]
                self._record_finished(out)
            items.append((out.request_id, out))
        self.metrics.tokens(new_tokens, gaps)
        self._deliver(items)

    def _record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        reason = out.finish_reason or "stop"
        if m is None or m.first_scheduled is None or m.first_token is None or m.finished is None:
            self.metrics.request_finished(reason)
            return
        n = len(out.token_ids)
        self.metrics.request_finished(
            reason,
            queue=m.first_scheduled - m.arrival,
            prefill=m.first_token - m.first_scheduled,
            ttft=m.first_token - m.arrival,
            tpot=(m.finished - m.first_token) / (n - 1) if n > 1 else None,
            e2e=m.finished - m.arrival,
        )

    def _publish(self) -> None:
        sched = self.engine.scheduler
        if self.kv_sink is not None:
            self.kv_sink(sched.kv_events())
        total = int(getattr(sched.config, "num_blocks", 0))
        free = int(getattr(sched, "num_free_blocks", total))
        with self._lock:
            pending = self._pending_adds
        snap = EngineSnapshot(
            running=int(getattr(sched, "num_running", 0)),
            waiting=int(getattr(sched, "num_waiting", 0)) + pending,
            kv_blocks_used=total - free,
            kv_blocks_free=free,
            preemptions=int(getattr(sched, "num_preemptions", 0)),
            steps=int(self.engine.stats.get("steps", 0)),
            spec_proposed=int(self.engine.stats.get("spec_proposed", 0)),
            spec_accepted=int(self.engine.stats.get("spec_accepted", 0)),
            spec_position_proposed=tuple(self.engine.stats.get("spec_position_proposed", ())),
            spec_position_accepted=tuple(self.engine.stats.get("spec_position_accepted", ())),
        )
        self.snapshot = snap
        self.metrics.set_snapshot(snap)


def warm_up(engine: LLMEngine, prompt_len: int = 64, max_tokens: int = 4) -> float:
    """Run one short request through `engine` (first ONNX Runtime runs allocate); seconds taken."""
    t = time.perf_counter()
    n = max(1, min(prompt_len, engine.scheduler_config.max_model_len - max_tokens - 1))
    ids = [i % engine.vocab_size for i in range(3, 3 + n)]
    rid = "__warmup__"
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.abort(rid)
    return time.perf_counter() - t
