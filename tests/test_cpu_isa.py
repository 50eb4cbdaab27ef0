"""Which CPU code path the package's C ops run (runtime/kernels/isa_*.c), and how it is chosen and told.

The library picks the widest path the CPU runs (avx512 > avx2 > baseline) unless OPTIMIZE_CPU_ISA pins one;
the expected path is worked out here from the kernel's CPU flags (/proc/cpuinfo), not from the library's
own detection. A pin the CPU cannot run fails naming the missing features, both through the Python side
and when ONNX Runtime registers the library directly. Each path's numbers against the reference:
tests/test_paged_cpu_kernel.py and tests/test_matmul_bf16_kernel.py (parametrized over the paths).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from cpu_paths import PATHS, bf16_dot, expected_default, missing, use_path
from onnx import TensorProto, helper
from onnx_model import make_model

from runtime.kernels import paged_attention_cpu as pk

OPS = ("PagedAttention", "RotaryPagedAttention", "QuantizeRows", "MatMulBf16", "SiluMul", "SkipNormQuantize")


def test_the_default_path_is_the_widest_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPTIMIZE_CPU_ISA", raising=False)
    monkeypatch.delenv("OPTIMIZE_BF16_DOT", raising=False)
    paths = pk.select_paths()
    want = expected_default()
    assert paths["isa"] == want and paths["source"] == "cpu"
    assert paths["available"] == [p for p in PATHS if not missing(p)]
    assert set(paths["ops"]) == set(OPS)
    for op in OPS:
        assert paths["ops"][op] == ("avx512_bf16" if op == "MatMulBf16" and bf16_dot() else want), op


@pytest.mark.parametrize("path", PATHS)
def test_a_pin_selects_its_path_for_every_op(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_path(path, monkeypatch)
    monkeypatch.setenv("OPTIMIZE_BF16_DOT", "0")
    paths = pk.select_paths()
    assert paths["isa"] == path and paths["source"] == "OPTIMIZE_CPU_ISA"
    assert paths["ops"] == {op: path for op in OPS}
    assert pk.select_paths(path)["source"] == "call"


def test_a_pin_this_cpu_cannot_run_is_an_error_naming_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTIMIZE_CPU_ISA", "sse9")
    with pytest.raises(pk.KernelLibraryError, match="OPTIMIZE_CPU_ISA=sse9 is not a code path"):
        pk.select_paths()
    with pytest.raises(pk.KernelLibraryError, match="OPTIMIZE_CPU_ISA=sse9"):
        pk.register(ort.SessionOptions())
    lacking = [p for p in PATHS if missing(p)]
    for path in lacking:  # on a CPU that runs every path there is nothing to refuse here
        monkeypatch.setenv("OPTIMIZE_CPU_ISA", path)
        with pytest.raises(pk.KernelLibraryError, match=f"this CPU lacks {' '.join(missing(path))}"):
            pk.select_paths()
    monkeypatch.delenv("OPTIMIZE_CPU_ISA")
    assert pk.select_paths()["isa"] == expected_default()  # the error left a valid choice behind


def test_onnxruntime_registering_the_library_itself_refuses_a_bad_pin() -> None:
    """Without the Python side (a program that registers the .so with ONNX Runtime directly), the library
    reads OPTIMIZE_CPU_ISA itself and fails the registration with the reason."""
    code = ("import onnxruntime as ort, sys\n"
            "from runtime.kernels.paged_attention_cpu import library_path\n"
            "so = ort.SessionOptions()\n"
            "try:\n    so.register_custom_ops_library(str(library_path()))\n"
            "except Exception as e:\n    print('refused:', e); sys.exit(0)\n"
            "print('registered'); sys.exit(1)\n")
    env = {"OPTIMIZE_CPU_ISA": "sse9", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OPTIMIZE_CPU_ISA=sse9 is not a code path" in res.stdout


def test_registration_logs_the_choice_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OPTIMIZE_CPU_ISA", "baseline")
    pk._logged.clear()
    with caplog.at_level(logging.INFO, logger=pk.__name__):
        for _ in range(3):
            pk.register(ort.SessionOptions())
    lines = [r.getMessage() for r in caplog.records if "CPU kernel path" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("CPU kernel path baseline (pinned by OPTIMIZE_CPU_ISA")
    assert "SiluMul baseline" in lines[0] and "PagedAttention baseline" in lines[0]


@pytest.mark.parametrize("path", PATHS)
def test_a_session_keeps_the_path_it_was_created_with(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session created on one path and run after the choice changed still runs (and matches the
    float64 SiluMul): kernels copy their path when ONNX Runtime creates them."""
    use_path(path, monkeypatch)
    node = helper.make_node("SiluMul", ["x"], ["y"], domain=pk.DOMAIN)
    f = helper.make_tensor_value_info
    graph = helper.make_graph([node], "s", [f("x", TensorProto.FLOAT, ["T", 64])], [f("y", TensorProto.FLOAT, ["T", 32])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(pk.DOMAIN, 1)])
    so = ort.SessionOptions()
    assert pk.register(so)["ops"]["SiluMul"] == path
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    pk.select_paths("baseline")
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    g, u = x[:, :32].astype(np.float64), x[:, 32:].astype(np.float64)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], g / (1 + np.exp(-g)) * u, rtol=1e-5)


# ---- at load: the build's measured path against this CPU's, bfloat16 products, --retune -----------------------


def _artifact_measured_on(src: Path, dst: Path, isa: str) -> Path:
    """A copy of an artifact whose manifest says its attention autotune measured on `isa`."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    stats = next(p for p in manifest["passes"] if p["name"] == "select_attention")["stats"]
    stats["measured_on"] = {"isa": isa, "ops": {op: isa for op in OPS}, "cpu_features": []}
    (dst / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
    return dst


def test_serving_on_another_code_path_than_the_build_measured_warns_once(
        demo_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from runtime.engine import LLMEngine

    monkeypatch.delenv("OPTIMIZE_CPU_ISA", raising=False)
    here = expected_default()
    other = next(p for p in PATHS if p != here)
    with caplog.at_level(logging.INFO):
        LLMEngine(_artifact_measured_on(demo_artifact, tmp_path / "other", other), verify=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "code path" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"chosen by timings on the {other} code path; this CPU runs {here}" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        LLMEngine(_artifact_measured_on(demo_artifact, tmp_path / "same", here), verify=False)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and "code path" in r.getMessage()]


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    from runtime.cpu_check import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu sse2 avx2 fma avx512_vnni\n\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx2", "fma", "avx512_vnni"}
    assert cpu_flags(tmp_path / "absent") is None


def test_full_range_int8_weights_warn_at_load_on_a_cpu_without_an_int8_dot_product(
        demo_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """weight_range: full is exact only where MLAS's uint8 x int8 GEMM accumulates in int32 (VNNI, AMX): on
    another CPU the load says so in one line; reduced-range codes never warn."""
    from runtime import cpu_check
    from runtime.engine import LLMEngine

    def artifact(weight_range: str) -> Path:
        dst = tmp_path / weight_range
        shutil.copytree(demo_artifact, dst)
        manifest = json.loads((dst / "manifest.json").read_text())
        manifest["passes"].insert(2, {"name": "quantize_int8", "stats": {"weight_range": weight_range}})
        (dst / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
        return dst

    def warnings(folder: Path, flags: set[str] | None) -> list[str]:
        monkeypatch.setattr(cpu_check, "cpu_flags", lambda: flags)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            LLMEngine(folder, verify=False)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "int8" in r.getMessage()]

    full, reduced = artifact("full"), artifact("reduced")
    no_dot = warnings(full, {"avx2", "fma", "avx512f", "avx512bw"})
    assert len(no_dot) == 1 and "this CPU has no VNNI or AMX" in no_dot[0] and "weight_range: reduced" in no_dot[0]
    assert "cannot be read" in warnings(full, None)[0]
    for flag in cpu_check.INT8_DOT_FLAGS:
        assert warnings(full, {"avx2", flag}) == []
    assert warnings(reduced, {"avx2"}) == []


def test_retune_measures_each_path_this_cpu_runs_and_loads_the_fastest(
        demo_artifact: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from runtime.engine import LLMEngine

    monkeypatch.delenv("OPTIMIZE_CPU_ISA", raising=False)
    with caplog.at_level(logging.INFO):
        engine = LLMEngine(demo_artifact, retune=True, threads=1)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("--retune"))
    assert "the attention variant is part of the graph and stays" in line
    runs = [p for p in PATHS if not missing(p)]
    for p in runs:
        assert f"{p} " in line.split("):", 1)[1]
    best = line.rsplit("-> ", 1)[1]
    assert best in runs and engine.backend.kernel_paths["isa"] == best
    assert engine.backend.kernel_paths["source"] == "call"
