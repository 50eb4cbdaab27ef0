"""Serving metrics for `/metrics`, exposed with `prometheus-client` under two sets of names.

`ServingMetrics` holds every metric the server exports. The engine thread records request phases
and tokens; the HTTP thread renders `/metrics`. One lock guards the updates that touch several
metrics at once (a few additions each, negligible next to a model step).

The `optimize_*` names carry the artifact's labels (`model_name`, `model_version`,
`manifest_sha256`), so several artifacts scraped into one Prometheus stay apart:

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

The `vllm:*` names are the ones vLLM exports and LLM-aware routers scrape (the Gateway API
Inference Extension's model-server protocol: queue depth, running requests, KV-cache use, cache
config; vllm-router and llm-d read the same), with vLLM's types and meanings; they carry the same
labels plus `engine="0"`:

    vllm:num_requests_running / _waiting           gauge      = optimize_num_requests_running / _waiting
    vllm:kv_cache_usage_perc                       gauge      used / total KV blocks, a fraction in [0, 1]
    vllm:gpu_cache_usage_perc                      gauge      the same under its pre-v1 name (older pickers)
    vllm:cache_config_info{block_size, num_gpu_blocks, enable_prefix_caching}  gauge  1 (info)
    vllm:prefix_cache_queries_total / _hits_total  counter    tokens looked up / served from the prefix cache
    vllm:num_preemptions_total                     counter    = optimize_preemptions_total
    vllm:prompt_tokens_total / generation_tokens_total  counter  = the optimize_ counters
    vllm:request_success_total{finished_reason}    counter    stop | length | abort (timeouts count as abort)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds,
    vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds,
    vllm:request_time_per_output_token_seconds     histogram  = the optimize_ histograms

Latency histograms cover requests that finished with `stop` or `length`; aborted and timed-out
requests only count in the finished counters.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["ServingMetrics", "EngineSnapshot", "CONTENT_TYPE", "parse_prometheus"]

# The text format generate_latest writes (Prometheus 0.0.4; metric names here are all legacy-valid).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket upper bounds (seconds). Wide enough for a CPU demo and a GPU server alike.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

_VLLM_REASON = {"stop": "stop", "length": "length", "abort": "abort", "timeout": "abort"}


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


class _Count:
    """A counter under its optimize_ name and, where vLLM has one, its vllm: name. Plain numbers,
    updated under ServingMetrics.lock and turned into metric families at scrape time (an update is a
    dict addition, not a library call with its own lock)."""

    def __init__(self, name: str, doc: str, label_names: Sequence[str] = (),
                 vllm: tuple[str, str] | None = None) -> None:
        self.name, self.doc, self.label_names, self.vllm = name, doc, tuple(label_names), vllm
        self.values: dict[tuple[str, ...], float] = {} if label_names else {(): 0.0}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.label_names)}")
        return tuple(labels[n] for n in self.label_names)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def touch(self, **labels: str) -> None:
        """Create the labelled series at 0 (so it is scraped before its first increment)."""
        self.values.setdefault(self._key(labels), 0.0)

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def families(self, names: list[str], values: list[str]) -> Iterator[Metric]:
        c = CounterMetricFamily(self.name, self.doc, labels=[*names, *self.label_names])
        for key, v in sorted(self.values.items()):
            c.add_metric([*values, *key], v)
        yield c
        if self.vllm is not None:
            v = CounterMetricFamily(self.vllm[0], self.vllm[1], labels=[*names, "engine"])
            v.add_metric([*values, "0"], self.values[()])
            yield v


class _Hist:
    """A histogram under its optimize_ name and its vllm: name (plain numbers, like _Count)."""

    def __init__(self, name: str, vllm_name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name, self.vllm_name, self.doc = name, vllm_name, doc
        self.bounds = tuple(float(b) for b in buckets)
        self.les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le is inclusive
        self.sum += value
        self.count += 1

    def families(self, names: list[str], values: list[str]) -> Iterator[Metric]:
        cumulative = list(itertools.accumulate(self.counts))
        buckets = list(zip(self.les, cumulative, strict=True))
        for name, extra_names, extra in ((self.name, [], []), (self.vllm_name, ["engine"], ["0"])):
            h = HistogramMetricFamily(name, self.doc, labels=[*names, *extra_names])
            h.add_metric([*values, *extra], buckets, self.sum)
            yield h


class _SnapshotCollector(Collector):
    """The metrics read from the engine's latest snapshot (gauges, and counters the scheduler keeps)."""

    def __init__(self, owner: ServingMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        o = self.owner
        with o.lock:  # a consistent copy; the families are built outside the lock
            s, hits, queries, conns = o.snapshot, o.prefix_hits.get(), o.prefix_queries.get(), o.connections
            cache_config = dict(o.cache_config)
            recorded = copy.deepcopy(o.recorded)
        const = o.const
        names, values = list(const), list(const.values())
        vnames, vvalues = [*names, "engine"], [*values, "0"]
        total = s.kv_blocks_used + s.kv_blocks_free
        usage = s.kv_blocks_used / total if total else 0.0

        def twins(kind: type, name: str, doc: str, value: float, vllm: str | None) -> Iterator[Metric]:
            """The optimize_* series, and its vLLM-named twin (with the `engine` label) where there is one."""
            for metric, labels, label_values in ((name, names, values), (vllm, vnames, vvalues)):
                if metric is not None:
                    f = kind(metric, doc, labels=labels)
                    f.add_metric(label_values, value)
                    yield f

        def gauge(name: str, doc: str, value: float, vllm: str | None = None) -> Iterator[Metric]:
            return twins(GaugeMetricFamily, name, doc, value, vllm)

        def counter(name: str, doc: str, value: float, vllm: str | None = None) -> Iterator[Metric]:
            return twins(CounterMetricFamily, name, doc, value, vllm)

        p = "optimize_"
        yield from gauge(p + "num_requests_running", "Requests in the running batch.", s.running,
                         "vllm:num_requests_running")
        yield from gauge(p + "num_requests_waiting", "Requests accepted and not running.", s.waiting,
                         "vllm:num_requests_waiting")
        yield from gauge(p + "kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
        yield from gauge(p + "kv_blocks_free", "KV cache blocks free.", s.kv_blocks_free)
        yield from gauge(p + "kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", usage,
                         "vllm:kv_cache_usage_perc")
        yield from gauge("vllm:gpu_cache_usage_perc", "Fraction of KV cache blocks in use (pre-v1 name).", usage)
        yield from gauge(p + "prefix_cache_hit_rate", "Prefix-cache hits / queries since start.",
                         hits / queries if queries else 0.0)
        yield from counter(p + "preemptions", "Sequences preempted (blocks freed, recomputed).", s.preemptions,
                           "vllm:num_preemptions")
        yield from counter(p + "spec_decode_draft_tokens", "Speculative proposals verified.", s.spec_proposed)
        yield from counter(p + "spec_decode_accepted_tokens", "Speculative proposals accepted.", s.spec_accepted)
        yield from gauge(p + "spec_decode_acceptance_rate", "Accepted / verified proposals since start.",
                         s.spec_accepted / s.spec_proposed if s.spec_proposed else 0.0)
        per_pos = [
            (CounterMetricFamily(p + "spec_decode_draft_tokens_per_pos",
                                 "Speculative proposals verified, by draft position (0: first).",
                                 labels=[*names, "position"]), s.spec_position_proposed),
            (CounterMetricFamily(p + "spec_decode_accepted_tokens_per_pos",
                                 "Speculative proposals accepted, by draft position (0: first).",
                                 labels=[*names, "position"]), s.spec_position_accepted),
        ]
        rate = GaugeMetricFamily(p + "spec_decode_acceptance_rate_per_pos",
                                 "Accepted / verified proposals at each draft position since start.",
                                 labels=[*names, "position"])
        for j, (n, a) in enumerate(zip(s.spec_position_proposed, s.spec_position_accepted, strict=True)):
            rate.add_metric([*values, str(j)], a / n if n else 0.0)
        for family, counts in per_pos:
            for j, n in enumerate(counts):
                family.add_metric([*values, str(j)], n)
            yield family
        yield rate
        yield from gauge(p + "open_connections", "HTTP connections open now.", conns)
        for m in recorded:
            yield from m.families(names, values)
        if cache_config:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                                     labels=[*vnames, *cache_config])
            info.add_metric([*vvalues, *cache_config.values()], 1.0)
            yield info


@dataclass
class ServingMetrics:
    """Every metric of one served artifact, with its constant labels, in a registry of its own."""

    model_name: str
    model_version: str
    manifest_sha256: str
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.const = {"model_name": self.model_name, "model_version": self.model_version,
                      "manifest_sha256": self.manifest_sha256}
        self.registry = CollectorRegistry(auto_describe=False)
        self.snapshot = EngineSnapshot()
        self.connections = 0
        self.cache_config: dict[str, str] = {}
        p = "optimize_"
        self.queue_time = _Hist(p + "request_queue_time_seconds", "vllm:request_queue_time_seconds",
                                "Time from receipt to the first scheduled chunk.", LATENCY_BUCKETS)
        self.prefill_time = _Hist(p + "request_prefill_time_seconds", "vllm:request_prefill_time_seconds",
                                  "Time from the first scheduled chunk to the first token.", LATENCY_BUCKETS)
        self.ttft = _Hist(p + "time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                          "Time from receipt to the first generated token.", LATENCY_BUCKETS)
        self.itl = _Hist(p + "inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
                         "Time between consecutive generated tokens of a request.", TOKEN_BUCKETS)
        self.tpot = _Hist(p + "time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
                          "Mean time per output token after the first, per request.", TOKEN_BUCKETS)
        self.e2e = _Hist(p + "e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                         "Time from receipt to the last token.", LATENCY_BUCKETS)
        self.prompt_tokens = _Count(p + "prompt_tokens_total", "Prompt tokens handed to the engine.",
                                    vllm=("vllm:prompt_tokens", "Number of prefill tokens processed."))
        self.generation_tokens = _Count(p + "generation_tokens_total", "Generated tokens sent to clients.",
                                        vllm=("vllm:generation_tokens", "Number of generation tokens processed."))
        self.finished = _Count(p + "requests_finished_total", "Finished requests by finish reason.",
                               ["finish_reason"])
        self.success = _Count("vllm:request_success_total", "Finished requests by finished_reason.",
                              ["engine", "finished_reason"])
        self.rejected = _Count(p + "requests_rejected_total",
                               "Requests refused before reaching the engine, by reason.", ["reason"])
        self.prefix_queries = _Count(p + "prefix_cache_queries_total",
                                     "Prompt tokens of scheduled requests (prefix-cache lookups).",
                                     vllm=("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens."))
        self.prefix_hits = _Count(p + "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                                  vllm=("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens."))
        self.dropped = _Count(p + "connections_dropped_total",
                              "Connections closed by the server (slow or excess clients), by reason.", ["reason"])
        for reason in ("stop", "length", "abort", "timeout"):
            self.finished.touch(finish_reason=reason)
        for reason in ("stop", "length", "abort"):
            self.success.touch(engine="0", finished_reason=reason)
        self.recorded = [self.queue_time, self.prefill_time, self.ttft, self.itl, self.tpot, self.e2e,
                         self.prompt_tokens, self.generation_tokens, self.finished, self.success, self.rejected,
                         self.prefix_queries, self.prefix_hits, self.dropped]
        self.registry.register(_SnapshotCollector(self))

    # ---- updates (engine thread) --------------------------------------------------------------

    def set_snapshot(self, s: EngineSnapshot) -> None:
        with self.lock:
            self.snapshot = s

    def set_cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """The KV cache's shape, exported as vllm:cache_config_info (routers read the block size)."""
        with self.lock:
            self.cache_config = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks),
                                 "enable_prefix_caching": str(bool(prefix_caching))}

    def request_scheduled(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self.lock:
            self.prefix_queries.inc(prompt_tokens)
            self.prefix_hits.inc(cached_tokens)

    def tokens(self, n: int, gaps: Iterable[float] = ()) -> None:
        with self.lock:
            self.generation_tokens.inc(n)
            for g in gaps:
                self.itl.observe(g)

    def request_finished(self, reason: str, *, queue: float | None = None, prefill: float | None = None,
                         ttft: float | None = None, tpot: float | None = None, e2e: float | None = None) -> None:
        with self.lock:
            self.finished.inc(finish_reason=reason)
            self.success.inc(engine="0", finished_reason=_VLLM_REASON.get(reason, "abort"))
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
            self.connections = n

    def drop(self, reason: str) -> None:
        with self.lock:
            self.dropped.inc(reason=reason)

    def mean_e2e(self) -> float | None:
        with self.lock:
            return self.e2e.sum / self.e2e.count if self.e2e.count else None

    # ---- exposition ---------------------------------------------------------------------------

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")


def parse_prometheus(text: str) -> dict[str, float]:
    """`{'name{labels}': value}` of a text exposition (for tests and tools; labels kept verbatim)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
