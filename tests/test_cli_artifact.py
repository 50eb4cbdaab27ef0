"""A built artifact through the CLI and the runtime: verify, inspect, compatibility, thinness, generate, eval."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import DEMO_MODEL, ROOT

from runtime.artifact import SCHEMA_VERSION, ArtifactError

CLI = [sys.executable, "-m", "compiler.cli"]
HEAVY = ("torch", "compiler", "transformers", "onnx")


def run_cli(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def corrupted(demo_artifact: Path, tmp_path: Path) -> Path:
    """A copy of the demo artifact with one byte flipped in the middle of model.onnx.data."""
    copy = tmp_path / "corrupted"
    shutil.copytree(demo_artifact, copy)
    data = copy / "model.onnx.data"
    size = data.stat().st_size
    assert size > 1000
    with data.open("r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([b[0] ^ 0xFF]))
    assert data.stat().st_size == size
    return copy


@pytest.fixture
def future_schema(demo_artifact: Path, tmp_path: Path) -> Path:
    """A copy of the demo artifact whose manifest says schema_version 2.0.0."""
    copy = tmp_path / "future"
    shutil.copytree(demo_artifact, copy)
    path = copy / "manifest.json"
    text = path.read_text(encoding="utf-8")
    old = f'"schema_version": "{SCHEMA_VERSION}"'
    assert old in text
    path.write_text(text.replace(old, '"schema_version": "2.0.0"'), encoding="utf-8")
    return copy


def names_both_versions(message: str) -> bool:
    major = SCHEMA_VERSION.split(".")[0]
    return "2.0.0" in message and (SCHEMA_VERSION in message or f"{major}.x" in message)


# ------------------------------------------------------------------------------------------- verify


def test_verify_intact_artifact(demo_artifact: Path) -> None:
    res = run_cli("verify", demo_artifact)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok: pycode-llama-6m 1.0.0"), res.stdout
    assert "FAILED" not in res.stderr


def test_verify_detects_flipped_byte(corrupted: Path) -> None:
    res = run_cli("verify", corrupted)
    assert res.returncode != 0, res.stdout
    failed = [ln for ln in res.stderr.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 1, res.stderr
    assert "model.onnx.data" in failed[0] and "sha256 differs" in failed[0], failed
    assert not res.stdout.startswith("ok")


def test_engine_refuses_corrupted_artifact(corrupted: Path) -> None:
    from runtime import LLM
    from runtime.engine import LLMEngine

    with pytest.raises(ArtifactError, match=r"model\.onnx\.data"):
        LLMEngine(corrupted)
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data"):
        LLM(corrupted)


# ------------------------------------------------------------------------------------------- schema


def test_newer_schema_is_refused_everywhere(future_schema: Path) -> None:
    for cmd in ("verify", "inspect"):
        res = run_cli(cmd, future_schema)
        assert res.returncode != 0, (cmd, res.stdout)
        assert names_both_versions(res.stderr), (cmd, res.stderr)
        assert "Traceback" not in res.stderr
    res = run_cli("inspect", "--json", future_schema)
    assert res.returncode != 0 and names_both_versions(res.stderr), res.stderr

    from runtime.engine import LLMEngine

    with pytest.raises(ArtifactError) as info:
        LLMEngine(future_schema)
    assert names_both_versions(str(info.value)), str(info.value)


# ------------------------------------------------------------------------------------------- inspect


def test_inspect_summary(demo_artifact: Path) -> None:
    manifest = json.loads((demo_artifact / "manifest.json").read_text(encoding="utf-8"))
    res = run_cli("inspect", demo_artifact)
    assert res.returncode == 0, res.stderr
    rows = {}
    for line in res.stdout.splitlines():
        key, _, value = line.partition("  ")
        rows[key.strip()] = value.strip()
    assert rows["name"] == "pycode-llama-6m"
    assert rows["version"] == "1.0.0"
    assert rows["source sha256"] == manifest["source"]["sha256"]
    assert len(manifest["source"]["sha256"]) == 64
    for p in ("capture", "lower_onnx", "package"):
        assert f"pass {p}" in rows, res.stdout


def test_inspect_json_equals_manifest(demo_artifact: Path) -> None:
    res = run_cli("inspect", "--json", demo_artifact)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == json.loads((demo_artifact / "manifest.json").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------- thin runtime


def test_serving_imports_no_torch_and_no_compiler(demo_artifact: Path) -> None:
    res = run_python(f"""
        import json, sys
        from runtime import LLM, SamplingParams
        llm = LLM({str(demo_artifact)!r})
        out = llm.generate(["def f(x):\\n    return"], SamplingParams(max_tokens=8, temperature=0))
        heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})
        print(json.dumps({{"heavy": heavy, "tokens": len(out[0].token_ids), "reason": out[0].finish_reason}}))
    """)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], result["heavy"]
    assert result["tokens"] == 8, result
    assert result["reason"] == "length"


@pytest.mark.parametrize("args", [["verify"], ["inspect"], ["inspect", "--json"]], ids=" ".join)
def test_verify_and_inspect_import_no_torch(demo_artifact: Path, args: list[str]) -> None:
    res = run_python(f"""
        import json, sys
        from compiler.cli import main
        main({[*args, str(demo_artifact)]!r}, standalone_mode=False)
        heavy = sorted(m for m in sys.modules if m.split('.')[0] in ("torch", "onnx", "transformers", "onnxscript"))
        print(json.dumps(heavy))
    """)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


# ------------------------------------------------------------------------------------------- generate / eval


def test_generate_streams_prompt_and_continuation(demo_artifact: Path) -> None:
    res = run_cli("generate", demo_artifact, "def fibonacci(n):\\n    if", "--max-tokens", "16")
    assert res.returncode == 0, res.stderr
    prompt = "def fibonacci(n):\n    if"
    assert res.stdout.startswith(prompt), repr(res.stdout)
    continuation = res.stdout[len(prompt):]
    assert continuation.strip(), repr(res.stdout)
    assert "16 tokens" in res.stderr or "finish: stop" in res.stderr, res.stderr


def test_eval_json_perplexity(demo_artifact: Path) -> None:
    res = run_cli("eval", demo_artifact, "--data", DEMO_MODEL / "eval.txt", "--max-tokens", "2048", "--json")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    ppl = result["perplexity"]
    assert isinstance(ppl, float) and math.isfinite(ppl)
    assert 5 < ppl < 30, ppl
    assert result["chunks"] == 2048 // 256
    assert result["predictions"] == result["chunks"] * 255


def test_eval_against_a_reference_reports_the_paired_change(demo_artifact: Path) -> None:
    """An artifact against itself: every chunk difference is 0, so the change, its se and the interval are 0."""
    res = run_cli("eval", demo_artifact, "--data", DEMO_MODEL / "eval.txt", "--max-tokens", "1024", "--json",
                  "--reference", demo_artifact)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["reference"]["perplexity"] == result["perplexity"]
    d = result["delta"]
    assert d["chunks"] == 4 and d["z"] == pytest.approx(1.959964, abs=1e-6)
    assert d["increase_pct"] == d["increase_se_pct"] == d["ci_low_pct"] == d["ci_high_pct"] == 0.0
    res = run_cli("eval", demo_artifact, "--data", DEMO_MODEL / "eval.txt", "--max-tokens", "512",
                  "--reference", demo_artifact)
    assert res.returncode == 0, res.stderr
    assert "change +0.000% +- 0.000%" in res.stdout and "95% interval [+0.000%, +0.000%]" in res.stdout, res.stdout
