"""Soak test: one `optimize serve` on 127.0.0.1, good clients alongside hostile ones, then checks.

Phases, against one server process started here (127.0.0.1 only, port chosen by the OS):

1. quiet: the good clients alone for `--quiet` seconds (their latency is the baseline);
2. hostile: for `--duration` seconds the good clients again, plus a /health prober and hostile
   clients, each a thread in a loop: slow headers (a byte at a time), slow bodies (Content-Length
   larger than what is sent), clients that never read (pipelined streams with 20 logprobs a token,
   a tiny receive window), huge prompts (~900 KB), malformed input (lone surrogates, JSON nested
   100 000 deep, float token ids, text/plain bodies), clients that reset the connection mid-stream,
   and a flood of idle connections (below --max-connections);
3. settle: hostile clients stop; the server must come back to rest.

Phases 1 and 2 each run on past their time until `--min-good` good requests (default 100) have completed,
at most `--phase-grace` seconds longer: a p99 is only estimated from enough samples (with fewer than 100, the
empirical p99 is the maximum). The p99 is the 99th percentile of the good requests' latencies
(`statistics.quantiles`, inclusive method: linear interpolation between order statistics); the summary
reports it with its sample count and the latencies themselves.

Checks (exit 1 if one fails; the summary is printed and written as JSON with --out):
- every good request completed (200, the asked number of tokens), in both phases;
- each phase had at least --min-good good requests (enough for an empirical p99);
- p99 latency of good requests under attack <= p99-factor x the quiet p99 + slack;
- /health never took longer than --health-bound seconds;
- after settling: KV blocks used 0, requests running 0, open connections 1 (the scrape itself).

Bounded in time and count: each phase stops at its deadline (its threads are then joined, each
within --write-timeout + 60 s), each kind of client (good, /health, hostile) at --max-actions
actions, and the settle phase after --write-timeout + --header-timeout + 15 s.

    python bench/soak.py ARTIFACT                         # the long setting: 300 s under attack
    python bench/soak.py ARTIFACT --duration 10 --quiet 4 # the short setting the test suite runs
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Tally:
    """What one kind of client did (thread-safe appends)."""

    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    actions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, seconds: float) -> None:
        with self.lock:
            self.latencies.append(seconds)
            self.actions += 1

    def fail(self, why: str) -> None:
        with self.lock:
            self.failures.append(why)
            self.actions += 1

    def did(self) -> None:
        with self.lock:
            self.actions += 1


def _p(values: list[float], q: float) -> float:
    """The q-quantile (q in 0.01 .. 0.99, a whole percent) of `values`: statistics.quantiles' inclusive method,
    linear interpolation between the order statistics (numpy's default percentile); 0 for no values."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.output: list[str] = []
        self.phase_s: list[float] = []  # how long each phase of good clients ran

    # ---- the server -----------------------------------------------------------------------

    def start(self) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "compiler.cli", "serve", str(a.artifact), "--host", HOST, "--port", "0",
               "--threads", str(a.threads), "--header-timeout", str(a.header_timeout), "--body-timeout",
               str(a.body_timeout), "--write-timeout", str(a.write_timeout), "--max-connections",
               str(a.max_connections)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=ROOT)
        got = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                m = re.search(r"on http://[\d.]+:(\d+)", line)
                if m and not self.port:
                    self.port = int(m.group(1))
                    got.set()
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(60) or not self.port:
            raise RuntimeError("the server did not bind:\n" + "".join(self.output))
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if self.get("/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready:\n" + "".join(self.output))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def get(self, path: str, timeout: float = 30) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def post(self, body: dict[str, Any] | bytes, path: str = "/v1/completions",
             content_type: str = "application/json", timeout: float = 120) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": content_type})
            r = conn.getresponse()
            raw = r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, body = self.get("/metrics")
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                extra = re.findall(r'(reason="[^"]*")', key)
                out[re.sub(r"\{.*\}", "", key) + (f"{{{extra[0]}}}" if extra else "")] = float(value)
        return out

    # ---- clients --------------------------------------------------------------------------

    def _loop(self, stop: threading.Event, tally: Tally, action: Callable[[], None], pause: float = 0.0) -> None:
        while not stop.is_set() and tally.actions < self.args.max_actions:
            try:
                action()
                if tally is self.hostile:
                    tally.did()
            except OSError as exc:  # a hostile client's connection being cut is expected
                if tally is self.good or tally is self.health:
                    tally.fail(f"{type(exc).__name__}: {exc}")
                else:
                    tally.did()
            if pause:
                stop.wait(pause)

    def good_request(self, i: int) -> Callable[[], None]:
        n = [0]

        def act() -> None:
            n[0] += 1
            want = 8
            stream = n[0] % 2 == 0
            body = {"prompt": f"def good_{i}_{n[0]}(x):\n    return", "max_tokens": want, "ignore_eos": True,
                    "temperature": 0, "stream": stream}
            t = time.perf_counter()
            status, out = self.post(body)
            dt = time.perf_counter() - t
            if status != 200:
                self.good.fail(f"{status}: {out}")
            elif stream:
                chunks = [c for c in out.split(b"\n\n") if c.startswith(b"data: {")] if isinstance(out, bytes) else []
                if not out.endswith(b"data: [DONE]\n\n") or len(chunks) < 1:
                    self.good.fail(f"stream incomplete: {out[-200:]!r}")
                else:
                    self.good.ok(dt)
            elif out["usage"]["completion_tokens"] != want:
                self.good.fail(f"{out['usage']['completion_tokens']} tokens instead of {want}")
            else:
                self.good.ok(dt)
        return act

    def health_probe(self) -> None:
        t = time.perf_counter()
        status, _ = self.get("/health", timeout=30)
        dt = time.perf_counter() - t
        if status != 200:
            self.health.fail(f"/health {status}")
        else:
            self.health.ok(dt)

    def _raw(self, data: bytes, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(30)
        sock.connect((HOST, self.port))
        sock.sendall(data)
        return sock

    @staticmethod
    def _request(body: bytes, path: str = "/v1/completions", ctype: str = "application/json") -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
                .encode() + body)

    def slow_headers(self, stop: threading.Event) -> None:
        sock = self._raw(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\n")
        try:
            while not stop.is_set():
                sock.sendall(b"X")
                stop.wait(0.5)
        except OSError:
            pass  # the server closed it (header timeout)
        finally:
            sock.close()

    def slow_body(self, stop: threading.Event) -> None:
        sock = self._raw(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        try:
            sock.recv(4096)  # 408 after the body timeout, then closed
        except OSError:
            pass
        finally:
            sock.close()

    def non_reader(self, stop: threading.Event) -> None:
        # ~1.8 MB a stream: three outgrow the socket buffers, and the server's writes block
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": True,
                           "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
        sock = self._raw(self._request(body, "/v1/chat/completions") * 3, rcvbuf=4096)
        stop.wait(20)  # never reads; the server cuts it --write-timeout after its writes block
        sock.close()

    def huge_prompt(self, stop: threading.Event) -> None:
        status, out = self.post({"prompt": "def f(x):\n    return x + 1\n" * 33000, "max_tokens": 4})
        if status != 400:
            self.hostile.fail(f"huge prompt: {status}")

    MALFORMED = [
        (b'{"prompt": "abc\\ud800", "max_tokens": 2}', "application/json", 400),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
        (b'{"prompt": [1.0, 2.5]}', "application/json", 400),
        (b'{"prompt": "x"}', "text/plain", 415),
        (b'{"prompt": "x", "max_tokens": ', "application/json", 400),
        (b'{"prompt": "x", "stop": ["' + b"z" * 5000 + b'"]}', "application/json", 400),
    ]

    def malformed(self, stop: threading.Event) -> None:
        for data, ctype, want in self.MALFORMED:
            status, _ = self.post(data, content_type=ctype)
            if status != want:
                self.hostile.fail(f"malformed ({data[:30]!r}): {status} instead of {want}")

    def resetter(self, stop: threading.Event) -> None:
        body = json.dumps({"prompt": "class Reset:\n", "max_tokens": 200, "stream": True, "ignore_eos": True})
        sock = self._raw(self._request(body.encode()))
        try:
            sock.recv(4096)
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
            sock.close()

    def idle_flood(self, stop: threading.Event) -> None:
        socks = []
        try:
            for _ in range(self.args.flood):
                socks.append(self._raw(b""))
            stop.wait(self.args.header_timeout + 1)
        finally:
            for s in socks:
                s.close()

    # ---- phases ---------------------------------------------------------------------------

    def run_good(self, seconds: float, hostile: bool) -> None:
        stop = threading.Event()
        threads = [threading.Thread(target=self._loop, args=(stop, self.good, self.good_request(i)))
                   for i in range(self.args.good_clients)]
        threads.append(threading.Thread(target=self._loop, args=(stop, self.health, self.health_probe, 0.1)))
        if hostile:
            for fn in (self.slow_headers, self.slow_body, self.non_reader, self.huge_prompt, self.malformed,
                       self.resetter, self.idle_flood):
                threads.append(threading.Thread(target=self._loop,
                                                args=(stop, self.hostile, lambda fn=fn: fn(stop), 0.05)))
        for t in threads:
            t.start()
        start = time.monotonic()
        # the phase's time, then on until enough good requests for a p99 (bounded by --phase-grace)
        while not stop.wait(0.05):
            elapsed = time.monotonic() - start
            if elapsed >= seconds and (len(self.good.latencies) + len(self.good.failures) >= self.args.min_good
                                       or elapsed >= seconds + self.args.phase_grace):
                break
        self.phase_s.append(round(time.monotonic() - start, 2))
        stop.set()
        for t in threads:
            t.join(self.args.write_timeout + 60)

    def run(self) -> dict[str, Any]:
        a = self.args
        self.start()
        try:
            self.good, self.health, self.hostile = Tally(), Tally(), Tally()
            self.run_good(a.quiet, hostile=False)
            quiet = self.good
            quiet_health = self.health
            self.good, self.health = Tally(), Tally()
            self.run_good(a.duration, hostile=True)
            end = time.monotonic() + a.write_timeout + a.header_timeout + 15
            m = self.metrics()
            while time.monotonic() < end and not (m["optimize_kv_blocks_used"] == 0
                                                   and m["optimize_num_requests_running"] == 0
                                                   and m["optimize_open_connections"] <= 1):
                time.sleep(0.2)
                m = self.metrics()
        finally:
            self.stop()
        q99, h99 = _p(quiet.latencies, 0.99), _p(self.good.latencies, 0.99)
        bound = a.p99_factor * q99 + a.p99_slack
        health_max = max([*quiet_health.latencies, *self.health.latencies], default=0.0)
        dropped = {k: v for k, v in m.items() if k.startswith("optimize_connections_dropped_total")}
        checks = {
            "every good request completed": not quiet.failures and not self.good.failures and bool(self.good.latencies),
            f"at least {a.min_good} good requests per phase (a p99 estimate)":
                min(len(quiet.latencies), len(self.good.latencies)) >= a.min_good,
            f"good p99 under attack <= {a.p99_factor:g} x quiet p99 + {a.p99_slack:g} s": h99 <= bound,
            f"/health always under {a.health_bound:g} s": health_max <= a.health_bound
            and not self.health.failures and not quiet_health.failures,
            "hostile requests refused as expected": not self.hostile.failures,
            "KV blocks back to 0": m["optimize_kv_blocks_used"] == 0,
            "running requests back to 0": m["optimize_num_requests_running"] == 0,
            "open connections back to 0 (1: this scrape)": m["optimize_open_connections"] <= 1,
            "server exited 0 after SIGTERM": self.proc is not None and self.proc.returncode == 0,
        }
        return {
            "settings": {"quiet_s": a.quiet, "attack_s": a.duration, "good_clients": a.good_clients,
                         "flood": a.flood, "write_timeout": a.write_timeout, "header_timeout": a.header_timeout,
                         "body_timeout": a.body_timeout, "min_good": a.min_good, "phase_s": self.phase_s},
            "good": {"quiet": len(quiet.latencies), "attack": len(self.good.latencies),
                     "failures": (quiet.failures + self.good.failures)[:10],
                     "quiet_p50_s": round(_p(quiet.latencies, 0.5), 4), "quiet_p99_s": round(q99, 4),
                     "attack_p50_s": round(_p(self.good.latencies, 0.5), 4), "attack_p99_s": round(h99, 4),
                     "p99_bound_s": round(bound, 4),
                     "quiet_latencies_s": [round(x, 5) for x in quiet.latencies],
                     "attack_latencies_s": [round(x, 5) for x in self.good.latencies]},
            "health": {"probes": len(quiet_health.latencies) + len(self.health.latencies),
                       "max_s": round(health_max, 4),
                       "p99_s": round(_p([*quiet_health.latencies, *self.health.latencies], 0.99), 4)},
            "hostile": {"actions": self.hostile.actions, "unexpected": self.hostile.failures[:10]},
            "server_after": {"kv_blocks_used": m["optimize_kv_blocks_used"],
                             "running": m["optimize_num_requests_running"],
                             "open_connections": m["optimize_open_connections"], **dropped},
            "checks": checks,
            "passed": all(checks.values()),
            "mean_good_latency_s": round(statistics.fmean(self.good.latencies), 4) if self.good.latencies else None,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--duration", type=float, default=300.0, help="seconds under attack (default 300)")
    p.add_argument("--quiet", type=float, default=30.0, help="seconds of the quiet baseline (default 30)")
    p.add_argument("--good-clients", type=int, default=4)
    p.add_argument("--flood", type=int, default=100, help="idle connections of the flood (below --max-connections)")
    p.add_argument("--max-actions", type=int, default=100_000, help="actions per client thread at most")
    p.add_argument("--min-good", type=int, default=100,
                   help="good requests each phase needs for a p99 estimate; a phase runs on until it has them")
    p.add_argument("--phase-grace", type=float, default=120.0,
                   help="seconds a phase may run past its time to reach --min-good")
    p.add_argument("--p99-factor", type=float, default=4.0)
    p.add_argument("--p99-slack", type=float, default=0.5, help="seconds added to the p99 bound")
    p.add_argument("--health-bound", type=float, default=0.5, help="seconds /health may take at most")
    p.add_argument("--threads", type=int, default=1, help="the server's ONNX Runtime threads")
    p.add_argument("--header-timeout", type=float, default=2.0)
    p.add_argument("--body-timeout", type=float, default=2.0)
    p.add_argument("--write-timeout", type=float, default=3.0)
    p.add_argument("--max-connections", type=int, default=256)
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.flood + 3 * args.good_clients + 16 > args.max_connections:
        p.error("--flood leaves no room under --max-connections for the good clients")
    summary = Soak(args).run()
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for name, ok in summary["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}", file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
