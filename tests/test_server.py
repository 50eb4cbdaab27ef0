"""`optimize serve` end to end: a real server process on 127.0.0.1, the official `openai` client.

One server (module scope) serves the API tests; the back-pressure, timeout and shutdown tests
start their own with other limits. Each process binds port 0 and prints the port it got. The
timeout test's server runs `SLOW_SERVE`: the real CLI whose engine sleeps before every step, so a
long request cannot finish within the timeout on any machine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai  # the dev extra's official client: a hard requirement of these tests, never a skip
import pytest

from runtime.metrics import parse_prometheus
from runtime.server import ChatTemplate

API_KEY = "test-key"
MODEL = "pycode-llama-6m"
PROMPT = "def fibonacci(n):\n    if"

# `optimize ...` (compiler.cli) with every LLMEngine.step() delayed by argv[1] seconds (warm-up too).
SLOW_SERVE = """
import sys, time
import runtime.engine
delay = float(sys.argv.pop(1))
real_step = runtime.engine.LLMEngine.step
def slow_step(self):
    time.sleep(delay)
    return real_step(self)
runtime.engine.LLMEngine.step = slow_step
from compiler.cli import main
main(prog_name="optimize")
"""


class ServerProcess:
    """`python -m compiler.cli serve ARTIFACT --port 0 ...` with its output collected."""

    def __init__(self, artifact: Path, *args: str, step_delay: float | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        launcher = ["-m", "compiler.cli"] if step_delay is None else ["-c", SLOW_SERVE, str(step_delay)]
        cmd = [sys.executable, *launcher, "serve", str(artifact), "--port", "0", "--threads", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._port: int | None = None
        self._got_port = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._got_port.wait(60):
            self.kill()
            raise RuntimeError("server did not bind:\n" + self.output)
        self.port = self._port
        self.wait_ready()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"on http://[\d.]+:(\d+)", line)
            if m and self._port is None:
                self._port = int(m.group(1))
                self._got_port.set()
        self._got_port.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output}")
            try:
                if get(self.port, "/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready:\n" + self.output)

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def async_client(self, **kw: Any) -> Any:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        status, _, body = get(self.port, "/metrics")
        assert status == 200
        return {re.sub(r"\{.*\}", "", k) + _extra_label(k): v for k, v in parse_prometheus(body.decode()).items()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _extra_label(key: str) -> str:
    """Keep the labels other than the artifact's constant ones: name{finish_reason="stop"}."""
    m = re.search(r"\{(.*)\}", key)
    if not m:
        return ""
    extra = [p for p in re.findall(r'(\w+="[^"]*")', m.group(1))
             if not p.startswith(("model_name=", "model_version=", "manifest_sha256="))]
    return "{" + ",".join(extra) + "}" if extra else ""


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def post(port: int, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
         auth: bool = True) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {API_KEY}"} if auth else {}),
         **(headers or {})}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=data, headers=h)
        r = conn.getresponse()
        raw = r.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw
        return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(demo_artifact: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(demo_artifact, "--api-key", API_KEY, "--max-body-bytes", "65536")
    yield s
    s.kill()


def wait_idle(s: ServerProcess, timeout: float = 10) -> dict[str, float]:
    end = time.monotonic() + timeout
    while True:
        m = s.metrics()
        if (m["optimize_num_requests_running"] == 0 and m["optimize_num_requests_waiting"] == 0
                and m["optimize_kv_blocks_used"] == 0) or time.monotonic() > end:
            return m


# --------------------------------------------------------------------------------------------
# The API with the openai client
# --------------------------------------------------------------------------------------------


def test_models_health_ready(server: ServerProcess) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert get(server.port, "/health")[0] == 200
    status, _, body = get(server.port, "/ready")
    assert status == 200 and json.loads(body)["status"] == "ready"


def test_completion_and_usage(server: ServerProcess, demo_artifact: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_artifact / "tokenizer" / "tokenizer.json"))
    n_prompt = len(tok.encode(PROMPT).ids)
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == n_prompt + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # greedy is deterministic; token ids as the prompt give the same continuation
    r2 = server.client().completions.create(model=MODEL, prompt=tok.encode(PROMPT).ids, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert r2.choices[0].text == c.text
    # the same 48-token prompt again: its full blocks come from the prefix cache (the last token is recomputed)
    ids = list(range(200, 248))
    first = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=2)
    again = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 47


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_equals_non_stream(server: ServerProcess, chat: bool) -> None:
    client = server.client()
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)
    if chat:
        msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
        full = client.chat.completions.create(messages=msgs, **kw)
        text, reason, usage = full.choices[0].message.content, full.choices[0].finish_reason, full.usage
        chunks = list(client.chat.completions.create(messages=msgs, stream=True,
                                                     stream_options={"include_usage": True}, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        full = client.completions.create(prompt=PROMPT, **kw)
        text, reason, usage = full.choices[0].text, full.choices[0].finish_reason, full.usage
        chunks = list(client.completions.create(prompt=PROMPT, stream=True,
                                                stream_options={"include_usage": True}, **kw))
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text and streamed == text
    content_chunks = [ch for ch in chunks if ch.choices]
    assert content_chunks[-1].choices[0].finish_reason == reason
    assert len(content_chunks) >= 3  # sent as produced, not in one piece
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens


def test_stop_logprobs_echo(server: ServerProcess) -> None:
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stop=["\n"])
    assert "\n" not in r.choices[0].text and r.choices[0].finish_reason == "stop"

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert abs(max(top.values()) - chosen) < 1e-6  # greedy picks the most likely token

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)

    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = 1"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


def test_64_concurrent_streams_match_metrics(server: ServerProcess) -> None:
    before = wait_idle(server)
    wanted = [4 + i % 13 for i in range(64)]

    async def one(client: Any, i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"def f{i}(x):\n    return", max_tokens=wanted[i], temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage is not None:
                usage = ch.usage
        assert usage is not None
        return usage.prompt_tokens, usage.completion_tokens, text

    async def main() -> list[tuple[int, int, str]]:
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert [r[1] for r in results] == wanted
    assert all(r[2] for r in results)
    after = wait_idle(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["optimize_generation_tokens_total"] == sum(wanted)
    assert delta["optimize_prompt_tokens_total"] == sum(r[0] for r in results)
    assert delta['optimize_requests_finished_total{finish_reason="length"}'] == 64
    assert delta["optimize_e2e_request_latency_seconds_count"] == 64
    assert delta["optimize_time_to_first_token_seconds_count"] == 64
    assert delta["optimize_inter_token_latency_seconds_count"] == sum(wanted) - 64
    assert after["optimize_kv_blocks_used"] == 0 and after["optimize_num_requests_running"] == 0


def test_metrics_exposition(server: ServerProcess) -> None:
    status, headers, body = get(server.port, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples
    for line in samples:
        assert f'model_name="{MODEL}"' in line and 'model_version="1.0.0"' in line, line
        assert re.search(r'manifest_sha256="[0-9a-f]{64}"', line), line
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE optimize_{name} histogram" in text
        assert re.search(rf'optimize_{name}_bucket{{[^}}]*model_name="{MODEL}"', text) and 'le="+Inf"' in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_free",
                 "prefix_cache_hit_rate"):
        assert f"# TYPE optimize_{name} gauge" in text
    for name in ("prompt_tokens_total", "generation_tokens_total", "requests_finished_total", "preemptions_total"):
        assert f"# TYPE optimize_{name} counter" in text


def _open_stream(port: int, body: dict[str, Any]) -> socket.socket:
    """Send a streaming request on a raw socket and read until the first data chunk arrived."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while got.count(b"data: ") < 2:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200")
    return sock


def test_killed_clients_free_kv_blocks(server: ServerProcess) -> None:
    before = wait_idle(server)
    socks = [_open_stream(server.port, {"model": MODEL, "prompt": f"class C{i}:\n", "max_tokens": 900,
                                        "stream": True, "ignore_eos": True, "temperature": 0}) for i in range(6)]
    # a non-streaming request whose client goes away before the answer
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    data = json.dumps({"model": MODEL, "prompt": "import", "max_tokens": 900, "ignore_eos": True}).encode()
    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    time.sleep(0.3)
    busy = server.metrics()
    assert busy["optimize_kv_blocks_used"] > 0 and busy["optimize_num_requests_running"] >= 6
    t = time.monotonic()
    for s in [*socks, raw]:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        s.close()
    after = wait_idle(server, timeout=10)
    freed_in = time.monotonic() - t
    assert after["optimize_kv_blocks_used"] == 0 and after["optimize_num_requests_running"] == 0
    assert after['optimize_requests_finished_total{finish_reason="abort"}'] - \
        before['optimize_requests_finished_total{finish_reason="abort"}'] == 7
    assert freed_in < 5.0  # 900 tokens each would take far longer: they were aborted, not finished
    assert server.client().completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


# --------------------------------------------------------------------------------------------
# Bad requests
# --------------------------------------------------------------------------------------------

_OK = {"model": MODEL, "prompt": "import os", "max_tokens": 4}
BAD_REQUESTS = [
    # (id, path, body, headers, status, param)
    ("malformed-json", "/v1/completions", b'{"prompt": "x", ', None, 400, None),
    ("not-an-object", "/v1/completions", b"[1, 2]", None, 400, None),
    ("nan", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, 400, None),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, None, 400, "prompt"),
    ("prompt-type", "/v1/completions", {**_OK, "prompt": {"a": 1}}, None, 400, "prompt"),
    ("prompt-batch-item", "/v1/completions", {**_OK, "prompt": ["a", {"b": 1}]}, None, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {**_OK, "prompt": [1, 2, 999999]}, None, 400, "prompt"),
    ("max-tokens-type", "/v1/completions", {**_OK, "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("max-tokens-bool", "/v1/completions", {**_OK, "max_tokens": True}, None, 400, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", {**_OK, "max_tokens": 0}, None, 400, "max_tokens"),
    ("over-context", "/v1/completions", {**_OK, "max_tokens": 1024}, None, 400, "max_tokens"),
    ("prompt-over-context", "/v1/completions", {**_OK, "prompt": [5] * 1100}, None, 400, "prompt"),
    ("temperature", "/v1/completions", {**_OK, "temperature": -1}, None, 400, "temperature"),
    ("top-p", "/v1/completions", {**_OK, "top_p": 1.5}, None, 400, "top_p"),
    ("top-k", "/v1/completions", {**_OK, "top_k": -5}, None, 400, "top_k"),
    ("seed", "/v1/completions", {**_OK, "seed": "abc"}, None, 400, "seed"),
    ("n", "/v1/completions", {**_OK, "n": 0}, None, 400, "n"),
    ("n-over", "/v1/completions", {**_OK, "n": 17}, None, 400, "n"),
    ("best-of-under-n", "/v1/completions", {**_OK, "n": 3, "best_of": 2}, None, 400, "best_of"),
    ("best-of-over", "/v1/completions", {**_OK, "best_of": 17}, None, 400, "best_of"),
    ("best-of-stream", "/v1/completions", {**_OK, "best_of": 2, "stream": True}, None, 400, "stream"),
    ("stop", "/v1/completions", {**_OK, "stop": [""]}, None, 400, "stop"),
    ("stream-type", "/v1/completions", {**_OK, "stream": "yes"}, None, 400, "stream"),
    ("logprobs-range", "/v1/completions", {**_OK, "logprobs": 50}, None, 400, "logprobs"),
    ("penalty-range", "/v1/completions", {**_OK, "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("unsupported", "/v1/completions", {**_OK, "logit_bias": {"5": 10}}, None, 400, "logit_bias"),
    ("oversized", "/v1/completions", {**_OK, "prompt": "x" * 70000}, None, 400, None),
    ("chat-no-messages", "/v1/chat/completions", {"model": MODEL}, None, 400, "messages"),
    ("chat-bad-role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     None, 400, "messages[0].role"),
    ("chat-best-of", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "best_of": 2}, None, 400, "best_of"),
    ("chat-top-logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400, "top_logprobs"),
    ("unknown-model", "/v1/completions", {**_OK, "model": "gpt-9"}, None, 404, "model"),
    ("wrong-key", "/v1/completions", _OK, {"Authorization": "Bearer nope"}, 401, None),
]


def test_bad_requests_get_status_and_error_body(server: ServerProcess) -> None:
    for name, path, body, headers, status, param in BAD_REQUESTS:
        got, _, err = post(server.port, path, body, headers)
        assert got == status, (name, got, err)
        assert isinstance(err, dict) and set(err["error"]) == {"message", "type", "param", "code"}, (name, err)
        assert err["error"]["message"] and err["error"]["type"], name
        assert err["error"]["param"] == param, (name, err)
    got, _, err = post(server.port, "/v1/completions", _OK, auth=False)
    assert got == 401 and err["error"]["type"] == "authentication_error"
    assert get(server.port, "/v1/completions", {"Authorization": f"Bearer {API_KEY}"})[0] == 405
    status, _, body = get(server.port, "/v1/nothing", {"Authorization": f"Bearer {API_KEY}"})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=5000)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="bad", max_retries=0).models.list()
    # none of that left the server worse off
    assert get(server.port, "/health")[0] == 200
    r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6
    assert wait_idle(server)["optimize_kv_blocks_used"] == 0


def test_bench_against_server(server: ServerProcess, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from compiler.cli import main

    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "--url", server.base, "--api-key", API_KEY, "-n", "12", "-c", "4",
                                    "--input-len", "24", "--output-len", "10", "--prompt-kind", "ids",
                                    "--goodput", "ttft:60000", "--goodput", "tpot:60000", "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    for label in ("TTFT", "ITL", "TPOT", "E2E", "request throughput", "goodput"):
        assert label in res.output
    report = json.loads(out.read_text())
    assert report["requests"] == {"total": 12, "completed": 12, "failed": 0, "errors": {}}
    assert report["tokens"]["output"] == 120 and report["tokens"]["input"] == 12 * 24
    lat = report["latency_ms"]
    for key in ("ttft", "itl", "tpot", "e2e"):
        assert 0 < lat[key]["p50"] <= lat[key]["p99"] <= lat[key]["max"]
    assert lat["ttft"]["p50"] < lat["e2e"]["p50"]
    assert report["throughput"]["output_tokens_per_s"] > 0 and report["goodput"]["requests_met"] == 12
    assert len(report["per_request"]) == 12


# --------------------------------------------------------------------------------------------
# Back-pressure, timeout, graceful shutdown (servers of their own)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_queue_full_gets_429_and_accepted_requests_complete(demo_artifact: Path) -> None:
    n = 4
    s = ServerProcess(demo_artifact, "--max-num-seqs", "2", "--max-waiting", str(n))
    try:
        health: list[int] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                health.append(get(s.port, "/health")[0])
                time.sleep(0.02)

        results: list[tuple[int, dict[str, str], Any]] = [None] * (3 * n)  # type: ignore[list-item]
        go = threading.Barrier(3 * n)

        def send(i: int) -> None:
            go.wait()
            results[i] = post(s.port, "/v1/completions", {"prompt": f"x{i} =", "max_tokens": 16, "ignore_eos": True,
                                                          "temperature": 0}, auth=False)

        prober = threading.Thread(target=probe)
        prober.start()
        threads = [threading.Thread(target=send, args=(i,)) for i in range(3 * n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        prober.join()
        codes = [r[0] for r in results]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(429) >= 1 and codes.count(200) >= 1, codes
        for status, headers, body in results:
            if status == 429:
                assert int(headers["retry-after"]) >= 1
                assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
            else:
                assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
        assert health and set(health) == {200}
        m = wait_idle(s)
        assert m['optimize_requests_finished_total{finish_reason="length"}'] == codes.count(200)
        assert m['optimize_requests_rejected_total{reason="queue_full"}'] == codes.count(429)

    finally:
        s.kill()


def test_request_timeout_aborts_a_request_that_cannot_finish(demo_artifact: Path) -> None:
    """--request-timeout 2 on an engine that sleeps 50 ms before every step: 100 tokens take at least
    5 s, so the request must end at the timeout (408; an error event on a stream), be counted as a
    timeout and free its KV blocks; a short request still completes."""
    s = ServerProcess(demo_artifact, "--request-timeout", "2", step_delay=0.05)
    try:
        body = {"prompt": [3] * 8, "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        t = time.monotonic()
        status, _, err = post(s.port, "/v1/completions", body, auth=False)
        took = time.monotonic() - t
        assert status == 408, (status, err)
        assert err["error"]["code"] == "request_timeout" and err["error"]["type"] == "timeout_error"
        assert 2.0 <= took < 4.5, took  # at the deadline, not after the 5 s the tokens need

        t = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read().decode()
        conn.close()
        took = time.monotonic() - t
        events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
        assert r.status == 200 and events[-1] == "[DONE]", raw
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["error"]["code"] == "request_timeout", chunks[-1]
        produced = sum(len(c["choices"][0]["text"]) > 0 for c in chunks if c.get("choices"))
        assert 1 <= produced < 100 and 2.0 <= took < 4.5, (produced, took)

        ok = post(s.port, "/v1/completions", {**body, "max_tokens": 5}, auth=False)
        assert ok[0] == 200 and ok[2]["usage"]["completion_tokens"] == 5
        m = wait_idle(s)
        assert m['optimize_requests_finished_total{finish_reason="timeout"}'] == 2
        assert m["optimize_kv_blocks_used"] == 0 and m["optimize_num_requests_running"] == 0
    finally:
        s.kill()


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--shutdown-grace", "60", "--num-kv-blocks", "40")
    status, _, body = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 1000}, auth=False)
    assert status == 400 and "KV blocks" in body["error"]["message"]  # alone it would outgrow the pool
    socks = [_open_stream(s.port, {"prompt": f"def g{i}():\n", "max_tokens": 60, "stream": True, "ignore_eos": True,
                                   "stream_options": {"include_usage": True}}) for i in range(4)]
    s.proc.send_signal(signal.SIGTERM)
    try:
        received = []
        for sock in socks:
            data = b""
            while not data.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            sock.close()
            received.append(data)
        assert s.proc.wait(60) == 0, s.output
    finally:
        s.kill()
    for data in received:
        assert b"data: [DONE]\n\n" in data and data.endswith(b"\r\n0\r\n\r\n")
        usage = [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {") and b'"usage"' in line]
        assert usage and usage[-1]["usage"]["completion_tokens"] == 60
    assert "draining" in s.output.lower() or "sigterm" in s.output.lower()
    with pytest.raises(OSError):  # no longer listening
        get(s.port, "/health")


def test_serve_refuses_a_missing_or_corrupt_artifact(demo_artifact: Path, tmp_path: Path) -> None:
    import shutil

    cmd = [sys.executable, "-m", "compiler.cli", "serve", "--port", "0"]
    r = subprocess.run([*cmd, str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "nothing" in r.stderr
    bad = tmp_path / "bad"
    shutil.copytree(demo_artifact, bad)
    cfg = bad / "runtime.json"
    cfg.write_text(cfg.read_text().replace('"max_num_seqs": 16', '"max_num_seqs": 17'))
    r = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "runtime.json: sha256 differs" in r.stderr


# --------------------------------------------------------------------------------------------
# Chat template (no server)
# --------------------------------------------------------------------------------------------


def test_chat_template_from_tokenizer_config_and_fallback() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    fallback = ChatTemplate({"bos_token": "<s>"})
    text, special = fallback.render(msgs)
    assert text == "### System:\nbe brief\n\n### User:\nhi\n\n### Assistant:\n" and special
    tmpl = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    t = ChatTemplate({"chat_template": tmpl, "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    text, special = t.render(msgs)
    assert text == "<s><|system|>be brief</s><|user|>hi</s><|assistant|>" and not special
    named = ChatTemplate({"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}]})
    assert named.render(msgs)[0] == "be brief"
    strict = ChatTemplate({"chat_template": "{{ raise_exception('no system role') }}"})
    from runtime.server import APIError

    with pytest.raises(APIError) as e:
        strict.render(msgs)
    assert e.value.status == 400 and "no system role" in e.value.message
