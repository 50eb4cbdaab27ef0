"""`optimize build` through the real CLI: recipe errors, dry run, reproducibility, immutability, quality gate."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import DEMO_MODEL, DEMO_RECIPE, ROOT, make_random_checkpoint, needs_ort, write_recipe

CLI = [sys.executable, "-m", "compiler.cli"]


def run_cli(*args: str | Path, timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `optimize ARGS` in a fresh interpreter; returns the result and its wall time."""
    t = time.perf_counter()
    res = subprocess.run([*CLI, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return res, time.perf_counter() - t


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line of `text` that contains `needle`."""
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in recipe text")


def assert_no_artifact(output: Path) -> None:
    """Nothing (no artifact, no name folder, no staging leftovers) under the output root."""
    if output.exists():
        left = sorted(p.relative_to(output).as_posix() for p in output.rglob("*"))
        assert left == [], f"left behind under {output}: {left}"


def unsupported_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "gpt2-ckpt"
    ckpt.mkdir()
    cfg = json.loads((DEMO_MODEL / "config.json").read_text(encoding="utf-8"))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    shutil.copyfile(DEMO_MODEL / "tokenizer.json", ckpt / "tokenizer.json")
    try:
        (ckpt / "model.safetensors").symlink_to(DEMO_MODEL / "model.safetensors")
    except OSError:  # pragma: no cover - filesystems without symlinks
        shutil.copyfile(DEMO_MODEL / "model.safetensors", ckpt / "model.safetensors")
    return ckpt


# case id -> (write_recipe kwargs builder, field named in the error, needle locating its line, message words)
def _case(tmp_path: Path, case: str) -> tuple[Path, str, int, list[str]]:
    if case == "unknown-pass":
        recipe = write_recipe(tmp_path, DEMO_MODEL, passes="  - name: capture\n  - name: quantize_int4\n"
                                                           "  - name: package\n")
        field, needle, words = "passes[1].name", "- name: quantize_int4", ["unknown pass", "quantize_int4"]
    elif case == "wrong-type":
        recipe = write_recipe(tmp_path, DEMO_MODEL, runtime='  kv_block_size: "sixteen"\n  num_kv_blocks: 256\n'
                                                           "  max_num_seqs: 8\n  max_num_batched_tokens: 256\n"
                                                           "  max_model_len: 512\n")
        field, needle, words = "runtime.kv_block_size", "kv_block_size:", ["sixteen"]
    elif case == "missing-checkpoint":
        recipe = write_recipe(tmp_path, tmp_path / "no-such-checkpoint")
        field, needle, words = "source.checkpoint", "checkpoint:", ["not found", "no-such-checkpoint"]
    elif case == "unsupported-architecture":
        recipe = write_recipe(tmp_path, unsupported_checkpoint(tmp_path))
        field, needle, words = "source.checkpoint", "checkpoint:", ["GPT2LMHeadModel", "not supported"]
    elif case == "unknown-key":
        recipe = write_recipe(tmp_path, DEMO_MODEL, runtime="  kv_block_size: 16\n  num_kv_blocks: 256\n"
                                                           "  kv_cache_dtype: fp8\n  max_num_seqs: 8\n"
                                                           "  max_num_batched_tokens: 256\n  max_model_len: 512\n")
        field, needle, words = "runtime.kv_cache_dtype", "kv_cache_dtype:", ["unknown key", "kv_cache_dtype"]
    else:  # pragma: no cover
        raise ValueError(case)
    return recipe, field, line_of(recipe.read_text(encoding="utf-8"), needle), words


CASES = ["unknown-pass", "wrong-type", "missing-checkpoint", "unsupported-architecture", "unknown-key"]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "build"])
@pytest.mark.parametrize("case", CASES)
def test_malformed_recipe_is_refused_with_file_line_and_field(tmp_path: Path, case: str, dry_run: bool) -> None:
    recipe, field, line, words = _case(tmp_path, case)
    args = ["build", *(["--dry-run"] if dry_run else []), recipe]
    res, wall = run_cli(*args)
    assert res.returncode != 0, res.stdout + res.stderr
    # "error: <file>:<line>: <field>: <message>"
    assert f"{recipe}:{line}: {field}:" in res.stderr, res.stderr
    for w in words:
        assert w in res.stderr, (w, res.stderr)
    assert "Traceback" not in res.stderr
    assert_no_artifact(tmp_path / "artifacts")
    if dry_run:
        assert wall < 10.0, f"dry run took {wall:.1f} s"  # the suite shares the cores; no torch (next test)
        assert "plan ok" not in res.stdout


def test_recipe_checks_and_dry_run_import_neither_torch_nor_onnx() -> None:
    code = ("import sys; from compiler.build import plan; plan(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'onnxscript') if m in sys.modules))")
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        res = subprocess.run([sys.executable, "-c", code, str(recipe)], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 0 and res.stdout.strip() == "[]", (recipe.name, res.stdout, res.stderr)


def test_dry_run_of_demo_prints_plan_and_estimates() -> None:
    res, wall = run_cli("build", "--dry-run", DEMO_RECIPE)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    lines = out.splitlines()
    passes = [m.group(1) for ln in lines if (m := re.match(r"\s+\d+\. (\S+)", ln))]
    want = [spec["name"] for spec in yaml.safe_load(DEMO_RECIPE.read_text())["passes"]]
    assert passes == want, out
    for label in ("artifact size", "runtime KV cache", "runtime total"):
        row = next((ln for ln in lines if ln.strip().startswith(label)), None)
        assert row is not None, (label, out)
        assert row.rstrip().endswith(("B", "KiB", "MiB", "GiB")), row
    assert "LlamaForCausalLM" in out
    assert "nothing built" in out
    assert wall < 10.0, f"dry run took {wall:.1f} s"


@needs_ort("gqa")
@pytest.mark.slow
def test_demo_build_as_in_the_readme_records_passes_kernels_and_timings(tmp_path: Path) -> None:
    """`optimize build recipes/demo.yaml` (autotune on): the manifest lists every fusion rule's count,
    the attention candidates and the choice, and the CUDA-graph plan; build.json the candidates'
    timings; `optimize inspect` says per pass what changed."""
    res, _wall = run_cli("build", "--no-progress", DEMO_RECIPE, "-o", tmp_path)
    assert res.returncode == 0, res.stderr
    artifact = tmp_path / "pycode-llama-6m" / "1.0.0"
    manifest = json.loads((artifact / "manifest.json").read_text())
    stats = {p["name"]: p["stats"] for p in manifest["passes"]}
    sel = stats["select_attention"]
    # the kernel's fused attention exists for the paged_cpu variant only (any variant can win the timing on a
    # busy 2-core machine); float graphs have no per-token quantization to fuse
    assert stats["fuse"]["fusions"] == {"rms_norm": 13, "skip_rms_norm": 11, "qkv": 6, "gate_up": 6, "rotary": 12,
                                        "rotary_attention": 6 if sel["choice"] == "paged_cpu" else 0,
                                        "quick_gelu": 6, "swiglu": 6 if sel["choice"] == "paged_cpu" else 0,
                                        "quantize_rows": 0, "row_scale": 0, "skip_norm_quantize": 0}
    assert sel["reason"] == "autotune" and sel["attention_kind"]["heads"] == "GQA"
    assert {c["variant"]: c["valid"] for c in sel["candidates"]} == {"decomposed": True, "gqa": True,
                                                                      "paged_cpu": True, "paged_attention": False,
                                                                      "triton": False, "flashinfer": False}
    assert manifest["kernels"]["attention"]["variant"] == sel["choice"]
    assert manifest["cuda_graphs"]["decode_buckets"] == [1, 2, 4, 8, 16]
    tune = json.loads((artifact / "build.json").read_text())["attention_autotune"]
    assert tune["fastest"] == sel["choice"]
    for variant in ("decomposed", "gqa", "paged_cpu"):
        times = tune["results"][variant]["median_ms"]
        assert set(times) == {"decode_b1_ctx1024", "decode_b8_ctx1024", "decode_b32_ctx1024", "prefill_512"}
        assert all(t > 0 for t in times.values())
    res, _wall = run_cli("inspect", artifact)
    assert res.returncode == 0, res.stderr
    rows = {ln.split("  ")[0]: ln for ln in res.stdout.splitlines()}
    assert f"chose {sel['choice']} (autotune)" in rows["pass select_attention"]
    # the graph's size depends on the variant the timing chose (any can win on a busy 2-core machine)
    nodes = {"decomposed": "nodes 515 -> 359 (per decoder layer ", "gqa": "nodes 412 -> 256 (per decoder layer ",
             "paged_cpu": "nodes 301 -> 54 (per decoder layer "}[sel["choice"]]
    assert nodes in rows["pass fuse"] and "rms_norm x13" in rows["pass fuse"]
    # decomposed and paged_cpu read shapes only from input shapes; gqa pads the packed tokens to the step's
    # longest chunk (ReduceMax of the lengths -> Range), a shape the host must read: not capturable
    capturable = {"decomposed": "yes", "gqa": "no", "paged_cpu": "yes"}[sel["choice"]]
    assert f"decode buckets 1, 2, 4, 8, 16; capturable {capturable}" in rows["pass plan_cuda_graphs"]
    findings = manifest["cuda_graphs"]["host_sync_findings"]
    if sel["choice"] == "gqa":
        assert [f["op"] for f in findings] == ["Range", "Range"], findings
        assert all("derives from input contents" in f["reason"] for f in findings)
    else:
        assert findings == []


@pytest.mark.slow
def test_build_is_reproducible(demo_artifact: Path, tmp_path: Path) -> None:
    """`optimize build --no-autotune` in a fresh interpreter with another hash seed and another torch /
    OpenMP thread count gives the session's in-process build byte for byte: manifest and payload."""
    import torch

    threads = 1 if torch.get_num_threads() != 1 else 2  # torch caps its threads at the cores: go lower
    seed = "271828" if os.environ.get("PYTHONHASHSEED") != "271828" else "314159"
    env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([*CLI, "build", "--no-progress", "--no-autotune", "-o", str(tmp_path / "again"),
                          str(DEMO_RECIPE)], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    again = tmp_path / "again" / demo_artifact.relative_to(demo_artifact.parents[1])
    assert again.is_dir() and again != demo_artifact
    first_manifest = (demo_artifact / "manifest.json").read_bytes()
    assert (again / "manifest.json").read_bytes() == first_manifest
    manifest = json.loads(first_manifest)
    listed = sorted(e["path"] for e in manifest["files"])
    assert "model.onnx" in listed and "model.onnx.data" in listed

    def payload(root: Path) -> list[str]:
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and p.name not in ("manifest.json", "build.json"))

    assert payload(demo_artifact) == listed
    assert payload(again) == listed
    for rel in listed:
        assert (again / rel).read_bytes() == (demo_artifact / rel).read_bytes(), rel
    # the other interpreter really differed: its torch thread count and its str hashes
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads(), hash('optimize'))"],
                           capture_output=True, text=True, timeout=120, env=env)
    got_threads, got_hash = probe.stdout.split()
    assert int(got_threads) == threads != torch.get_num_threads() and int(got_hash) != hash("optimize"), probe


def test_existing_version_is_refused_and_left_untouched(demo_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    existing = out / "pycode-llama-6m" / "1.0.0"
    shutil.copytree(demo_artifact, existing)
    before = {p.relative_to(existing).as_posix(): p.read_bytes() for p in existing.rglob("*") if p.is_file()}

    res, wall = run_cli("build", "--no-progress", "-o", out, DEMO_RECIPE, timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "versions are immutable" in res.stderr, res.stderr
    assert str(existing) in res.stderr
    assert "built " not in res.stdout
    assert wall < 20, f"refusal took {wall:.1f} s: something ran before the version check"
    # byte-identical, nothing added, no staging folder next to it
    after = {p.relative_to(existing).as_posix(): p.read_bytes() for p in existing.rglob("*") if p.is_file()}
    assert (existing / "manifest.json").read_bytes() == before["manifest.json"]
    assert after == before
    assert sorted(p.name for p in existing.parent.iterdir()) == ["1.0.0"]


def test_a_recipe_without_bounds_says_so_in_inspect_and_verify(tmp_path: Path) -> None:
    """No quality section: nothing to gate; the manifest records that, and inspect and verify say it
    (rather than "passed" or a silence)."""
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    res, _ = run_cli("build", "--no-progress", write_recipe(tmp_path, ckpt))
    assert res.returncode == 0, res.stderr
    artifact = tmp_path / "artifacts" / "test-model" / "1.0.0"
    assert json.loads((artifact / "manifest.json").read_text())["quality"] == {
        "evaluated": False, "eval_data": None, "bounds": {},
        "reason": "the recipe names no quality.eval_data and sets no bounds: nothing to gate"}
    want = "no bounds set: nothing gated (the recipe names no quality.eval_data and sets no bounds: nothing to gate)"
    res, _ = run_cli("inspect", artifact)
    assert res.returncode == 0, res.stderr
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("quality")] == [f"quality: {want}"]
    res, _ = run_cli("verify", artifact)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == f"quality: {want}"


@pytest.mark.slow
def test_quality_gate_failure_writes_no_artifact(tmp_path: Path) -> None:
    ckpt = make_random_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    eval_txt = DEMO_MODEL / "eval.txt"
    recipe = write_recipe(tmp_path, ckpt, extra=f"quality:\n  eval_data: {eval_txt}\n  max_eval_tokens: 512\n"
                                                "  max_perplexity: 1.5\n")
    res, _ = run_cli("build", "--no-progress", recipe)
    assert res.returncode != 0, res.stdout + res.stderr
    err = res.stderr
    assert "quality gate failed" in err, err
    row = next((ln for ln in err.splitlines() if ln.strip().startswith("perplexity")), None)
    assert row is not None, err
    assert "measured" in row and "allowed" in row and "FAILED" in row, row
    assert "1.5000" in row, row  # the allowed bound
    measured = float(row.split("measured")[1].split()[0])
    assert measured > 1.5
    assert "Traceback" not in err
    assert "built " not in res.stdout
    assert not (tmp_path / "artifacts" / "test-model").exists()
    assert_no_artifact(tmp_path / "artifacts")
