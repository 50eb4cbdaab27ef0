"""bench/profile_nodes.py's reading of ONNX Runtime's trace: per op type, and without the warm-up's events."""

from __future__ import annotations

from bench.profile_nodes import summarize


def _run(ts: float, dur: float) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def _node(ts: float, dur: float, op: str) -> dict:
    return {"cat": "Node", "name": f"n_{op}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_summary_adds_kernel_time_per_op_type_after_the_warm_up() -> None:
    warm = [_run(0, 5000), _node(10, 4000, "Gemm"), _node(4100, 800, "SiluMul")]
    measured = [_run(10_000, 2000), _node(10_010, 1000, "Gemm"), _node(11_020, 500, "SiluMul"),
                _run(13_000, 1000), _node(13_010, 600, "Gemm"), _node(13_700, 200, "Other")]
    whole = summarize(warm + measured)
    assert whole["runs"] == 3 and whole["run_ms"] == 8.0 and whole["ops"]["Gemm"]["ms"] == 5.6
    after = summarize(warm + measured, since_us=9000)
    assert after["runs"] == 2 and after["run_ms"] == 3.0 and after["kernel_ms"] == 2.3
    assert list(after["ops"]) == ["Gemm", "SiluMul", "Other"]  # by time, largest first
    assert after["ops"]["Gemm"] == {"ms": 1.6, "share": round(1.6 / 3.0, 4), "nodes_per_run": 1.0}
    assert after["ops"]["Other"]["nodes_per_run"] == 0.5
