"""Two `optimize serve` replicas of the demo artifact behind the real `vllm-router` (pinned in the dev
extra), on 127.0.0.1, with the kv_aware policy fed by the replicas' `--kv-events`.

Through the router: the same greedy text as one replica alone; a repeated shared prefix is served
from the prefix cache of the replica that holds it (the router learned it from the events); a
replica killed under load loses no request that had not started, every stream ends, and after a
restart on the same ports the router sends to it again."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_kv_events_publisher import free_port_pair
from test_server import MODEL, ServerProcess, get, post


def worker_args(kv_port: int, port: int) -> list[str]:
    return ["--port", str(port), "--kv-events", f"tcp://127.0.0.1:{kv_port}"]


class Fleet:
    """N replicas with fixed ports (a restart takes the same ones) and vllm-router in front."""

    def __init__(self, artifact: Path, n: int = 2) -> None:
        router_bin = shutil.which("vllm-router")
        assert router_bin, "vllm-router is not installed: pip install -e '.[dev]' (it is pinned there)"
        self.artifact = artifact
        self.ports = [free_port_pair() for _ in range(n)]  # HTTP on P (P + 1 unused)
        self.kv_ports = [free_port_pair() for _ in range(n)]  # PUB on K, replay on K + 1
        self.replicas = [ServerProcess(artifact, *worker_args(k, p)) for p, k in zip(self.ports, self.kv_ports,
                                                                                    strict=True)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.router_port, prom = free_port_pair(), free_port_pair()
        cmd = [router_bin, "--host", "127.0.0.1", "--port", str(self.router_port), "--worker-urls", *self.urls,
               "--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", MODEL,
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--worker-startup-timeout-secs", "60", "--prometheus-port", str(prom), "--log-level", "info"]
        for url, k in zip(self.urls, self.kv_ports, strict=True):
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{k}",
                    "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{k + 1}"]
        self.router = subprocess.Popen([*cmd[:-2], "--log-level", "warning"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            assert self.router.poll() is None, "vllm-router exited"
            try:
                if get(self.router_port, "/v1/models")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("vllm-router did not become ready")

    def restart(self, i: int) -> None:
        self.replicas[i].kill()
        self.replicas[i] = ServerProcess(self.artifact, *worker_args(self.kv_ports[i], self.ports[i]))

    def close(self) -> None:
        if self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        for r in self.replicas:
            r.kill()


@pytest.fixture(scope="module")
def fleet(demo_artifact: Path) -> Iterator[Fleet]:
    f = Fleet(demo_artifact)
    yield f
    f.close()


def complete(port: int, prompt: str, max_tokens: int = 12) -> dict[str, Any]:
    status, _, body = post(port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0}, auth=False)
    assert status == 200, body
    return body


def prefix_queries(r: ServerProcess) -> float:
    return r.metrics()["optimize_prefix_cache_queries_total"]


def test_router_serves_the_same_greedy_text(fleet: Fleet) -> None:
    for prompt in ("def fibonacci(n):\n", "class Stack:\n    def push(self, x):\n", "import os\n\n\ndef main():"):
        alone = complete(fleet.ports[0], prompt)["choices"][0]["text"]
        routed = complete(fleet.router_port, prompt)["choices"][0]["text"]
        assert routed == alone and alone


def test_kv_aware_sends_a_shared_prefix_to_the_replica_that_holds_it(fleet: Fleet) -> None:
    system = "".join(f"# rule {i}: keep functions short and name things plainly\n" for i in range(12))
    before = [prefix_queries(r) for r in fleet.replicas]
    first = complete(fleet.router_port, system + "def parse(text):\n", max_tokens=2)
    time.sleep(0.5)  # the stored events reach the router
    cached = []
    for tail in ("def render(node):\n", "class Lexer:\n", "def main(argv):\n"):
        out = complete(fleet.router_port, system + tail, max_tokens=2)
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert first["usage"]["prompt_tokens"] > 200
    assert all(c >= 192 for c in cached), cached  # the whole shared prefix, in blocks of 16
    grew = [prefix_queries(r) - b for r, b in zip(fleet.replicas, before, strict=True)]
    assert sorted(g > 0 for g in grew) == [False, True], grew  # all four on the replica holding the prefix


async def _stream(session: aiohttp.ClientSession, port: int, i: int,
                  max_tokens: int = 300) -> tuple[int, bool, str | None]:
    """(content chunks, saw [DONE], transport error) of one streaming request through the router."""
    body = {"model": MODEL, "prompt": f"def task_{i}(x):\n", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks, done = 0, False
    try:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    chunks += "error" not in event
    except aiohttp.ClientPayloadError as exc:
        return chunks, done, type(exc).__name__
    return chunks, done, None


def test_killed_replica_loses_no_unstarted_request_and_comes_back(fleet: Fleet) -> None:
    victim = fleet.replicas[1]

    async def run() -> tuple[list[Any], list[Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            running = [asyncio.create_task(_stream(s, fleet.router_port, i)) for i in range(8)]
            await asyncio.sleep(1.0)  # every stream started on one replica or the other
            victim.proc.kill()
            later = [asyncio.create_task(_stream(s, fleet.router_port, 100 + i)) for i in range(6)]
            return list(await asyncio.gather(*running)), list(await asyncio.gather(*later))

    t = time.monotonic()
    running, later = asyncio.run(asyncio.wait_for(run(), 150))
    assert time.monotonic() - t < 150  # nothing hung
    # requests sent after the kill all complete (retried elsewhere or routed to the healthy replica)
    assert all(done and err is None and n > 0 for n, done, err in later), later
    # streams that were running: finished with [DONE], or (those on the killed replica) cut, which the
    # client sees as a truncated body: vllm-router 0.1.17 passes the broken upstream stream through
    finished = [r for r in running if r[1]]
    cut = [r for r in running if not r[1]]
    assert finished and all(err is None for _, _, err in finished)
    assert all(err == "ClientPayloadError" for _, _, err in cut), running

    fleet.restart(1)
    before = prefix_queries(fleet.replicas[1])
    end = time.monotonic() + 30
    while prefix_queries(fleet.replicas[1]) == before:  # the router takes it back after its health checks
        assert time.monotonic() < end, "the router did not send to the restarted replica"
        asyncio.run(_burst(fleet.router_port))


async def _burst(port: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        await asyncio.gather(*(_stream(s, port, 1000 + i, max_tokens=8) for i in range(4)))
