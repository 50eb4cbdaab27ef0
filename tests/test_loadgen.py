"""The bench client's arithmetic: percentiles, SLO parsing, the report and its table (no server).

`tests/test_server.py::test_bench_against_server` runs `optimize bench` against a real server.
"""

from __future__ import annotations

import math
import random
import sys

import pytest

from runtime.loadgen import (
    BenchConfig,
    RequestResult,
    _lengths,
    _prompt,
    format_table,
    parse_goodput,
    percentile,
    summarize,
)


def test_percentile_matches_linear_interpolation() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0 and percentile(xs, 50) == 3.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2e:2000", "itl:100"]) == \
        {"ttft": 500.0, "tpot": 50.5, "e2e": 2000.0, "itl": 100.0}
    for bad in ("ttft", "ttft:", "ttft:-1", "speed:10", "tpot:abc"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def test_config_validation() -> None:
    BenchConfig(url="http://x").validate()
    for kw in ({"endpoint": "edits"}, {"prompt_kind": "ids", "endpoint": "chat"}, {"num_requests": 0},
               {"concurrency": 0}, {"request_rate": 0.0}, {"range_ratio": 1.0}, {"goodput": {"speed": 1.0}}):
        with pytest.raises(ValueError):
            BenchConfig(url="http://x", **kw).validate()  # type: ignore[arg-type]


def test_lengths_and_prompts() -> None:
    rng = random.Random(0)
    cfg = BenchConfig(url="http://x", num_requests=200, input_len=100, output_len=10, range_ratio=0.5)
    lengths = _lengths(cfg, rng)
    assert len(lengths) == 200 and len({n for n, _ in lengths}) > 10
    assert all(50 <= n <= 150 and 5 <= m <= 15 for n, m in lengths)
    fixed = _lengths(BenchConfig(url="http://x", num_requests=3, input_len=7, output_len=9), rng)
    assert fixed == [(7, 9)] * 3
    ids = _prompt(BenchConfig(url="http://x", prompt_kind="ids"), 32, rng)
    assert isinstance(ids, list) and len(ids) == 32 and all(100 <= t < 1000 for t in ids)
    text = _prompt(BenchConfig(url="http://x"), 32, rng)
    assert isinstance(text, str) and len(text.split()) == 32


def _result(ttft: float, itl: list[float], out: int, ok: bool = True, status: int = 200) -> RequestResult:
    e2e = ttft + sum(itl)
    return RequestResult(ok, status, None if ok else "x", 10, out, 10, out if ok else 0, ttft if ok else None,
                         itl, e2e, 0.0)


def test_summary_numbers_and_goodput() -> None:
    cfg = BenchConfig(url="http://x", num_requests=4, input_len=10, output_len=5, goodput={"ttft": 150.0})
    results = [_result(0.1, [0.01] * 4, 5), _result(0.2, [0.02] * 4, 5), _result(0.1, [0.01] * 4, 5),
               _result(0.0, [], 0, ok=False, status=429)]
    rep = summarize(cfg, results, duration=2.0, model="m")
    assert rep["requests"] == {"total": 4, "completed": 3, "failed": 1, "errors": {"429": 1}}
    assert rep["tokens"]["output"] == 15 and rep["tokens"]["input"] == 30
    assert rep["throughput"]["requests_per_s"] == pytest.approx(1.5)
    assert rep["throughput"]["output_tokens_per_s"] == pytest.approx(7.5)
    lat = rep["latency_ms"]
    assert lat["ttft"]["p50"] == pytest.approx(100.0) and lat["ttft"]["max"] == pytest.approx(200.0)
    assert lat["tpot"]["mean"] == pytest.approx((10 + 20 + 10) / 3)  # (e2e - ttft) / (out - 1)
    assert lat["itl"]["p99"] == pytest.approx(20.0)
    assert rep["goodput"]["requests_met"] == 2 and rep["goodput"]["requests_per_s"] == pytest.approx(1.0)
    table = format_table(rep)
    for label in ("TTFT", "ITL", "TPOT", "E2E", "goodput", "3 / 1"):
        assert label in table


def test_loadgen_imports_neither_torch_nor_the_engine() -> None:
    import subprocess

    code = ("import sys, runtime.loadgen; bad = {'torch', 'numpy', 'onnxruntime', 'compiler'} & "
            "{m.split('.')[0] for m in sys.modules}; print(sorted(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
