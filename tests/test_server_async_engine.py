"""runtime/async_engine.py with a scripted engine (no model): hand-over, admission, abort, engine death."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from runtime.async_engine import AsyncEngine, EngineDeadError, GenerateRequest, QueueFull
from runtime.engine import RequestMetrics, RequestOutput
from runtime.metrics import ServingMetrics
from runtime.sampling import SamplingParams


@dataclass
class _Sched:
    config: Any
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 10
    num_preemptions: int = 0


@dataclass
class FakeEngine:
    """One token per request per step; `fail_at` makes step() raise; `gate` holds steps back."""

    fail_at: int | None = None
    gate: threading.Event = field(default_factory=threading.Event)
    reqs: dict[str, list[int]] = field(default_factory=dict)
    params: dict[str, SamplingParams] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=lambda: {"steps": 0})

    def __post_init__(self) -> None:
        self.scheduler = _Sched(config=type("C", (), {"num_blocks": 10, "max_num_seqs": 2})())
        self.scheduler_config = self.scheduler.config

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, *, arrival: float,
                    logprobs: int | None) -> None:
        if params.max_tokens > 100:
            raise ValueError("too many tokens")
        self.reqs[rid] = []
        self.params[rid] = params
        self._gauges()

    def abort(self, rid: str) -> None:
        if self.reqs.pop(rid, None) is not None:
            self.aborted.append(rid)
        self._gauges()

    def _gauges(self) -> None:
        self.scheduler.num_running = len(self.reqs)
        self.scheduler.num_free_blocks = 10 - len(self.reqs)

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self.gate.wait(5)
        self.stats["steps"] += 1
        if self.fail_at is not None and self.stats["steps"] >= self.fail_at:
            raise RuntimeError("boom")
        outs = []
        for rid, toks in list(self.reqs.items()):
            toks.append(len(toks))
            done = len(toks) >= self.params[rid].max_tokens
            m = RequestMetrics(arrival=0.0, first_scheduled=0.0, first_token=0.001, finished=0.002 if done else None)
            outs.append(RequestOutput(rid, [1], "x" * len(toks), list(toks), "x", [toks[-1]], done,
                                      "length" if done else None, metrics=m))
            if done:
                del self.reqs[rid]
        self._gauges()
        return outs


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def _req(rid: str, n: int = 3) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2], SamplingParams(max_tokens=n))


def test_outputs_cross_threads_in_order_and_metrics_count() -> None:
    fake = FakeEngine()
    fake.gate.set()
    metrics = ServingMetrics("m", "1", "h")

    async def main() -> list[list[int]]:
        eng = AsyncEngine(fake, metrics, max_waiting=8)  # type: ignore[arg-type]
        eng.start(asyncio.get_running_loop())

        async def one(i: int) -> list[int]:
            async with eng.generate(_req(f"r{i}", 3 + i)) as stream:
                return [t async for out in stream for t in out.new_token_ids]

        try:
            return await asyncio.gather(*(one(i) for i in range(4)))
        finally:
            eng.stop()

    got = _run(main())
    assert got == [list(range(3 + i)) for i in range(4)]
    assert metrics.generation_tokens.get() == sum(3 + i for i in range(4))
    assert metrics.finished.get(finish_reason="length") == 4
    assert metrics.prompt_tokens.get() == 8


def test_queue_full_and_early_exit_aborts() -> None:
    fake = FakeEngine()  # gate closed: nothing finishes until we say so
    metrics = ServingMetrics("m", "1", "h")

    async def main() -> None:
        eng = AsyncEngine(fake, metrics, max_waiting=2)  # type: ignore[arg-type]
        eng.start(asyncio.get_running_loop())
        try:
            async with eng.generate(_req("a", 50)), eng.generate(_req("b", 50)):
                with pytest.raises(QueueFull):
                    async with eng.generate(_req("c")):
                        pass
            # both left their blocks early: aborted in the engine, counted as "abort"
            fake.gate.set()
            for _ in range(100):
                if sorted(fake.aborted) == ["a", "b"]:
                    break
                await asyncio.sleep(0.02)
            assert sorted(fake.aborted) == ["a", "b"]
            assert metrics.finished.get(finish_reason="abort") == 2
            with pytest.raises(ValueError):  # refused by the engine: delivered to the stream
                async with eng.generate(_req("big", 500)) as stream:
                    async for _ in stream:
                        pass
        finally:
            eng.stop()

    _run(main())


def test_engine_death_fails_every_request() -> None:
    fake = FakeEngine(fail_at=2)
    fake.gate.set()

    async def main() -> AsyncEngine:
        eng = AsyncEngine(fake, ServingMetrics("m", "1", "h"), max_waiting=8)  # type: ignore[arg-type]
        eng.start(asyncio.get_running_loop())
        with pytest.raises(EngineDeadError):
            async with eng.generate(_req("a", 50)) as stream:
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):  # nothing is admitted any more
            async with eng.generate(_req("b")):
                pass
        eng.stop()
        return eng

    eng = _run(main())
    assert not eng.alive and isinstance(eng.error, RuntimeError)
