"""Serving metrics in the Prometheus text exposition format (version 0.0.4), no dependencies.

`ServingMetrics` holds every metric the server exports. The engine thread records request phases
and tokens; the HTTP thread renders `/metrics`. One lock guards all of it (updates are a few
additions each, so contention is negligible next to a model step).

Every sample carries the artifact's constant labels (`model_name`, `model_version`,
`manifest_sha256`), so several artifacts scraped into one Prometheus stay apart.

    metric                                         type       unit / meaning
    optimize_request_queue_time_seconds            histogram  received -> first chunk scheduled
    optimize_request_prefill_time_seconds          histogram  first chunk scheduled -> first token
    optimize_time_to_first_token_seconds           histogram  received -> first token
    optimize_inter_token_latency_seconds           histogram  gap between consecutive tokens of a request
    optimize_time_per_output_token_seconds         histogram  (finished - first token) / (tokens - 1)
    optimize_e2e_request_latency_seconds           histogram  received -> finished
    optimize_prompt_tokens_total                   counter    prompt tokens of requests handed to the engine
    optimize_generation_tokens_total               counter    tokens sent to clients (EOS not counted)
    optimize_requests_finished_total{finish_reason}  counter  stop | length | abort | timeout
    optimize_requests_rejected_total{reason}       counter    refused before the engine (queue_full, ...)
    optimize_num_requests_running                  gauge      sequences in the running batch
    optimize_num_requests_waiting                  gauge      accepted, not running (incl. preempted)
    optimize_kv_blocks_used / _free                gauge      KV cache blocks
    optimize_kv_cache_usage_ratio                  gauge      used / total
    optimize_prefix_cache_queries_total / _hits_total  counter  prompt tokens looked up / found cached
    optimize_prefix_cache_hit_rate                 gauge      hits / queries since start
    optimize_open_connections                      gauge      HTTP connections open now
    optimize_connections_dropped_total{reason}     counter    closed by the server (header_timeout, ...)
    optimize_preemptions_total                     counter    sequences preempted (freed, recomputed)
    optimize_spec_decode_draft_tokens_total        counter    speculative proposals verified
    optimize_spec_decode_accepted_tokens_total     counter    of which accepted
    optimize_spec_decode_acceptance_rate           gauge      accepted / verified since start
    optimize_spec_decode_draft_tokens_per_pos_total{position}     counter  proposals verified at draft position
    optimize_spec_decode_accepted_tokens_per_pos_total{position}  counter  of which accepted (position 0: first)
    optimize_spec_decode_acceptance_rate_per_pos{position}        gauge    accepted / verified at that position

Latency histograms cover requests that finished with `stop` or `length`; aborted and timed-out
requests only count in `optimize_requests_finished_total`.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["Counter", "Gauge", "Histogram", "ServingMetrics", "EngineSnapshot", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket upper bounds (seconds). Wide enough for a CPU demo and a GPU server alike.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, const: Sequence[tuple[str, str]],
                 label_names: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.const = tuple(const)
        self.label_names = tuple(label_names)

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.label_names)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def _lbl(self, key: tuple[str, ...], extra: Sequence[tuple[str, str]] = ()) -> str:
        return _labels([*self.const, *zip(self.label_names, key, strict=True), *extra])

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count; `name` should end in `_total`."""

    kind = "counter"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.values: dict[tuple[str, ...], float] = {}
        if not self.label_names:
            self.values[()] = 0.0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{self._lbl(k)} {_num(v)}" for k, v in sorted(self.values.items())]


class Gauge(_Metric):
    """A value that goes up and down (set from the engine's latest snapshot)."""

    kind = "gauge"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{self._lbl(())} {_num(self.value)}"]


class GaugeVec(_Metric):
    """A gauge per label value (set from the engine's latest snapshot)."""

    kind = "gauge"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{self._lbl(k)} {_num(v)}" for k, v in sorted(self.values.items())]


class Histogram(_Metric):
    """Cumulative buckets, sum and count (no labels beyond the constant ones)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, const: Sequence[tuple[str, str]],
                 buckets: Sequence[float]) -> None:
        super().__init__(name, help_text, const)
        if list(buckets) != sorted(buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = self.header()
        acc = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += n
            lines.append(f"{self.name}_bucket{self._lbl((), [('le', _num(bound))])} {acc}")
        lines.append(f"{self.name}_sum{self._lbl(())} {_num(self.sum)}")
        lines.append(f"{self.name}_count{self._lbl(())} {self.count}")
        return lines


@dataclass
class EngineSnapshot:
    """What the engine thread publishes after each loop turn (read by /metrics and admission)."""

    running: int = 0  # sequences in the running batch
    waiting: int = 0  # handed over but not running: in the hand-off queue or the scheduler's queue
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    preemptions: int = 0  # cumulative, from the scheduler
    steps: int = 0  # engine steps run so far
    spec_proposed: int = 0  # speculative decoding, cumulative: proposals verified
    spec_accepted: int = 0  # of which accepted
    spec_position_proposed: tuple[int, ...] = ()  # per draft position (0 = the first proposal)
    spec_position_accepted: tuple[int, ...] = ()


@dataclass
class ServingMetrics:
    """Every metric of one served artifact, with its constant labels."""

    model_name: str
    model_version: str
    manifest_sha256: str
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        c = (("model_name", self.model_name), ("model_version", self.model_version),
             ("manifest_sha256", self.manifest_sha256))
        p = "optimize_"
        self.queue_time = Histogram(p + "request_queue_time_seconds",
                                    "Time from receipt to the first scheduled chunk.", c, LATENCY_BUCKETS)
        self.prefill_time = Histogram(p + "request_prefill_time_seconds",
                                      "Time from the first scheduled chunk to the first token.", c, LATENCY_BUCKETS)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Time from receipt to the first generated token.", c, LATENCY_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", c, TOKEN_BUCKETS)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", c, TOKEN_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds",
                             "Time from receipt to the last token.", c, LATENCY_BUCKETS)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens handed to the engine.", c)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens sent to clients.", c)
        self.finished = Counter(p + "requests_finished_total", "Finished requests by finish reason.", c,
                                ["finish_reason"])
        self.rejected = Counter(p + "requests_rejected_total",
                                "Requests refused before reaching the engine, by reason.", c, ["reason"])
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch.", c)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests accepted and not running.", c)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV cache blocks in use.", c)
        self.kv_free = Gauge(p + "kv_blocks_free", "KV cache blocks free.", c)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", c)
        self.prefix_queries = Counter(p + "prefix_cache_queries_total",
                                      "Prompt tokens of scheduled requests (prefix-cache lookups).", c)
        self.prefix_hits = Counter(p + "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", c)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "Prefix-cache hits / queries since start.", c)
        self.preemptions = Counter(p + "preemptions_total", "Sequences preempted (blocks freed, recomputed).", c)
        self.spec_draft = Counter(p + "spec_decode_draft_tokens_total", "Speculative proposals verified.", c)
        self.spec_accepted = Counter(p + "spec_decode_accepted_tokens_total", "Speculative proposals accepted.", c)
        self.spec_rate = Gauge(p + "spec_decode_acceptance_rate", "Accepted / verified proposals since start.", c)
        self.spec_draft_pos = Counter(p + "spec_decode_draft_tokens_per_pos_total",
                                      "Speculative proposals verified, by draft position (0: first).", c, ["position"])
        self.spec_accepted_pos = Counter(p + "spec_decode_accepted_tokens_per_pos_total",
                                         "Speculative proposals accepted, by draft position (0: first).", c,
                                         ["position"])
        self.spec_rate_pos = GaugeVec(p + "spec_decode_acceptance_rate_per_pos",
                                      "Accepted / verified proposals at each draft position since start.", c,
                                      ["position"])
        self.open_connections = Gauge(p + "open_connections", "HTTP connections open now.", c)
        self.dropped = Counter(p + "connections_dropped_total",
                               "Connections closed by the server (slow or excess clients), by reason.", c, ["reason"])
        self._all: list[Counter | Gauge | Histogram] = [
            self.queue_time, self.prefill_time, self.ttft, self.itl, self.tpot, self.e2e,
            self.prompt_tokens, self.generation_tokens, self.finished, self.rejected,
            self.running, self.waiting, self.kv_used, self.kv_free, self.kv_usage,
            self.prefix_queries, self.prefix_hits, self.prefix_hit_rate, self.preemptions,
            self.spec_draft, self.spec_accepted, self.spec_rate, self.spec_draft_pos, self.spec_accepted_pos,
            self.spec_rate_pos, self.open_connections, self.dropped,
        ]
        for reason in ("stop", "length", "abort", "timeout"):
            self.finished.values[(reason,)] = 0.0

    # ---- updates (engine thread) --------------------------------------------------------------

    def set_snapshot(self, s: EngineSnapshot) -> None:
        with self.lock:
            self.running.set(s.running)
            self.waiting.set(s.waiting)
            self.kv_used.set(s.kv_blocks_used)
            self.kv_free.set(s.kv_blocks_free)
            total = s.kv_blocks_used + s.kv_blocks_free
            self.kv_usage.set(s.kv_blocks_used / total if total else 0.0)
            self.preemptions.values[()] = float(s.preemptions)
            self.spec_draft.values[()] = float(s.spec_proposed)
            self.spec_accepted.values[()] = float(s.spec_accepted)
            self.spec_rate.set(s.spec_accepted / s.spec_proposed if s.spec_proposed else 0.0)
            for j, (n, a) in enumerate(zip(s.spec_position_proposed, s.spec_position_accepted, strict=True)):
                self.spec_draft_pos.values[(str(j),)] = float(n)
                self.spec_accepted_pos.values[(str(j),)] = float(a)
                self.spec_rate_pos.set(a / n if n else 0.0, position=str(j))

    def request_scheduled(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self.lock:
            self.prefix_queries.inc(prompt_tokens)
            self.prefix_hits.inc(cached_tokens)
            q = self.prefix_queries.get()
            self.prefix_hit_rate.set(self.prefix_hits.get() / q if q else 0.0)

    def tokens(self, n: int, gaps: Iterable[float] = ()) -> None:
        with self.lock:
            self.generation_tokens.inc(n)
            for g in gaps:
                self.itl.observe(g)

    def request_finished(self, reason: str, *, queue: float | None = None, prefill: float | None = None,
                         ttft: float | None = None, tpot: float | None = None, e2e: float | None = None) -> None:
        with self.lock:
            self.finished.inc(finish_reason=reason)
            for hist, value in ((self.queue_time, queue), (self.prefill_time, prefill), (self.ttft, ttft),
                                (self.tpot, tpot), (self.e2e, e2e)):
                if value is not None:
                    hist.observe(max(0.0, value))

    # ---- updates (HTTP thread) ----------------------------------------------------------------

    def add_prompt_tokens(self, n: int) -> None:
        with self.lock:
            self.prompt_tokens.inc(n)

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected.inc(reason=reason)

    def set_open_connections(self, n: int) -> None:
        with self.lock:
            self.open_connections.set(n)

    def drop(self, reason: str) -> None:
        with self.lock:
            self.dropped.inc(reason=reason)

    def mean_e2e(self) -> float | None:
        with self.lock:
            return self.e2e.sum / self.e2e.count if self.e2e.count else None

    # ---- exposition ---------------------------------------------------------------------------

    def render(self) -> str:
        with self.lock:
            lines: list[str] = []
            for m in self._all:
                lines.extend(m.render())
        return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """`{'name{labels}': value}` of a text exposition (for tests and tools; labels kept verbatim)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
