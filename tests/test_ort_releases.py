"""The features that need a later ONNX Runtime release than pyproject's floor (runtime/ort_releases.py): the
build refuses them before any work on an older release, naming the release that runs them; the runtime's side
(an FP8 KV cache loaded on an older release) is checked in tests/test_quant_build.py on a real artifact."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT

from compiler.build import build
from compiler.context import BuildError
from compiler.passes.quantize_fp8 import Fp8Options, QuantizeFp8Pass
from compiler.passes.quantize_kv_cache import KvCacheOptions, QuantizeKvCachePass
from runtime import ort_releases
from runtime.ort_releases import FP8_ACTIVATIONS_CPU, FP8_KV_CACHE, missing, release


def test_a_release_runs_a_feature_from_its_first_release_on() -> None:
    assert release("1.27.0") == (1, 27) and release("1.32.0rc1") == (1, 32) and release("dev") == (0, 0)
    assert missing(FP8_ACTIVATIONS_CPU, "1.28.0") is None and missing(FP8_ACTIVATIONS_CPU, "2.0.0") is None
    why = missing(FP8_ACTIVATIONS_CPU, "1.27.0")
    assert why is not None and why.startswith("FP8 activations on the CPU execution provider: needs onnxruntime "
                                              ">= 1.28, and this is onnxruntime 1.27.0, where ")
    assert "QGemm" in why and why.endswith("pip install 'onnxruntime>=1.28'")
    assert missing(FP8_KV_CACHE, "1.24.4") is None
    assert "needs onnxruntime >= 1.24, and this is onnxruntime 1.23.2" in (missing(FP8_KV_CACHE, "1.23.2") or "")
    assert missing(FP8_KV_CACHE, "dev") is not None  # unreadable: too old for every feature


def _target(backend: str, device: str) -> SimpleNamespace:
    return SimpleNamespace(target=SimpleNamespace(backend=backend, device=device))


def test_the_passes_ask_only_where_the_feature_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort_releases, "installed", lambda: "1.20.1")
    cpu, cuda, torch_cuda = _target("onnxruntime", "cpu"), _target("onnxruntime", "cuda"), _target("torch", "cuda")
    for activations in ("static", "dynamic"):
        assert "needs onnxruntime >= 1.28" in (QuantizeFp8Pass(Fp8Options(activations=activations))
                                               .check_environment(cpu) or "")
    assert QuantizeFp8Pass(Fp8Options(activations="none")).check_environment(cpu) is None  # weights only
    assert QuantizeFp8Pass(Fp8Options()).check_environment(cuda) is None  # the fusion is the CPU provider's
    assert QuantizeFp8Pass(Fp8Options()).check_environment(torch_cuda) is None
    assert "needs onnxruntime >= 1.24" in (QuantizeKvCachePass(KvCacheOptions(dtype="fp8")).check_environment(cpu)
                                           or "")
    assert QuantizeKvCachePass(KvCacheOptions(dtype="int8")).check_environment(cpu) is None
    assert QuantizeKvCachePass(KvCacheOptions(dtype="fp8")).check_environment(torch_cuda) is None
    monkeypatch.setattr(ort_releases, "installed", lambda: "1.28.0")
    assert QuantizeFp8Pass(Fp8Options()).check_environment(cpu) is None
    assert QuantizeKvCachePass(KvCacheOptions(dtype="fp8")).check_environment(cpu) is None


def test_an_fp8_build_on_an_older_release_is_refused_before_any_work(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """recipes/demo-fp8.yaml (static FP8 activations) on a release that cannot run them: refused before
    calibration, naming the pass and the release, and nothing is written."""
    monkeypatch.setattr(ort_releases, "installed", lambda: "1.27.0")
    out = tmp_path / "artifacts"
    with pytest.raises(BuildError, match=r"pass 'quantize_fp8': FP8 activations on the CPU execution provider: "
                                         r"needs onnxruntime >= 1.28, and this is onnxruntime 1.27.0"):
        build(ROOT / "recipes" / "demo-fp8.yaml", progress=False, output=out)
    assert not out.exists() or not any(out.rglob("*"))
