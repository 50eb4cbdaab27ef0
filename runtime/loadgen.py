"""`optimize bench`: a load generator for any OpenAI-compatible server (streaming completions or chat).

Every request streams (`stream: true`, `stream_options.include_usage`), so the client sees each
chunk as the server sends it:

    sent ──────── first text chunk ──── chunk ──── chunk ─ ... ─ last chunk
    |<---- TTFT ---->|<--- ITL --->|<-- ITL -->|                  |
    |<------------------------------- e2e ----------------------------->|
    TPOT = (e2e - TTFT) / (output tokens - 1)

Output tokens come from the server's `usage` (else the number of text chunks); prompt tokens
likewise. Load shape: a bounded number of requests, at most `concurrency` in flight and/or
arrivals at `request_rate` per second (Poisson; `inf` sends them all at once). Prompt and output
lengths are fixed, or uniform in [L*(1-r), L*(1+r)] with `--range-ratio r`. Prompts are words
(`text`, any server; the token count is whatever the server's tokenizer makes of them) or random
token ids (`ids`, completions only; exact lengths; ids in [100, 1000) so any vocabulary has them).
Fixed output lengths need the server to ignore EOS: `ignore_eos` (a vLLM extension) is sent
unless `--no-ignore-eos`.

Goodput counts the requests per second that met every SLO given (`ttft:MS`, `tpot:MS`, `e2e:MS`,
`itl:MS` for the worst gap of a request).

Standard library + aiohttp only: no torch, no tokenizer, no project imports beyond this file.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.metrics import parse_prometheus

__all__ = ["BenchConfig", "RequestResult", "format_table", "parse_goodput", "percentile", "run_bench"]

_WORDS = ("def return self value import from class if else for while in range len list dict str int "
          "None True False print result data name path file open read write error raise try except "
          "with as lambda yield async await index count item key items values append extend").split()


@dataclass
class BenchConfig:
    url: str  # the server's base URL (with or without /v1)
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # None: the first model of GET /v1/models
    num_requests: int = 64
    concurrency: int | None = None  # requests in flight at most (None: no bound)
    request_rate: float = math.inf  # arrivals per second (Poisson); inf: all at once
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prompt_kind: str = "text"  # text | ids
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    timeout: float = 600.0  # seconds per request
    warmup: int = 0  # requests sent (one at a time) before measuring
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in milliseconds
    # each request's `speculative` field: None (the server's default), "off", or "ngram[:k=N,n=N,min=N]"
    speculative: str | None = None

    def validate(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.prompt_kind not in ("text", "ids"):
            raise ValueError(f"prompt kind must be 'text' or 'ids', got {self.prompt_kind!r}")
        if self.prompt_kind == "ids" and self.endpoint == "chat":
            raise ValueError("token-id prompts need the completions endpoint")
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_requests, input_len and output_len must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        for key in self.goodput:
            if key not in ("ttft", "tpot", "e2e", "itl"):
                raise ValueError(f"goodput SLO {key!r}: use ttft, tpot, e2e or itl")
        if self.speculative not in (None, "off"):
            speculative_field(self.speculative)


def speculative_field(text: str) -> dict[str, Any]:
    """The request's `speculative` object for "ngram" or "ngram:k=4,n=3,min=1" (the names of `optimize serve
    --speculative`; the server checks the values; parsed here so that loadgen stays free of numpy)."""
    method, _, rest = text.strip().partition(":")
    names = {"k": "num_tokens", "n": "ngram_max", "min": "ngram_min"}
    out: dict[str, Any] = {"method": method}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in names or not value.strip().isdigit():
            raise ValueError(f"speculative option {item!r}: expected k=N, n=N or min=N")
        out[names[key.strip()]] = int(value)
    return out


@dataclass
class RequestResult:
    ok: bool
    status: int | None  # HTTP status (None: no response)
    error: str | None
    input_len: int  # what was asked for
    output_len: int
    prompt_tokens: int  # what the server counted (usage), else the asked length
    output_tokens: int
    ttft: float | None  # seconds
    itl: list[float]  # seconds between text chunks
    e2e: float  # seconds
    start: float  # perf_counter() when sent


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_goodput(items: list[str] | tuple[str, ...]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or key not in ("ttft", "tpot", "e2e", "itl") or not ms > 0:
            raise ValueError(f"goodput SLO {item!r}: expected ttft:MS, tpot:MS, e2e:MS or itl:MS")
        out[key] = ms
    return out


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _lengths(cfg: BenchConfig, rng: random.Random) -> list[tuple[int, int]]:
    def pick(n: int) -> int:
        if cfg.range_ratio == 0:
            return n
        return rng.randint(max(1, int(n * (1 - cfg.range_ratio))), max(1, int(n * (1 + cfg.range_ratio))))

    return [(pick(cfg.input_len), pick(cfg.output_len)) for _ in range(cfg.num_requests)]


def _prompt(cfg: BenchConfig, n: int, rng: random.Random) -> str | list[int]:
    if cfg.prompt_kind == "ids":
        return [rng.randrange(100, 1000) for _ in range(n)]
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _payload(cfg: BenchConfig, model: str, prompt: str | list[int], out_len: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": out_len, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.speculative == "off":
        body["speculative"] = False
    elif cfg.speculative:
        body["speculative"] = speculative_field(cfg.speculative)
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _one(session: Any, cfg: BenchConfig, url: str, headers: dict[str, str], model: str,
               in_len: int, out_len: int, prompt: str | list[int]) -> RequestResult:
    import aiohttp

    start = time.perf_counter()
    ttft: float | None = None
    last = start
    itl: list[float] = []
    chunks = 0
    usage: dict[str, Any] | None = None
    status: int | None = None
    error: str | None = None
    done = False
    try:
        async with session.post(url, json=_payload(cfg, model, prompt, out_len), headers=headers) as resp:
            status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    error = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    error = text[:200]
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        error = str(obj["error"].get("message", obj["error"]))
                        continue
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or []:
                        text = choice.get("text") if cfg.endpoint == "completions" else \
                            (choice.get("delta") or {}).get("content")
                        if text:
                            now = time.perf_counter()
                            if ttft is None:
                                ttft = now - start
                            else:
                                itl.append(now - last)
                            last = now
                            chunks += 1
                if not done and error is None:
                    error = "the stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    e2e = time.perf_counter() - start
    ok = status == 200 and done and error is None
    prompt_tokens = int(usage["prompt_tokens"]) if usage else in_len
    output_tokens = int(usage["completion_tokens"]) if usage else chunks
    return RequestResult(ok, status, error, in_len, out_len, prompt_tokens, output_tokens, ttft, itl, e2e, start)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "min": None, "max": None}
    xs = [v * scale for v in values]
    return {"mean": statistics.fmean(xs), "p50": percentile(xs, 50), "p95": percentile(xs, 95),
            "p99": percentile(xs, 99), "min": min(xs), "max": max(xs)}


def _tpot(r: RequestResult) -> float | None:
    if r.ttft is None or r.output_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": _tpot(r), "e2e": r.e2e, "itl": max(r.itl) if r.itl else 0.0}
    for key, limit_ms in slo.items():
        value = measured[key]
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return r.ok


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float, model: str) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = str(r.status) if r.status not in (None, 200) else (r.error or "error").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_tokens for r in good)
    dur = max(duration, 1e-9)
    cfg_dict = asdict(cfg)
    cfg_dict["api_key"] = "***" if cfg.api_key else None
    cfg_dict["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate
    report: dict[str, Any] = {
        "config": cfg_dict,
        "model": model,
        "duration_s": duration,
        "requests": {"total": len(results), "completed": len(good), "failed": len(results) - len(good),
                     "errors": errors},
        "tokens": {"input": in_tokens, "output": out_tokens,
                   "mean_input": in_tokens / len(good) if good else None,
                   "mean_output": out_tokens / len(good) if good else None},
        "throughput": {"requests_per_s": len(good) / dur, "output_tokens_per_s": out_tokens / dur,
                       "total_tokens_per_s": (in_tokens + out_tokens) / dur},
        "latency_ms": {
            "ttft": _stats([r.ttft for r in good if r.ttft is not None]),
            "tpot": _stats([t for r in good if (t := _tpot(r)) is not None]),
            "itl": _stats([g for r in good for g in r.itl]),
            "e2e": _stats([r.e2e for r in good]),
        },
    }
    if cfg.goodput:
        met = sum(1 for r in results if _meets(r, cfg.goodput))
        report["goodput"] = {"slo_ms": cfg.goodput, "requests_met": met, "requests_per_s": met / dur,
                             "fraction": met / len(results)}
    return report


async def run_bench(cfg: BenchConfig) -> tuple[dict[str, Any], list[RequestResult]]:
    """Send the load, return (report, per-request results)."""
    import aiohttp

    cfg.validate()
    base = _base(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    rng = random.Random(cfg.seed)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    connector = aiohttp.TCPConnector(limit=cfg.concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = cfg.model
        if model is None:
            async with session.get(f"{base}/v1/models", headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"GET {base}/v1/models: HTTP {resp.status}: {(await resp.text())[:200]}")
                data = (await resp.json()).get("data") or []
                if not data:
                    raise RuntimeError(f"GET {base}/v1/models: the server lists no model")
                model = str(data[0]["id"])
        url = f"{base}/v1/chat/completions" if cfg.endpoint == "chat" else f"{base}/v1/completions"
        for _ in range(cfg.warmup):
            r = await _one(session, cfg, url, headers, model, cfg.input_len, min(cfg.output_len, 16),
                           _prompt(cfg, cfg.input_len, rng))
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: HTTP {r.status}: {r.error}")
        lengths = _lengths(cfg, rng)
        prompts = [_prompt(cfg, n, rng) for n, _ in lengths]
        sem = asyncio.Semaphore(cfg.concurrency or len(lengths))

        async def limited(i: int) -> RequestResult:
            async with sem:
                n_in, n_out = lengths[i]
                return await _one(session, cfg, url, headers, model, n_in, n_out, prompts[i])

        spec_before = await _spec_counters(session, base, headers)
        t0 = time.perf_counter()
        tasks = []
        for i in range(len(lengths)):
            tasks.append(asyncio.create_task(limited(i)))
            if math.isfinite(cfg.request_rate) and i + 1 < len(lengths):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        spec_after = await _spec_counters(session, base, headers)
    report = summarize(cfg, results, duration, model)
    if spec_before is not None and spec_after is not None:
        report["speculative"] = _spec_report(spec_before, spec_after)
    return report, results


_SPEC_PREFIX = "optimize_spec_decode_"


async def _spec_counters(session: Any, base: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The server's speculative-decoding counters from /metrics (name{position} -> value), or None when
    it has none (another server, or /metrics unreachable)."""
    try:
        async with session.get(f"{base}/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except Exception:  # noqa: BLE001 - any failure only means no speculative section in the report
        return None
    out: dict[str, float] = {}
    for key, value in parse_prometheus(text).items():
        name = key.split("{", 1)[0]
        if name.startswith(_SPEC_PREFIX) and name.endswith("_total"):
            pos = key.partition('position="')[2].partition('"')[0]
            out[name[len(_SPEC_PREFIX):] + (f"[{pos}]" if pos else "")] = value
    return out or None


def _spec_report(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Proposals verified and accepted during the run, overall and per draft position."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    proposed, accepted = int(delta.get("draft_tokens_total", 0)), int(delta.get("accepted_tokens_total", 0))
    positions = sorted(int(k.split("[")[1][:-1]) for k in delta if k.startswith("draft_tokens_per_pos_total["))
    per_pos = []
    for j in positions:
        n = int(delta.get(f"draft_tokens_per_pos_total[{j}]", 0))
        a = int(delta.get(f"accepted_tokens_per_pos_total[{j}]", 0))
        if n:
            per_pos.append({"position": j, "proposed": n, "accepted": a, "acceptance_rate": a / n})
    return {"proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else None, "per_position": per_pos}


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def format_table(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    c, req, tok, thr = report["config"], report["requests"], report["tokens"], report["throughput"]
    rate = "inf" if c["request_rate"] is None else f"{c['request_rate']:g}/s"
    lines = [
        f"model {report['model']}  endpoint {c['endpoint']}  requests {req['total']}  "
        f"concurrency {c['concurrency'] or '-'}  rate {rate}  input {c['input_len']}  output {c['output_len']}"
        + (f" (±{c['range_ratio']:.0%})" if c["range_ratio"] else ""),
        "",
        f"{'completed / failed':<28}{req['completed']} / {req['failed']}"
        + (f"  {req['errors']}" if req["errors"] else ""),
        f"{'duration (s)':<28}{report['duration_s']:.2f}",
        f"{'input / output tokens':<28}{tok['input']} / {tok['output']}",
        f"{'request throughput (req/s)':<28}{thr['requests_per_s']:.2f}",
        f"{'output throughput (tok/s)':<28}{thr['output_tokens_per_s']:.1f}",
        f"{'total throughput (tok/s)':<28}{thr['total_tokens_per_s']:.1f}",
    ]
    if "goodput" in report:
        g = report["goodput"]
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in g["slo_ms"].items())
        lines.append(f"{'goodput (req/s)':<28}{g['requests_per_s']:.2f}  ({g['requests_met']} met {slo})")
    spec = report.get("speculative")
    if spec and spec["proposed"]:
        rates = " ".join(f"{p['acceptance_rate']:.2f}" for p in spec["per_position"])
        lines.append(f"{'spec proposed / accepted':<28}{spec['proposed']} / {spec['accepted']}  "
                     f"({spec['acceptance_rate']:.1%}; per position {rates})")
    lines += ["", f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}"]
    for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "E2E")):
        s = report["latency_ms"][key]
        lines.append(f"{label:<14}" + "".join(f"{_f(s[k]):>10}" for k in ("mean", "p50", "p95", "p99", "max")))
    return "\n".join(lines)
