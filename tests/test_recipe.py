"""Tests for compiler.recipe: parsing, defaults, and errors that name file, line and field."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest

from compiler.recipe import SCHEMA_PATH, RecipeError, RuntimeDefaults, load_recipe

REPO = Path(__file__).parents[1]
CHECKPOINT = REPO / "models/pycode-llama-6m"
EVAL = CHECKPOINT / "eval.txt"

# Line numbers below refer to this template (line 1 is the comment).
GOOD = f"""\
# test recipe
name: demo-model
version: 1.0.0
source:
  checkpoint: {CHECKPOINT}
target:
  backend: onnxruntime
  device: cpu
  dtype: float32
passes:
  - name: capture
  - name: lower_onnx
    options:
      opset: 21
  - name: package
runtime:
  kv_block_size: 16
  num_kv_blocks: 512
  max_num_seqs: 16
  max_num_batched_tokens: 512
  max_model_len: 1024
quality:
  eval_data: {EVAL}
  max_eval_tokens: 8192
  max_perplexity: 14.5
output: out
"""


@dataclass
class CaptureOptions:
    pass


@dataclass
class LowerOptions:
    opset: int = 21
    external_data: bool = True
    scale: float = 1.0
    label: str | None = None
    ops: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.opset < 21:
            raise ValueError(f"opset must be >= 21, got {self.opset}")


REGISTRY: dict[str, type | None] = {"capture": CaptureOptions, "lower_onnx": LowerOptions, "package": None}


def write(tmp_path: Path, edits: dict[int, str] | None = None, name: str = "recipe.yaml") -> Path:
    """The GOOD recipe with 1-based lines replaced (a replacement may hold several lines)."""
    lines = GOOD.splitlines()
    for number, text in (edits or {}).items():
        lines[number - 1] = text
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_good_recipe_parses(tmp_path: Path) -> None:
    path = write(tmp_path)
    r = load_recipe(path, REGISTRY)
    assert (r.name, r.version) == ("demo-model", "1.0.0")
    assert r.checkpoint == CHECKPOINT.resolve()
    assert (r.target.backend, r.target.device, r.target.dtype) == ("onnxruntime", "cpu", "float32")
    assert [p.name for p in r.passes] == ["capture", "lower_onnx", "package"]
    assert [p.line for p in r.passes] == [11, 12, 15]
    assert r.passes[1].options == {"opset": 21}
    assert r.runtime == RuntimeDefaults()
    assert r.quality.eval_data == EVAL.resolve()
    assert (r.quality.max_eval_tokens, r.quality.max_perplexity) == (8192, 14.5)
    assert r.quality.max_perplexity_increase_pct is None
    assert r.output == (tmp_path / "out").resolve()
    assert r.text == path.read_text(encoding="utf-8")
    assert r.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert r.lines["source.checkpoint"] == 5
    assert r.lines["passes[1].options.opset"] == 14
    assert r.lines["runtime.max_model_len"] == 21
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "other"  # type: ignore[misc]


def test_as_dict_keeps_paths_as_written_and_fills_defaults(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    path = write(tmp_path, {5: "  checkpoint: ckpt", 16: "", 17: "", 18: "", 19: "", 20: "", 21: ""})
    r = load_recipe(path)
    assert r.checkpoint == (tmp_path / "ckpt").resolve()
    d = r.as_dict()
    assert d["source"] == {"checkpoint": "ckpt"}
    assert d["runtime"] == dataclasses.asdict(RuntimeDefaults())
    assert d["quality"]["eval_data"] == str(EVAL)
    assert d["passes"][0] == {"name": "capture", "options": {}}
    json.dumps(d, allow_nan=False)  # plain JSON data
    d["name"] = "changed"
    assert r.as_dict()["name"] == "demo-model"  # a copy
    jsonschema.validate(r.as_dict(), json.loads(SCHEMA_PATH.read_text()))  # still a valid recipe


def test_optional_sections_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    minimal = "\n".join(GOOD.splitlines()[:15]) + "\n"
    path = tmp_path / "min.yaml"
    path.write_text(minimal, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    r = load_recipe(path)
    assert r.runtime == RuntimeDefaults()
    assert r.quality.eval_data is None and r.quality.max_perplexity is None
    assert r.quality.max_eval_tokens is None  # sized by the gate
    assert r.as_dict()["quality"]["max_eval_tokens"] == "auto"
    assert r.output == (tmp_path / "artifacts").resolve()
    assert r.as_dict()["output"] == "artifacts"


def test_schema_is_valid_and_defaults_match_code() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    props = schema["properties"]["runtime"]["properties"]
    assert {k: v["default"] for k, v in props.items()} == dataclasses.asdict(RuntimeDefaults())


def test_demo_recipe_loads() -> None:
    r = load_recipe(REPO / "recipes/demo.yaml")
    assert r.checkpoint == CHECKPOINT.resolve()


ERRORS = [
    # (edits, line, field, message fragment)
    pytest.param({8: "  device: cpu: x"}, 8, "", "invalid YAML", id="yaml-syntax"),
    pytest.param(
        {8: "  device: cpu\n  color: red"}, 9, "target.color", "unknown key 'color'", id="unknown-key"
    ),
    pytest.param(
        {17: '  kv_block_size: "sixteen"'}, 17, "runtime.kv_block_size", "expected integer", id="type"
    ),
    pytest.param({17: "  kv_block_size: 17"}, 17, "runtime.kv_block_size", "one of 8, 16", id="block-size"),
    pytest.param({8: "  device: gpu"}, 8, "target.device", "one of cpu, cuda", id="enum"),
    pytest.param({9: ""}, 6, "target.dtype", "missing required key 'dtype'", id="missing-key"),
    pytest.param({3: "version: 1.0"}, 3, "version", "semver", id="version-float"),
    pytest.param({3: "version: v1"}, 3, "version", "semver", id="version-pattern"),
    pytest.param({2: "name: Demo"}, 2, "name", "lowercase", id="name-pattern"),
    pytest.param(
        {9: "  dtype: float32\n  dtype: float16"}, 10, "target.dtype", "duplicate key", id="dup-key"
    ),
    pytest.param({15: "  - name: packge"}, 15, "passes[2].name", "known passes: capture", id="unknown-pass"),
    pytest.param({14: '      opset: "21"'}, 14, "passes[1].options.opset", "expected int", id="opt-type"),
    pytest.param({14: "      opset: 21.5"}, 14, "passes[1].options.opset", "expected int", id="opt-float"),
    pytest.param({14: "      opset: true"}, 14, "passes[1].options.opset", "expected int", id="opt-bool"),
    pytest.param({14: "      ops: [a, 1]"}, 14, "passes[1].options.ops", "list of str", id="opt-list"),
    pytest.param({14: "      label: 3"}, 14, "passes[1].options.label", "str or null", id="opt-optional"),
    pytest.param(
        {14: "      opsett: 21"}, 14, "passes[1].options.opsett", "unknown option", id="opt-unknown"
    ),
    pytest.param({14: "      opset: 17"}, 13, "passes[1].options", "opset must be >= 21", id="opt-post-init"),
    pytest.param(
        {15: "  - name: package\n    options: {x: 1}"}, 16, "passes[2].options.x", "no options", id="opt-none"
    ),
    pytest.param(
        {10: "passes: []", 11: "", 12: "", 13: "", 14: "", 15: ""}, 10, "passes", "empty", id="no-passes"
    ),
    pytest.param({21: "  max_model_len: 100000"}, 21, "runtime.max_model_len", "KV cache", id="kv-capacity"),
    pytest.param({7: "  backend: tensorrt"}, 8, "target.device", "cuda", id="trt-cpu"),
    pytest.param({25: "  max_perplexity: .nan"}, 25, "quality.max_perplexity", "finite", id="nan"),
    pytest.param({23: ""}, 22, "quality.eval_data", "needed by 'max_perplexity'", id="bound-without-data"),
    pytest.param({14: "      <<: {opset: 21}"}, 14, "passes[1].options", "merge keys", id="merge-key"),
]


@pytest.mark.parametrize(("edits", "line", "fld", "fragment"), ERRORS)
def test_errors_name_file_line_and_field(
    tmp_path: Path, edits: dict[int, str], line: int, fld: str, fragment: str
) -> None:
    path = write(tmp_path, edits)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, REGISTRY)
    err = info.value
    prefix = f"{path}:{line}: {fld}: " if fld else f"{path}:{line}: "
    assert str(err).startswith(prefix), str(err)
    assert fragment in err.message, str(err)
    assert (err.file, err.line, err.field) == (str(path), line, fld)


def test_missing_checkpoint_names_resolved_path(tmp_path: Path) -> None:
    path = write(tmp_path, {5: "  checkpoint: ../nowhere"})
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value).startswith(f"{path}:5: source.checkpoint: ")
    assert str((tmp_path.parent / "nowhere").resolve()) in str(info.value)


def test_missing_eval_data(tmp_path: Path) -> None:
    path = write(tmp_path, {23: "  eval_data: held_out.txt"})
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value).startswith(f"{path}:23: quality.eval_data: ")
    assert str(tmp_path / "held_out.txt") in str(info.value)


def test_unreadable_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe(tmp_path / "absent.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(empty)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("hello\n")
    with pytest.raises(RecipeError, match="expected mapping"):
        load_recipe(scalar)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: \xff\n")
    with pytest.raises(RecipeError, match="UTF-8"):
        load_recipe(binary)


def test_recipe_error_format_and_pickle(tmp_path: Path) -> None:
    assert str(RecipeError("r.yaml", None, "name", "bad")) == "r.yaml: name: bad"
    err = RecipeError("r.yaml", 3, "passes[1].name", "bad")
    assert str(err) == "r.yaml:3: passes[1].name: bad"
    again = pickle.loads(pickle.dumps(err))
    assert (again.file, again.line, again.field, str(again)) == (err.file, err.line, err.field, str(err))
    r = load_recipe(write(tmp_path))
    located = r.error("passes[1].options.opset", "not supported")
    assert str(located) == f"{r.path}:14: passes[1].options.opset: not supported"
    assert r.error("runtime.unknown", "x").line == 16  # falls back to the enclosing field


def test_registry_entries_must_be_dataclasses(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="dataclass"):
        load_recipe(write(tmp_path), {"capture": dict, "lower_onnx": LowerOptions, "package": None})


def test_import_does_not_pull_torch() -> None:
    code = "import sys, compiler.recipe; heavy = {'torch', 'onnx', 'numpy'} & set(sys.modules); print(sorted(heavy))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
