"""runtime/metrics.py: the Prometheus text exposition, exact lines (no server)."""

from __future__ import annotations

import pytest

from runtime.metrics import Counter, EngineSnapshot, Histogram, ServingMetrics, parse_prometheus

C = (("model_name", "m"), ("model_version", "1.0.0"), ("manifest_sha256", "ab"))
L = 'model_name="m",model_version="1.0.0",manifest_sha256="ab"'


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram("x_seconds", "help", C, (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.render() == [
        "# HELP x_seconds help",
        "# TYPE x_seconds histogram",
        f'x_seconds_bucket{{{L},le="0.1"}} 2',  # le is inclusive
        f'x_seconds_bucket{{{L},le="1"}} 3',
        f'x_seconds_bucket{{{L},le="+Inf"}} 4',
        f"x_seconds_sum{{{L}}} 3.65",
        f"x_seconds_count{{{L}}} 4",
    ]
    with pytest.raises(ValueError):
        Histogram("y", "h", C, (1.0, 0.5))


def test_counter_labels_and_escaping() -> None:
    c = Counter("req_total", "help", (("model_name", 'a"b\\c\nd'),), ["reason"])
    c.inc(reason="stop")
    c.inc(2, reason="length")
    assert c.render()[2:] == ['req_total{model_name="a\\"b\\\\c\\nd",reason="length"} 2',
                              'req_total{model_name="a\\"b\\\\c\\nd",reason="stop"} 1']
    with pytest.raises(ValueError):
        c.inc(-1, reason="stop")
    with pytest.raises(ValueError):
        c.inc(other="x")


def test_serving_metrics_render_and_parse() -> None:
    m = ServingMetrics("m", "1.0.0", "ab")
    m.set_snapshot(EngineSnapshot(running=2, waiting=3, kv_blocks_used=10, kv_blocks_free=30, preemptions=1))
    m.request_scheduled(100, 25)
    m.tokens(5, [0.01, 0.02])
    m.request_finished("length", queue=0.1, prefill=0.2, ttft=0.3, tpot=0.01, e2e=0.5)
    m.request_finished("abort")
    m.add_prompt_tokens(100)
    m.reject("queue_full")
    got = parse_prometheus(m.render())
    assert got[f"optimize_num_requests_running{{{L}}}"] == 2
    assert got[f"optimize_kv_cache_usage_ratio{{{L}}}"] == 0.25
    assert got[f"optimize_prefix_cache_hit_rate{{{L}}}"] == 0.25
    assert got[f"optimize_preemptions_total{{{L}}}"] == 1
    assert got[f"optimize_generation_tokens_total{{{L}}}"] == 5
    assert got[f"optimize_inter_token_latency_seconds_count{{{L}}}"] == 2
    assert got[f'optimize_requests_finished_total{{{L},finish_reason="length"}}'] == 1
    assert got[f'optimize_requests_finished_total{{{L},finish_reason="abort"}}'] == 1
    assert got[f'optimize_requests_finished_total{{{L},finish_reason="timeout"}}'] == 0
    assert got[f'optimize_requests_rejected_total{{{L},reason="queue_full"}}'] == 1
    assert got[f"optimize_e2e_request_latency_seconds_count{{{L}}}"] == 1  # aborted: counter only
    assert m.mean_e2e() == pytest.approx(0.5)
