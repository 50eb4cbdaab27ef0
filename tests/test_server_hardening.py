"""`optimize serve` against hostile clients and hostile artifacts (real servers on 127.0.0.1, raw sockets).

Each test starts a server of its own with small limits and timeouts (a second or two), so that what
a slow or malicious client does shows within the test's time: clients that never read, slow headers
and bodies, too many connections, huge prompts, huge stop strings, prefix-cache probing, malformed
JSON and text, a drain at the end of its grace, an engine thread that dies, tampered runtime.json.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_server import API_KEY, ServerProcess, get, post, wait_idle  # noqa: E402

# latency bounds (a stalled client, a flood): measured with nothing else running
pytestmark = pytest.mark.serial


def _raw_request(body: dict[str, Any] | bytes, path: str = "/v1/completions", content_type: str = "application/json",
                 auth: bool = False) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
    if auth:
        head += f"Authorization: Bearer {API_KEY}\r\n"
    return head.encode() + b"\r\n" + data


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closes `sock` (EOF or reset) within `within` seconds; reads whatever comes."""
    sock.settimeout(0.2)
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def _read_all(sock: socket.socket, timeout: float = 30) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


# --------------------------------------------------------------------------------------------
# 1. clients that never read do not lock admission; their writes time out
# --------------------------------------------------------------------------------------------


def test_clients_that_never_read_do_not_lock_admission(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--max-waiting", "1", "--max-num-seqs", "4", "--write-timeout", "8")
    try:
        hostile = []
        # Chat streams with 20 logprobs a token: ~1.8 MB each. Three pipelined on a connection that is never
        # read outgrow the kernel's socket buffers (~4 MB on loopback): the server's writes block during the
        # second, once the engine has finished it (with --max-waiting 1, one such client used to lock
        # everybody out with 429 for the whole --request-timeout).
        req = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": True,
               "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "temperature": 0}
        for _ in range(1):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", s.port))
            sock.sendall(_raw_request(req, "/v1/chat/completions") * 3)
            hostile.append(sock)
        # wait until the engine is idle: nothing running and no token generated for a second
        end = time.monotonic() + 40
        last, still = -1.0, time.monotonic()
        while time.monotonic() < end:
            m = s.metrics()
            tokens = m["optimize_generation_tokens_total"]
            if tokens != last or m["optimize_num_requests_running"] > 0:
                last, still = tokens, time.monotonic()
            elif time.monotonic() - still > 1.0:
                break
            time.sleep(0.1)
        assert last >= 1000 and m["optimize_num_requests_running"] == 0 and m["optimize_kv_blocks_used"] == 0
        assert m["optimize_open_connections"] >= 2  # the hostile client is still connected, its writes blocked
        # the engine is idle: a good client is served, not refused with 429
        status, _, body = post(s.port, "/v1/completions", {"prompt": "x =", "max_tokens": 4}, auth=False)
        assert status == 200, body
        # the blocked writes time out: the hostile connections are closed and their requests aborted
        end = time.monotonic() + 20
        while time.monotonic() < end and s.metrics().get(
                'optimize_connections_dropped_total{reason="write_timeout"}', 0) < 1:
            time.sleep(0.2)
        m = wait_idle(s)
        assert m['optimize_connections_dropped_total{reason="write_timeout"}'] == 1
        assert m["optimize_kv_blocks_used"] == 0 and m["optimize_num_requests_running"] == 0
        assert m["optimize_open_connections"] == 1  # only the one reading /metrics
        for sock in hostile:
            assert _closed_by_server(sock, 5)
            sock.close()
        assert post(s.port, "/v1/completions", {"prompt": "y =", "max_tokens": 2}, auth=False)[0] == 200
    finally:
        s.kill()


def test_per_client_bound(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--max-requests-per-client", "2", "--max-num-seqs", "8")
    try:
        socks = []
        for i in range(2):
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(_raw_request({"prompt": f"def f{i}():", "max_tokens": 900, "ignore_eos": True}))
            socks.append(sock)
        end = time.monotonic() + 10
        while s.metrics()["optimize_num_requests_running"] < 2 and time.monotonic() < end:
            time.sleep(0.05)
        status, headers, body = post(s.port, "/v1/completions", {"prompt": "z", "max_tokens": 2}, auth=False)
        assert status == 429 and body["error"]["code"] == "queue_full" and "per client" in body["error"]["message"]
        for sock in socks:
            sock.close()
        wait_idle(s)
        assert post(s.port, "/v1/completions", {"prompt": "z", "max_tokens": 2}, auth=False)[0] == 200
    finally:
        s.kill()


# --------------------------------------------------------------------------------------------
# 2. huge prompts: refused before tokenizing; tokenization off the event loop
# --------------------------------------------------------------------------------------------


def test_huge_prompts_do_not_slow_health_or_small_requests(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact)
    try:
        huge = {"prompt": "def f(x):\n    return x + 1\n" * 33000, "max_tokens": 4}  # ~900 KB
        assert len(json.dumps(huge)) > 850_000
        stop = threading.Event()
        refused: list[tuple[int, Any]] = []

        def hostile() -> None:
            while not stop.is_set():
                status, _, body = post(s.port, "/v1/completions", huge, auth=False)
                refused.append((status, body))

        threads = [threading.Thread(target=hostile) for _ in range(2)]
        for t in threads:
            t.start()
        health, small = [], []
        try:
            time.sleep(0.3)
            for _ in range(15):
                t0 = time.perf_counter()
                assert get(s.port, "/health")[0] == 200
                health.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 4}, auth=False)[0] == 200
                small.append(time.perf_counter() - t0)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert refused and all(st == 400 and b["error"]["code"] == "context_length_exceeded" for st, b in refused)
        print(f"health max {max(health):.3f} s, small request max {max(small):.3f} s, {len(refused)} huge refused")
        assert max(health) < 0.3, health
        assert max(small) < 1.0, small
        # a prompt under the character bound is still tokenized (in a worker) and counted in tokens
        status, _, body = post(s.port, "/v1/completions", {"prompt": "x = 1\n" * 3000, "max_tokens": 4}, auth=False)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded" and "tokens" in body["error"]["message"]
    finally:
        s.kill()


# --------------------------------------------------------------------------------------------
# 3. stop strings: bounded, and a hold-back check that does not copy the text
# --------------------------------------------------------------------------------------------


def test_stop_string_limits(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--max-stop-chars", "64")
    try:
        t = time.perf_counter()
        status, _, body = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                             "stop": ["z" * 60000] * 16}, auth=False)
        assert status == 400 and body["error"]["param"] == "stop" and time.perf_counter() - t < 2
        status, _, body = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["q" * 65]},
                               auth=False)
        assert status == 400 and "64 characters" in body["error"]["message"]
        status, _, body = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["q" * 64] * 16},
                               auth=False)
        assert status == 200
    finally:
        s.kill()


def test_stop_hold_back_is_independent_of_text_length() -> None:
    from runtime.engine import LLMEngine, RequestMetrics, _held_back, _Request
    from runtime.sampling import SamplingParams, make_generator

    stops = [("ab" * 200)[:255] + c for c in "cdefghijklmnopqr"]  # 16 strings of 256 characters

    def step(text: str) -> tuple[str, float]:
        """One step's output of a request that generated `text` so far: (new text, seconds)."""
        r = _Request("r", 0, [1], SamplingParams(max_tokens=10, stop=stops), make_generator(0),
                     RequestMetrics(arrival=0.0), output_ids=[5], text=text)
        t = time.perf_counter()
        out = LLMEngine._output(None, r)  # type: ignore[arg-type]  # uses only the request
        assert out is not None
        return out.new_text, time.perf_counter() - t

    # 100 000 characters, then an incomplete UTF-8 character (held back) after no stop prefix: the check
    # used to copy the text for every candidate length of every stop string (~220 ms a step here)
    text = "ab" * 50_000 + "x\ufffd"
    times = []
    for _ in range(5):
        new, dt = step(text)
        assert new == text[:-1]
        times.append(dt)
    print(f"hold-back of 16 x 256-char stops after 100 000 characters: {min(times) * 1e3:.3f} ms a step")
    assert min(times) < 0.005, times
    # ends in "abab...ab", a prefix of every stop string: 254 characters held back, once (not once per string)
    for tail in ("", "\ufffd"):
        new, _ = step("ab" * 50_000 + tail)
        assert len(new) == 100_000 - 254
    # the same answer as the definition (brute force) on small random cases
    import random

    rng = random.Random(0)
    for _ in range(3000):
        txt = "".join(rng.choice("ab") for _ in range(rng.randint(0, 10)))
        ss = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        end = rng.randint(0, len(txt))
        want = max((k for st in ss for k in range(1, min(len(st) - 1, end) + 1) if txt[:end].endswith(st[:k])),
                   default=0)
        assert _held_back(txt, end, ss) == want, (txt, end, ss)


# --------------------------------------------------------------------------------------------
# 4. prefix-cache isolation
# --------------------------------------------------------------------------------------------


def test_prefix_cache_isolation_by_tenant_header_and_cache_salt(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--cache-salt-header", "X-Tenant")
    try:
        secret = list(range(300, 348))  # 48 tokens: 2 full blocks of 16 + 16

        def cached(tenant: str | None, salt: str | None = None) -> int:
            body: dict[str, Any] = {"prompt": secret, "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            status, _, out = post(s.port, "/v1/completions", body, {"X-Tenant": tenant} if tenant else None,
                                  auth=False)
            assert status == 200, out
            return out["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("alice") == 0
        assert cached("bob") == 0  # another tenant's probe finds nothing
        assert cached(None) == 0  # nor does a request without the header
        assert cached("alice") == 47  # the same tenant reuses its own prefix
        assert cached("alice", "conversation-1") == 0  # a per-request salt isolates further
        assert cached("alice", "conversation-1") == 47
        assert cached("bob", "conversation-1") == 0  # the salt alone does not cross tenants
        status, _, out = post(s.port, "/v1/completions", {"prompt": "x", "cache_salt": 5}, auth=False)
        assert status == 400 and out["error"]["param"] == "cache_salt"
    finally:
        s.kill()


# --------------------------------------------------------------------------------------------
# 5. slow headers, slow bodies, too many connections
# --------------------------------------------------------------------------------------------


def test_header_and_body_timeouts_and_connection_cap(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--header-timeout", "1", "--body-timeout", "1", "--max-connections", "40")
    try:
        # partial headers, and one client sending a byte every 0.25 s
        partial = []
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            partial.append(sock)
        drip = socket.create_connection(("127.0.0.1", s.port))
        t = time.monotonic()
        closed_drip = None
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n":
            try:
                drip.sendall(bytes([byte]))
            except OSError:
                closed_drip = time.monotonic() - t
                break
            time.sleep(0.25)
            if _closed_by_server(drip, 0.01):
                closed_drip = time.monotonic() - t
                break
        assert closed_drip is not None and closed_drip < 3.0, closed_drip
        assert all(_closed_by_server(sock, 2.0) for sock in partial)
        # a body announced as 10 bytes with 2 sent: 408 once the body timeout passes, then closed
        body = socket.create_connection(("127.0.0.1", s.port))
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10\r\n\r\n{\"")
        t = time.monotonic()
        answer = _read_all(body, 10)
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer, answer
        assert time.monotonic() - t < 3.0
        for sock in [*partial, drip, body]:
            sock.close()
        # the cap: 40 open connections; the 41st gets 503 and is closed at once
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(40)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", s.port))
        answer = _read_all(extra, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer
        for sock in idle:  # idle connections are closed after the header timeout too
            assert _closed_by_server(sock, 3.0)
            sock.close()
        m = s.metrics()
        assert m['optimize_connections_dropped_total{reason="header_timeout"}'] >= 61
        assert m['optimize_connections_dropped_total{reason="body_timeout"}'] == 1
        assert m['optimize_connections_dropped_total{reason="too_many_connections"}'] >= 1
        assert m["optimize_open_connections"] == 1  # this scrape
        assert get(s.port, "/health")[0] == 200
    finally:
        s.kill()


# --------------------------------------------------------------------------------------------
# 6, 9, 10. malformed input: 400 (or 415) with an error object and one WARNING line, no traceback
# --------------------------------------------------------------------------------------------


def test_malformed_input_is_400_with_one_warning_line(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--cors-origin", "https://app.example")
    try:
        bad = [
            ("/v1/completions", b'{"prompt": "abc\\ud800def", "max_tokens": 2}', "application/json", 400, "prompt"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "application/json",
             400, "messages[0].content"),
            ("/v1/chat/completions",
             b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
             "application/json", 400, "messages[0].content"),
            ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, "application/json", 400, None),
            ("/v1/completions", b'{"prompt": [1.0, 2.5], "max_tokens": 2}', "application/json", 400, "prompt"),
            ("/v1/completions", b'{"prompt": "x"}', "text/plain", 415, None),
            ("/v1/completions", b"prompt=x", "application/x-www-form-urlencoded", 415, None),
            ("/v1/completions", b'{"prompt": "x"}', "", 415, None),
        ]
        for path, data, ctype, want, param in bad:
            sock = socket.create_connection(("127.0.0.1", s.port))
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(data)}\r\n"
            if ctype:
                head += f"Content-Type: {ctype}\r\n"
            sock.sendall(head.encode() + b"\r\n" + data)
            answer = _read_all(sock)
            sock.close()
            status = int(answer.split(b" ", 2)[1])
            err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert status == want, (path, data[:40], answer[:300])
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
            if data.startswith(b'{"prompt": [1.0'):
                assert "integers" in err["message"] and "batch" not in err["message"]
        # CORS: none for an origin not configured, the header for the configured one
        status, headers, _ = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                                  {"Origin": "https://evil.example"}, auth=False)
        assert status == 200 and "access-control-allow-origin" not in headers
        status, headers, _ = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                                  {"Origin": "https://app.example"}, auth=False)
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        time.sleep(0.3)
        out = s.output
        assert "Traceback" not in out and "ERROR" not in out, out
        warnings = [line for line in out.splitlines() if line.startswith("WARNING") and " -> 4" in line]
        assert len(warnings) == len(bad), warnings
    finally:
        s.kill()


def test_no_cors_by_default(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact)
    try:
        status, headers, _ = post(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                                  {"Origin": "https://evil.example"}, auth=False)
        assert status == 200 and not any(k.startswith("access-control") for k in headers)
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://evil.example\r\n"
                     b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n")
        answer = _read_all(sock)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 405") and b"access-control" not in answer.lower()
    finally:
        s.kill()


# --------------------------------------------------------------------------------------------
# 7. the drain meets its grace
# --------------------------------------------------------------------------------------------


def test_drain_ends_streams_at_the_grace_and_exits_0(demo_artifact: Path) -> None:
    s = ServerProcess(demo_artifact, "--shutdown-grace", "1")
    try:
        socks = []
        for i in range(6):
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.sendall(_raw_request({"prompt": f"def h{i}():\n", "max_tokens": 1000, "stream": True,
                                       "ignore_eos": True}))
            socks.append(sock)
        time.sleep(0.5)
        t = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        received = [_read_all(sock, 20) for sock in socks]
        code = s.proc.wait(20)
        took = time.monotonic() - t
    finally:
        s.kill()
    print(f"drain with a 1 s grace: exited {code} after {took:.2f} s")
    assert code == 0, s.output
    assert took < 2.5, took
    for data in received:
        assert data.startswith(b"HTTP/1.1 200")
        assert b'"code":"shutting_down"' in data, data[-500:]
        assert b"data: [DONE]\n\n" in data and data.endswith(b"\r\n0\r\n\r\n"), data[-200:]


# --------------------------------------------------------------------------------------------
# 8. hostile artifacts, and an engine thread that dies
# --------------------------------------------------------------------------------------------


def _tamper(src: Path, dest: Path, edit: Any) -> Path:
    """A copy of the artifact with `edit(dest)` applied and the manifest's sizes and hashes made to match
    (as a hostile publisher would)."""
    shutil.copytree(src, dest)
    edit(dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    for entry in manifest["files"]:
        f = dest / entry["path"]
        entry["bytes"] = f.stat().st_size
        entry["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dest


def _runtime_edit(**changes: Any) -> Any:
    def edit(root: Path) -> None:
        cfg = json.loads((root / "runtime.json").read_text())
        for dotted, value in changes.items():
            section, key = dotted.split("__")
            cfg[section][key] = value
        (root / "runtime.json").write_text(json.dumps(cfg, indent=2))
    return edit


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "compiler.cli", *args], capture_output=True, text=True, timeout=120)


def test_hostile_artifacts_get_one_clear_error_line(demo_artifact: Path, tmp_path: Path) -> None:
    cases = {
        "context-over-positions": (_runtime_edit(scheduler__max_model_len=1500), "max_position_embeddings"),
        "positions-over-rotary": (_runtime_edit(scheduler__max_model_len=1500, model__max_position_embeddings=4096),
                                  "rotary"),
        "huge-pool": (_runtime_edit(kv_cache__num_blocks=10**12), "GiB"),
        "wrong-type": (_runtime_edit(scheduler__max_num_seqs="16"), "max_num_seqs"),
        "garbage-tokenizer": (lambda root: (root / "tokenizer" / "tokenizer.json").write_text('{"x": 1}'),
                              "tokenizer"),
    }
    for name, (edit, needle) in cases.items():
        art = _tamper(demo_artifact, tmp_path / name, edit)
        r = _cli("generate", str(art), "def f():", "--max-tokens", "2")
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 1, (name, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("error: "), (name, r.stderr)
        assert needle in lines[0], (name, lines)
        if name == "context-over-positions":  # serve loads through the same checks
            r = _cli("serve", str(art), "--port", "0")
            assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, (name, r.stdout, r.stderr)
            assert needle in r.stderr, (name, r.stderr)
    # inspect shows a readable manifest whatever the types of its fields
    odd = _tamper(demo_artifact, tmp_path / "odd-manifest", lambda root: None)
    manifest = json.loads((odd / "manifest.json").read_text())
    manifest["passes"] = 7
    manifest["quality"] = {"metrics": {"perplexity": "high"}, "passed": "maybe"}
    (odd / "manifest.json").write_text(json.dumps(manifest))
    r = _cli("inspect", str(odd))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "passes" in r.stdout and "unexpected types" in r.stdout


def test_engine_thread_death_fails_requests_and_exits_1(demo_artifact: Path) -> None:
    from runtime.server import Server, ServerConfig, _main

    config = ServerConfig(artifact=demo_artifact, port=0, threads=1)
    server = Server(config)
    lines: list[str] = []
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(_main(config, lines.append, server))))
    thread.start()
    try:
        end = time.monotonic() + 60
        while not any(line.startswith("ready") for line in lines) and time.monotonic() < end:
            time.sleep(0.05)
        assert server.engine is not None and server.bound is not None
        port = server.bound[1]
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(_raw_request({"prompt": "def k():", "max_tokens": 900, "stream": True, "ignore_eos": True}))
        sock.settimeout(30)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        backend = server.engine.engine.backend

        def broken(*args: Any, **kwargs: Any) -> Any:  # a device fault in the middle of a step
            raise RuntimeError("injected device fault")

        backend.forward = broken
        data = first + _read_all(sock, 30)
        sock.close()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        if thread.is_alive():
            server.begin_drain()
            thread.join(30)
    assert result == [1], lines
    assert b'"code":"engine_dead"' in data and data.endswith(b"\r\n0\r\n\r\n"), data[-300:]
    assert any("engine stopped" in line and "status 1" in line for line in lines), lines


def test_scheduler_root_isolates_prefix_cache_in_c_and_twin() -> None:
    from runtime.core import reference
    from runtime.core._cwrap import Scheduler as CScheduler

    for cls in (CScheduler, reference.Scheduler):
        s = cls(reference.SchedulerConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64))
        prompt = list(range(10, 22))  # three full blocks

        def run(seq: int, root: int, s: Any = s, prompt: list[int] = prompt) -> int:
            s.add(seq, prompt, root)
            batch = s.schedule()
            cached = s.seq_num_cached(seq)
            s.update(batch, {e.seq_id: 1 for e in batch.entries if e.needs_logits})
            s.finish(seq)
            return cached

        # root 0 is the shared cache; another root never sees its blocks, the same root does
        assert [run(0, 0), run(1, 7), run(2, 7), run(3, 0), run(4, 2**64 - 1)] == [0, 0, 8, 8, 0], cls
        for bad in (-1, 2**64, True, "salt"):
            try:
                s.add(99, prompt, bad)  # type: ignore[arg-type]
            except ValueError:
                continue
            raise AssertionError(f"{cls.__name__} accepted root {bad!r}")
