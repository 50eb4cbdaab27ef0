"""runtime/metrics.py: the exposition under the optimize_ and the vLLM names (no server)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.metrics import EngineSnapshot, ServingMetrics, parse_prometheus

L = {"model_name": "m", "model_version": "1.0.0", "manifest_sha256": "ab"}


def _recorded() -> ServingMetrics:
    m = ServingMetrics("m", "1.0.0", "ab")
    m.set_snapshot(EngineSnapshot(running=2, waiting=3, kv_blocks_used=10, kv_blocks_free=30, preemptions=1))
    m.set_cache_config(16, 40, True)
    m.request_scheduled(100, 25)
    m.tokens(5, [0.01, 0.02])
    m.request_finished("length", queue=0.1, prefill=0.2, ttft=0.3, tpot=0.01, e2e=0.5)
    m.request_finished("abort")
    m.request_finished("timeout")
    m.add_prompt_tokens(100)
    m.reject("queue_full")
    return m


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], tuple[str, float]]:
    """(sample name, labels) -> (family type, value), parsed by prometheus-client's own parser."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = (fam.type, s.value)
    return out


def _get(samples: dict, name: str, **labels: str) -> tuple[str, float]:
    return samples[(name, frozenset({**L, **labels}.items()))]


def test_optimize_names_types_and_values() -> None:
    s = _samples(_recorded().render())
    assert _get(s, "optimize_num_requests_running") == ("gauge", 2)
    assert _get(s, "optimize_kv_cache_usage_ratio") == ("gauge", 0.25)
    assert _get(s, "optimize_prefix_cache_hit_rate") == ("gauge", 0.25)
    assert _get(s, "optimize_preemptions_total") == ("counter", 1)
    assert _get(s, "optimize_generation_tokens_total") == ("counter", 5)
    assert _get(s, "optimize_inter_token_latency_seconds_count") == ("histogram", 2)
    assert _get(s, "optimize_requests_finished_total", finish_reason="length") == ("counter", 1)
    assert _get(s, "optimize_requests_finished_total", finish_reason="abort") == ("counter", 1)
    assert _get(s, "optimize_requests_finished_total", finish_reason="stop") == ("counter", 0)
    assert _get(s, "optimize_requests_rejected_total", reason="queue_full") == ("counter", 1)
    assert _get(s, "optimize_e2e_request_latency_seconds_count") == ("histogram", 1)  # aborted: counter only
    assert _get(s, "optimize_e2e_request_latency_seconds_bucket", le="0.5") == ("histogram", 1)  # le inclusive
    assert _get(s, "optimize_e2e_request_latency_seconds_bucket", le="0.25") == ("histogram", 0)


def test_vllm_names_routers_scrape() -> None:
    """The model-server-protocol names, with vLLM's types and units (usage is a fraction, not percent)."""
    s = _samples(_recorded().render())
    e = {"engine": "0"}
    assert _get(s, "vllm:num_requests_running", **e) == ("gauge", 2)
    assert _get(s, "vllm:num_requests_waiting", **e) == ("gauge", 3)
    assert _get(s, "vllm:kv_cache_usage_perc", **e) == ("gauge", 0.25)
    assert _get(s, "vllm:gpu_cache_usage_perc") == ("gauge", 0.25)
    assert _get(s, "vllm:prefix_cache_queries_total", **e) == ("counter", 100)
    assert _get(s, "vllm:prefix_cache_hits_total", **e) == ("counter", 25)
    assert _get(s, "vllm:num_preemptions_total", **e) == ("counter", 1)
    assert _get(s, "vllm:prompt_tokens_total", **e) == ("counter", 100)
    assert _get(s, "vllm:generation_tokens_total", **e) == ("counter", 5)
    assert _get(s, "vllm:request_success_total", finished_reason="length", **e) == ("counter", 1)
    assert _get(s, "vllm:request_success_total", finished_reason="abort", **e) == ("counter", 2)  # + timeout
    assert _get(s, "vllm:time_to_first_token_seconds_count", **e) == ("histogram", 1)
    assert _get(s, "vllm:inter_token_latency_seconds_count", **e) == ("histogram", 2)
    assert _get(s, "vllm:e2e_request_latency_seconds_sum", **e) == ("histogram", 0.5)
    assert _get(s, "vllm:cache_config_info", block_size="16", num_gpu_blocks="40", enable_prefix_caching="True",
                **e) == ("gauge", 1)


def test_accessors_and_plain_parser() -> None:
    m = _recorded()
    assert m.generation_tokens.get() == 5 and m.prompt_tokens.get() == 100
    assert m.finished.get(finish_reason="abort") == 1 and m.finished.get(finish_reason="stop") == 0
    assert m.mean_e2e() == pytest.approx(0.5)
    flat = parse_prometheus(m.render())
    assert any(k.startswith("vllm:num_requests_waiting{") and v == 3 for k, v in flat.items())
    assert not any("_created" in k for k in flat)


def test_every_series_is_scraped_before_its_first_event() -> None:
    s = _samples(ServingMetrics("m", "1.0.0", "ab").render())
    for name in ("optimize_prompt_tokens_total", "optimize_prefix_cache_queries_total",
                 "optimize_prefix_cache_hits_total", "optimize_generation_tokens_total"):
        assert _get(s, name) == ("counter", 0)
    assert _get(s, "vllm:prefix_cache_queries_total", engine="0") == ("counter", 0)
    assert _get(s, "optimize_e2e_request_latency_seconds_count") == ("histogram", 0)


def test_two_servers_in_one_process_keep_apart() -> None:
    """Each ServingMetrics has its own registry: no clash on the names, no shared counts."""
    a, b = ServingMetrics("a", "1", "x"), ServingMetrics("b", "1", "y")
    a.add_prompt_tokens(7)
    assert a.prompt_tokens.get() == 7 and b.prompt_tokens.get() == 0
    assert 'model_name="b"' in b.render() and 'model_name="a"' not in b.render()
