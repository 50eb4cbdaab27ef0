"""guidellm (the dev extra's load generator) against `optimize serve`: its real CLI, `guidellm run`, with
the artifact's own tokenizer folder as its processor and synthetic prompts of a fixed token count, for a
bounded number of requests (a few seconds each on the demo model).

What guidellm measures must be what the server did: every request succeeded, each prompt has the tokens
guidellm asked for (counted by the server's usage, which guidellm reads from the stream), each
completion the requested output tokens (guidellm sends `ignore_eos`), the requests streamed token by
token, and the server's /metrics counted the same requests and tokens.

Nothing is downloaded: the tokenizer is a local folder and the Hugging Face libraries run offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import guidellm  # noqa: F401  (the dev extra's load generator: a hard requirement, never a skip)
import pytest
from test_server import API_KEY, MODEL, ServerProcess, post

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def server(demo_artifact: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(demo_artifact, "--api-key", API_KEY)
    yield s
    s.kill()


def _guidellm(server: ServerProcess, processor: Path, folder: Path, request_format: str, profile: str,
              requests: int, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    """`guidellm run` for `requests` requests; the one benchmark of its JSON report."""
    report = folder / "benchmarks.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={server.base},request_format={request_format},api_key={API_KEY}",
           "--profile", profile,
           "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", f"kind=huggingface_auto,model={processor}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--output", f"kind=json,path={report}",
           "--disable-console"]
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, cwd=folder, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"guidellm exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    benchmarks = json.loads(report.read_text(encoding="utf-8"))["benchmarks"]
    assert len(benchmarks) == 1
    return benchmarks[0]


def _counters(server: ServerProcess) -> dict[str, float]:
    m = server.metrics()
    return {"length": m['optimize_requests_finished_total{finish_reason="length"}'],
            "generated": m["optimize_generation_tokens_total"], "prompt": m["optimize_prompt_tokens_total"]}


def _check(bench: dict[str, Any], requests: int, output_tokens: int) -> list[dict[str, Any]]:
    """The checks common to both endpoints; the successful requests."""
    assert bench["metrics"]["request_totals"] == {"successful": requests, "errored": 0, "incomplete": 0,
                                                  "total": requests}
    done = bench["requests"]["successful"]
    assert len(done) == requests and not bench["requests"]["errored"] and not bench["requests"]["incomplete"]
    assert len({r["response_id"] for r in done}) == requests  # distinct server requests
    for r in done:
        assert r["info"]["error"] is None and r["info"]["status"] == "completed"
        assert r["output_tokens"] == output_tokens, r  # ignore_eos + max_tokens, counted by the server's usage
        assert r["output"]  # text came back
        timings = r["info"]["timings"]
        # streamed: several token chunks, the first before the last
        assert timings["token_iterations"] > 1 and timings["first_token_iteration"] < timings["last_token_iteration"]
        assert 0 < r["time_to_first_token_ms"] <= r["request_latency"] * 1000
    counts = bench["metrics"]["output_token_count"]["successful"]
    assert counts["min"] == counts["max"] == output_tokens and counts["count"] == requests
    return done


def test_guidellm_text_completions_with_concurrent_streams(server: ServerProcess, demo_artifact: Path,
                                                           tmp_path: Path) -> None:
    before = _counters(server)
    bench = _guidellm(server, demo_artifact / "tokenizer", tmp_path, "/v1/completions",
                      "kind=concurrent,streams=4", requests=12, prompt_tokens=64, output_tokens=16)
    assert bench["config"]["strategy"]["type_"] == "concurrent" and bench["config"]["strategy"]["streams"] == 4
    assert bench["config"]["backend"]["model"] == MODEL  # resolved through /v1/models
    done = _check(bench, 12, 16)
    for r in done:
        body = json.loads(r["request_args"])["body"]
        assert body["max_tokens"] == 16 and body["stream"] is True
        # the processor's 64 tokens are the server's 64 tokens (the tokenizer folder is the server's own)
        assert r["prompt_tokens"] == 64 == post(server.port, "/tokenize", {"prompt": body["prompt"]})[2]["count"]
    assert bench["metrics"]["request_concurrency"]["successful"]["max"] > 1  # the streams overlapped
    after = _counters(server)
    assert after["length"] - before["length"] == 12
    assert after["generated"] - before["generated"] == 12 * 16
    assert after["prompt"] - before["prompt"] == sum(r["prompt_tokens"] for r in done)


def test_guidellm_chat_completions_synchronous(server: ServerProcess, demo_artifact: Path, tmp_path: Path) -> None:
    before = _counters(server)
    bench = _guidellm(server, demo_artifact / "tokenizer", tmp_path, "/v1/chat/completions",
                      "kind=synchronous", requests=6, prompt_tokens=48, output_tokens=8)
    assert bench["config"]["strategy"]["type_"] == "synchronous"
    done = _check(bench, 6, 8)
    for r in done:
        body = json.loads(r["request_args"])["body"]
        assert body["max_completion_tokens"] == 8 and body["messages"][0]["role"] == "user"
        # the server's usage counts the rendered chat prompt: the messages as /tokenize renders them
        rendered = post(server.port, "/tokenize", {"messages": body["messages"]})[2]["count"]
        assert r["prompt_tokens"] == rendered > 48
    assert bench["metrics"]["request_concurrency"]["successful"]["max"] == 1
    after = _counters(server)
    assert after["length"] - before["length"] == 6
    assert after["generated"] - before["generated"] == 6 * 8
