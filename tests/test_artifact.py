"""Tests for runtime.artifact: deterministic manifests, integrity checks, compatibility, immutability."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.artifact import (
    SCHEMA_VERSION,
    Artifact,
    ArtifactError,
    IncompatibleArtifactError,
    check_version_unused,
    describe,
    file_entries,
    pass_changes,
    quality_line,
    read_manifest,
    sha256_file,
    verify_artifact,
    write_build_info,
    write_manifest,
)

REPO = Path(__file__).parents[1]


def base_manifest() -> dict:
    return {
        "name": "pycode-llama-6m",
        "version": "1.0.0",
        "source": {"sha256": "ab" * 32},
        "recipe": {"sha256": "cd" * 32, "text": "name: pycode-llama-6m\n"},
        "target": {"backend": "onnxruntime", "device": "cpu", "dtype": "float32"},
        "passes": [{"name": "capture", "stats": {"nodes": 120}}, {"name": "package", "stats": {}}],
        "kernels": {"attention": "decomposed_paged"},
        "quality": {"perplexity": 12.25, "max_perplexity": 14.5},
        "note": "ünïcode stays readable",
    }


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    root = tmp_path / "pycode-llama-6m" / "1.0.0"
    (root / "tokenizer").mkdir(parents=True)
    (root / "model.onnx").write_bytes(b"\x08\x07fake-onnx" * 100)
    (root / "model.onnx.data").write_bytes(bytes(range(256)) * 8)
    (root / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    (root / "runtime.json").write_text(json.dumps({"kv_block_size": 16}))
    write_build_info(root, {"host": "test", "checkpoint": tmp_path / "ckpt", "seconds": {"capture": 0.5}})
    write_manifest(root, base_manifest())
    return root


def test_manifest_is_deterministic(artifact: Path) -> None:
    first = (artifact / "manifest.json").read_bytes()
    write_manifest(artifact, base_manifest())
    assert (artifact / "manifest.json").read_bytes() == first
    assert first.endswith(b"\n") and "ünïcode".encode() in first
    manifest = json.loads(first)
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert [f["path"] for f in manifest["files"]] == [
        "model.onnx",
        "model.onnx.data",
        "runtime.json",
        "tokenizer/tokenizer.json",
    ]
    entry = manifest["files"][0]
    assert entry["bytes"] == (artifact / "model.onnx").stat().st_size
    assert entry["sha256"] == hashlib.sha256((artifact / "model.onnx").read_bytes()).hexdigest()
    assert list(artifact.glob(".*.tmp")) == []


def test_file_entries_and_sha256(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_bytes(b"x" * (3 << 20))  # several chunks
    (tmp_path / "a").write_bytes(b"")
    (tmp_path / "build.json").write_text("{}")
    entries = file_entries(tmp_path)
    assert [e["path"] for e in entries] == ["a", "b/x"]
    assert (
        entries[1]["sha256"] == hashlib.sha256(b"x" * (3 << 20)).hexdigest() == sha256_file(tmp_path / "b/x")
    )


def test_write_manifest_refuses_nan_and_non_json(artifact: Path) -> None:
    bad = base_manifest()
    bad["quality"]["perplexity"] = float("nan")
    with pytest.raises(ArtifactError, match=r"quality\.perplexity"):
        write_manifest(artifact, bad)
    bad = base_manifest()
    bad["source"]["path"] = artifact
    with pytest.raises(ArtifactError, match="not JSON data"):
        write_manifest(artifact, bad)
    with pytest.raises(ArtifactError, match="'name'"):
        write_manifest(artifact, {"version": "1.0.0"})


def test_build_info_is_outside_the_payload(artifact: Path) -> None:
    info = json.loads((artifact / "build.json").read_text())
    assert info["checkpoint"].endswith("ckpt")
    (artifact / "build.json").write_text('{"host": "elsewhere"}')
    assert verify_artifact(artifact) == []
    with pytest.raises(ArtifactError, match="build.json"):
        write_build_info(artifact, {"t": float("inf")})


def test_intact_artifact_verifies_and_opens(artifact: Path) -> None:
    assert verify_artifact(artifact) == []
    art = Artifact.open(artifact)
    assert (art.name, art.version) == ("pycode-llama-6m", "1.0.0")
    assert art.runtime_config == {"kv_block_size": 16}
    assert art.model_path == artifact / "model.onnx"
    assert art.tokenizer_dir == artifact / "tokenizer"
    assert art.manifest_sha256() == hashlib.sha256((artifact / "manifest.json").read_bytes()).hexdigest()


def test_flipped_byte_is_named(artifact: Path) -> None:
    data = bytearray((artifact / "model.onnx.data").read_bytes())
    data[100] ^= 0xFF
    (artifact / "model.onnx.data").write_bytes(bytes(data))
    problems = verify_artifact(artifact)
    assert len(problems) == 1 and problems[0].startswith("model.onnx.data: sha256 differs (expected ")


def test_truncated_missing_and_extra_files_are_named(artifact: Path) -> None:
    size = (artifact / "model.onnx").stat().st_size
    with open(artifact / "model.onnx", "r+b") as fh:
        fh.truncate(size - 1)
    (artifact / "tokenizer" / "tokenizer.json").unlink()
    (artifact / "tokenizer" / "extra.txt").write_text("surprise")
    problems = verify_artifact(artifact)
    assert problems == [
        f"model.onnx: size differs (expected {size} bytes, found {size - 1})",
        "tokenizer/extra.txt: extra file, not listed in manifest.json",
        "tokenizer/tokenizer.json: missing (listed in manifest.json)",
    ]
    with pytest.raises(ArtifactError) as info:
        Artifact.open(artifact)
    lines = str(info.value).splitlines()
    assert "3 problem(s)" in lines[0] and str(artifact) in lines[0]
    assert [line.strip() for line in lines[1:]] == problems
    assert Artifact.open(artifact, verify=False).name == "pycode-llama-6m"


def test_symlink_is_a_problem(artifact: Path) -> None:
    (artifact / "link").symlink_to(artifact / "model.onnx")
    assert verify_artifact(artifact) == ["link: is a symlink; payload files must be regular files"]
    with pytest.raises(ArtifactError, match="symlink"):
        file_entries(artifact)


def set_schema(root: Path, version: str) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["schema_version"] = version
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_other_major_schema_is_refused(artifact: Path) -> None:
    set_schema(artifact, "2.0.0")
    with pytest.raises(IncompatibleArtifactError) as info:
        Artifact.open(artifact)
    assert "artifact schema 2.0.0 is not supported by this runtime (supports 1.x, 1.0.0)" in str(info.value)
    assert "manifest.json" in str(info.value)


def test_newer_minor_schema_is_accepted(artifact: Path) -> None:
    set_schema(artifact, "1.3.0")
    assert read_manifest(artifact)["schema_version"] == "1.3.0"
    assert Artifact.open(artifact).version == "1.0.0"


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "missing"),
        ("{not json", "not valid JSON"),
        ('{"schema_version": NaN}', "unreadable"),
        ("[]", "JSON object"),
        ('{"schema_version": "one", "name": "a", "version": "1"}', "semver"),
        ('{"schema_version": "1.0.0", "name": "a", "version": "1", "files": {}}', "'files'"),
    ],
)
def test_broken_manifest_is_refused(tmp_path: Path, content: str | None, fragment: str) -> None:
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ArtifactError, match=fragment) as info:
        read_manifest(tmp_path)
    assert "manifest.json" in str(info.value)


def test_manifest_paths_must_stay_inside(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"][0]["path"] = "../outside"
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="inside the artifact"):
        verify_artifact(artifact)


def test_missing_artifact_folder(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no such artifact folder"):
        Artifact.open(tmp_path / "nope")


def test_check_version_unused(tmp_path: Path, artifact: Path) -> None:
    out = artifact.parents[1]
    with pytest.raises(ArtifactError) as info:
        check_version_unused(out, "pycode-llama-6m", "1.0.0")
    assert str(info.value).startswith(f"artifact pycode-llama-6m 1.0.0 already exists at {artifact};")
    assert "versions are immutable" in str(info.value)
    assert check_version_unused(out, "pycode-llama-6m", "1.0.1") == out / "pycode-llama-6m" / "1.0.1"
    (out / "pycode-llama-6m" / "2.0.0").mkdir()
    assert check_version_unused(out, "pycode-llama-6m", "2.0.0").is_dir()  # empty is fine
    with pytest.raises(ArtifactError, match="single folder name"):
        check_version_unused(out, "../escape", "1.0.0")


def test_describe(artifact: Path) -> None:
    rows = dict(describe(read_manifest(artifact)))
    assert rows["name"] == "pycode-llama-6m" and rows["schema"] == SCHEMA_VERSION
    assert rows["source sha256"] == "ab" * 32 and rows["recipe sha256"] == "cd" * 32
    assert rows["target"] == "onnxruntime cpu float32"
    assert rows["pass capture"] == "nodes 120"
    assert rows["kernels"] == "attention: decomposed_paged"
    assert "perplexity=12.25" in rows["quality"]
    assert rows["files"].startswith("4 files, ")
    assert dict(describe({}))["files"].startswith("0 files")


def test_quality_line_says_what_the_gate_did() -> None:
    """One line per gate record that compiler/build.py writes (and an older manifest's record)."""
    passed = {"evaluated": True, "device": "cpu", "passed": True, "bounds": {"max_perplexity": 16.0},
              "metrics": {"perplexity": 12.5, "eval_chunks": 4}}
    assert quality_line(passed) == "passed: perplexity 12.5 (bounds: max_perplexity=16)"
    assert quality_line({**passed, "bounds": {}}) == "measured, no bounds set: perplexity 12.5"
    unevaluated = {"evaluated": False, "eval_data": "eval.txt", "bounds": {"max_kl_divergence": 0.01},
                   "reason": "target tensorrt/cuda cannot run on this machine; missing: tensorrt",
                   "allowed_by": "quality.allow_unevaluated"}
    assert quality_line(unevaluated) == ("not evaluated (target tensorrt/cuda cannot run on this machine; "
                                         "missing: tensorrt); bounds not checked: max_kl_divergence=0.01, "
                                         "allowed by quality.allow_unevaluated")
    assert quality_line({**unevaluated, "bounds": {}}).endswith("missing: tensorrt); no bounds set")
    assert quality_line({"evaluated": False, "eval_data": None, "bounds": {}, "reason": "no eval_data"}) == \
        "no bounds set: nothing gated (no eval_data)"
    assert quality_line({"evaluated": False, "reason": "old"}) == "not evaluated (old)"  # before bounds were kept


def test_pass_changes_say_what_each_pass_did() -> None:
    fuse = {"name": "fuse", "status": "applied",
            "stats": {"nodes_before": 515, "nodes_after": 301, "fusions": {"qkv": 6, "rotary": 0, "gate_up": 6}}}
    assert pass_changes(fuse) == "nodes 515 -> 301; fused: qkv x6, gate_up x6"
    quant = {"name": "quantize_gptq", "status": "applied", "stats": {
        "quantized_count": 42, "schemes": {"int4": 42}, "not_quantized": {"lm_head": "ignore pattern"}}}
    assert pass_changes(quant) == "quantized 42 weights (int4=42), float: lm_head"
    attn = {"name": "select_attention", "status": "applied", "stats": {"choice": "gqa", "chosen_by": "autotune"}}
    assert pass_changes(attn) == "chose gqa (autotune)"
    cg = {"name": "plan_cuda_graphs", "status": "applied",
          "stats": {"decode_buckets": [1, 2, 4], "capturable": True, "applies": False, "nodes": 9}}
    assert pass_changes(cg) == "nodes 9; decode buckets 1, 2, 4; capturable yes; applies no"
    assert pass_changes({"name": "x", "status": "skipped", "reason": "no quantize pass"}) == "skipped: no quantize pass"
    assert pass_changes({"name": "x", "status": "applied", "stats": {"a": 1}}) == "a=1"


def test_import_is_stdlib_only() -> None:
    code = (
        "import sys; before = set(sys.modules); import runtime.artifact; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'runtime'}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
