"""Load and validate build recipes (YAML) into typed, immutable objects.

A recipe says what `optimize build` compiles: the source checkpoint, the target, the ordered
pass list with each pass's options, serving defaults and quality bounds. Validation is
schema-first (``recipes/recipe.schema.json``, JSON Schema 2020-12), then semantic (known
passes, typed pass options, paths that exist, consistent limits). Every error is a
`RecipeError` naming the file, the 1-based line and the dotted field path, so a CI log points
straight at the offending line. Only the first error is reported, deterministically.

This module must stay light (it runs in ``optimize build --dry-run``): stdlib, PyYAML and
jsonschema only -- never torch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import logging
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema.exceptions import best_match

__all__ = [
    "SCHEMA_PATH",
    "CalibrationSpec",
    "PassSpec",
    "QualitySpec",
    "Recipe",
    "RecipeError",
    "RuntimeDefaults",
    "SpeculativeSpec",
    "Target",
    "load_recipe",
]

log = logging.getLogger(__name__)

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "recipes" / "recipe.schema.json"
DEFAULT_OUTPUT = "artifacts"
DEFAULT_AGREEMENT_PROMPTS = 8
# The calibration budget when the recipe does not set num_samples: 128 windows (of seq_len 256 tokens:
# 32,768 tokens, 55 % of the demo's calib.txt), or every window the file has when it has fewer.
DEFAULT_CALIBRATION_SAMPLES = 128
DEFAULT_AGREEMENT_TOKENS = 32

_STR_TAG = "tag:yaml.org,2002:str"
_PATTERN_HINTS = {
    "name": "must be lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
    "version": "must be a semver version such as 1.0.0 (quote it if YAML reads it as a number)",
}


class RecipeError(Exception):
    """A recipe problem located at ``file:line`` and a dotted field path (e.g. ``passes[1].name``)."""

    def __init__(self, file: str, line: int | None, field: str, message: str) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.message = message
        super().__init__(self._format())

    def _format(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.file, self.line, self.field, self.message))


@dataclass(frozen=True)
class PassSpec:
    """One entry of the recipe's pass list; ``options`` are validated against the pass's config."""

    name: str
    options: dict[str, Any]
    line: int


@dataclass(frozen=True)
class Target:
    backend: str
    device: str
    dtype: str
    # the precision of the weight products where it differs from dtype: "bfloat16" on onnxruntime/cpu
    # (float32 graph, bf16 weights and MatMul inputs: compiler/fusion/matmul_bf16.py); None: dtype's
    matmul: str | None = None


@dataclass(frozen=True)
class RuntimeDefaults:
    """Serving defaults that go into the artifact's runtime.json."""

    kv_block_size: int = 16
    num_kv_blocks: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024


@dataclass(frozen=True)
class QualitySpec:
    """The build's quality gate; a bound of None is not checked."""

    eval_data: Path | None = None
    max_eval_tokens: int | None = None  # None: sized by the gate (compiler.build.eval_size)
    max_perplexity: float | None = None
    max_perplexity_increase_pct: float | None = None
    max_kl_divergence: float | None = None  # mean KL(unoptimised || artifact) per next-token distribution, nats
    min_token_agreement: float | None = None  # fraction of greedy tokens equal to the unoptimised model's
    agreement_prompts: tuple[str, ...] = ()  # empty: fixed windows of eval_data
    agreement_tokens: int = DEFAULT_AGREEMENT_TOKENS
    # True: a build whose gate cannot run on the build machine succeeds, its manifest recording the gate
    # as not evaluated; False (default): such a build fails, naming what the machine lacks
    allow_unevaluated: bool = False

    @property
    def bounds(self) -> dict[str, float]:
        """The bounds the recipe sets (name -> value); empty: nothing to gate."""
        return {k: v for k in ("max_perplexity", "max_perplexity_increase_pct", "max_kl_divergence",
                               "min_token_agreement") if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class CalibrationSpec:
    """Calibration text for the quantization passes: token windows drawn deterministically from `data`."""

    data: Path  # .txt (the whole file is one text) or .jsonl (one JSON object per line, `text_field`)
    text_field: str = "text"
    # windows drawn; None: the default budget, DEFAULT_CALIBRATION_SAMPLES or all the file's windows if fewer
    num_samples: int | None = None
    seq_len: int = 256
    seed: int = 0


@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding's draft, built alongside the target: a checkpoint folder, or the source
    checkpoint's first `truncate_layers` decoder layers (compiler/draft.py)."""

    num_tokens: int = 4
    checkpoint: Path | None = None
    truncate_layers: int | None = None


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. Paths are resolved absolute; ``as_dict`` keeps them as written."""

    path: Path
    text: str = field(repr=False)
    sha256: str
    name: str
    version: str
    checkpoint: Path
    target: Target
    passes: tuple[PassSpec, ...]
    runtime: RuntimeDefaults
    quality: QualitySpec
    output: Path
    lines: dict[str, int] = field(repr=False)  # dotted field path -> 1-based line; "" is the document
    _data: dict[str, Any] = field(repr=False, compare=False)
    calibration: CalibrationSpec | None = None
    speculative: SpeculativeSpec | None = None

    def error(self, field: str, message: str) -> RecipeError:
        """An error located at ``field``'s line (or its nearest enclosing field's line)."""
        return RecipeError(str(self.path), _line_for(self.lines, field), field, message)

    def as_dict(self) -> dict[str, Any]:
        """The recipe as plain JSON data, defaults filled in, paths as written in the file."""
        return copy.deepcopy(self._data)


def load_recipe(path: str | Path, pass_options: Mapping[str, type | None] | None = None) -> Recipe:
    """Read, parse and validate a recipe file.

    ``pass_options`` maps each known pass name to its options dataclass (or None for a pass
    without options); when given, unknown passes and mistyped or unknown options are errors.
    Raises RecipeError for the first problem found.
    """
    path = Path(path)
    file = str(path)
    raw, text = _read_text(path)
    data, lines = _parse_yaml(file, text)
    _validate_schema(file, data, lines)
    _check_finite(file, data, "", lines)

    base = path.resolve().parent

    def err(fld: str, message: str) -> RecipeError:
        return RecipeError(file, _line_for(lines, fld), fld, message)

    checkpoint = _resolve(base, data["source"]["checkpoint"])
    _check_exists(checkpoint, True, "source.checkpoint", "checkpoint folder", err)

    target = Target(**data["target"])
    if target.backend == "tensorrt" and target.device != "cuda":
        raise err("target.device", "backend 'tensorrt' runs only on device 'cuda'")

    passes = tuple(_pass_spec(i, entry, pass_options, lines, err) for i, entry in enumerate(data["passes"]))
    runtime = _runtime_defaults(data.get("runtime", {}), err)
    quality = _quality_spec(data.get("quality", {}), base, err)
    calibration = _calibration_spec(data["calibration"], base, err) if "calibration" in data else None
    speculative = _speculative_spec(data["speculative"], base, checkpoint, err) if "speculative" in data else None
    output = _resolve(base, data["output"]) if "output" in data else Path(DEFAULT_OUTPUT).resolve()

    recipe = Recipe(
        path=path,
        text=text,
        sha256=hashlib.sha256(raw).hexdigest(),
        name=data["name"],
        version=data["version"],
        checkpoint=checkpoint,
        target=target,
        passes=passes,
        runtime=runtime,
        quality=quality,
        output=output,
        lines=lines,
        _data=copy.deepcopy(_normalized(data, passes, runtime, quality, calibration, speculative)),
        calibration=calibration,
        speculative=speculative,
    )
    log.debug("loaded recipe %s: %s %s, %d passes", file, recipe.name, recipe.version, len(passes))
    return recipe


# --------------------------------------------------------------------------- sections

_Err = typing.Callable[[str, str], RecipeError]  # (dotted field, message) -> the error at that field's line


def _read_text(path: Path) -> tuple[bytes, str]:
    """The recipe file's bytes and its UTF-8 text."""
    file = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError(file, None, "", f"cannot read recipe: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(file, None, "", f"recipe is not UTF-8 text: {exc}") from exc
    return raw, text


def _check_exists(path: Path, folder: bool, fld: str, what: str, err: _Err) -> None:
    """`path` (`what`, e.g. "checkpoint folder") must be a folder (`folder`) or a file; else an error at `fld`."""
    if path.is_dir() if folder else path.is_file():
        return
    state = "not found" if not path.exists() else "is not a folder" if folder else "is not a file"
    raise err(fld, f"{what} {state}: {path}")


def _runtime_defaults(section: Mapping[str, Any], err: _Err) -> RuntimeDefaults:
    """The runtime section: the longest sequence must fit in the KV cache, a decode step of every sequence in
    a batch."""
    runtime = RuntimeDefaults(**section)
    capacity = runtime.num_kv_blocks * runtime.kv_block_size
    if runtime.max_model_len > capacity:
        raise err(
            "runtime.max_model_len",
            f"{runtime.max_model_len} tokens do not fit in the KV cache "
            f"(num_kv_blocks {runtime.num_kv_blocks} x kv_block_size {runtime.kv_block_size} = {capacity})",
        )
    if runtime.max_num_batched_tokens < runtime.max_num_seqs:
        raise err(
            "runtime.max_num_batched_tokens",
            f"{runtime.max_num_batched_tokens} is below max_num_seqs ({runtime.max_num_seqs}): "
            "a decode step of every running sequence would not fit",
        )
    return runtime


def _quality_spec(q: Mapping[str, Any], base: Path, err: _Err) -> QualitySpec:
    """The quality section; its eval data file must exist."""
    eval_data = _resolve(base, q["eval_data"]) if "eval_data" in q else None
    if eval_data is not None:
        _check_exists(eval_data, False, "quality.eval_data", "eval data file", err)
    return QualitySpec(
        eval_data=eval_data,
        max_eval_tokens=q.get("max_eval_tokens"),
        max_perplexity=_opt_float(q.get("max_perplexity")),
        max_perplexity_increase_pct=_opt_float(q.get("max_perplexity_increase_pct")),
        max_kl_divergence=_opt_float(q.get("max_kl_divergence")),
        min_token_agreement=_opt_float(q.get("min_token_agreement")),
        agreement_prompts=tuple(q.get("agreement_prompts", ())),
        agreement_tokens=q.get("agreement_tokens", DEFAULT_AGREEMENT_TOKENS),
        allow_unevaluated=bool(q.get("allow_unevaluated", False)),
    )


def _calibration_spec(c: Mapping[str, Any], base: Path, err: _Err) -> CalibrationSpec:
    """The calibration section; its data file must exist."""
    calib_data = _resolve(base, c["data"])
    _check_exists(calib_data, False, "calibration.data", "calibration data file", err)
    return CalibrationSpec(data=calib_data, **{k: v for k, v in c.items() if k != "data"})


def _speculative_spec(sp: Mapping[str, Any], base: Path, checkpoint: Path, err: _Err) -> SpeculativeSpec:
    """The speculative section: a draft checkpoint folder other than the source's, or fewer decoder layers than
    the source checkpoint has."""
    draft = sp["draft"]
    draft_ckpt = None
    if "checkpoint" in draft:
        draft_ckpt = _resolve(base, draft["checkpoint"])
        _check_exists(draft_ckpt, True, "speculative.draft.checkpoint", "draft checkpoint folder", err)
        if draft_ckpt == checkpoint:
            raise err("speculative.draft.checkpoint", "the draft must be another (smaller) checkpoint than "
                                                      "source.checkpoint")
    layers = draft.get("truncate_layers")
    if layers is not None:
        try:
            total = int(json.loads((checkpoint / "config.json").read_text("utf-8"))["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError):
            total = None
        if total is not None and layers >= total:
            raise err("speculative.draft.truncate_layers", f"{layers} is not below the {total} layers of "
                                                           "source.checkpoint")
    return SpeculativeSpec(num_tokens=sp.get("num_tokens", 4), checkpoint=draft_ckpt, truncate_layers=layers)


def _normalized(data: Mapping[str, Any], passes: tuple[PassSpec, ...], runtime: RuntimeDefaults,
                quality: QualitySpec, calibration: CalibrationSpec | None, speculative: SpeculativeSpec | None
                ) -> dict[str, Any]:
    """The recipe as plain JSON data (Recipe.as_dict): defaults filled in, paths as written in the file."""
    normalized: dict[str, Any] = {
        "name": data["name"],
        "version": data["version"],
        "source": dict(data["source"]),
        "target": dict(data["target"]),
        "passes": [{"name": p.name, "options": p.options} for p in passes],
        "runtime": dataclasses.asdict(runtime),
        "quality": {"max_eval_tokens": quality.max_eval_tokens or "auto", **data.get("quality", {})},
        "output": data.get("output", DEFAULT_OUTPUT),
    }
    if speculative is not None:
        normalized["speculative"] = {"num_tokens": speculative.num_tokens, "draft": dict(data["speculative"]["draft"])}
    if calibration is not None:
        normalized["calibration"] = {**{f.name: getattr(calibration, f.name) for f in dataclasses.fields(calibration)},
                                     "data": data["calibration"]["data"],
                                     "num_samples": calibration.num_samples or "auto"}
    return normalized


# --------------------------------------------------------------------------- YAML and lines


def _join(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _parent(fld: str) -> str:
    cut = max(fld.rfind("."), fld.rfind("["))
    return fld[:cut] if cut > 0 else ""


def _line_for(lines: Mapping[str, int], fld: str) -> int | None:
    """The line of ``fld``, or of its nearest enclosing field when it is not in the file."""
    while True:
        if fld in lines:
            return lines[fld]
        if not fld:
            return None
        fld = _parent(fld)


def _parse_yaml(file: str, text: str) -> tuple[Any, dict[str, int]]:
    """Compose the document, check its keys, and construct plain data plus a field->line map."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise RecipeError(file, 1, "", "recipe is empty")
        lines: dict[str, int] = {}
        _walk(file, node, "", node.start_mark.line + 1, lines, set())
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        detail = ", ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise RecipeError(file, line, "", f"invalid YAML: {detail}") from exc
    except yaml.YAMLError as exc:
        raise RecipeError(file, None, "", f"invalid YAML: {exc}") from exc
    finally:
        loader.dispose()
    return data, lines


def _walk(file: str, node: yaml.Node, path: str, line: int, lines: dict[str, int], active: set[int]) -> None:
    """Record the line of every field; reject duplicate, non-string and merge keys."""
    lines[path] = line
    if id(node) in active:
        raise RecipeError(file, line, path, "recursive YAML alias")
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR_TAG:
                shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else key_node.id
                what = (
                    "merge keys ('<<') are not supported"
                    if key_node.tag.endswith(":merge")
                    else (f"keys must be strings, got {shown!r}")
                )
                raise RecipeError(file, key_line, path, what)
            key = key_node.value
            if key in seen:
                raise RecipeError(
                    file,
                    key_line,
                    _join(path, key),
                    f"duplicate key '{key}' (first defined on line {seen[key]})",
                )
            seen[key] = key_line
            _walk(file, value_node, _join(path, key), key_line, lines, active)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(file, item, _join(path, i), item.start_mark.line + 1, lines, active)
    active.discard(id(node))


# --------------------------------------------------------------------------- schema


@functools.lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft202012Validator:
    try:
        schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"cannot read the recipe schema {SCHEMA_PATH}: {exc}; the installation is incomplete"
        ) from exc
    return jsonschema.Draft202012Validator(schema)


def _yaml_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for kind, name in (
        (int, "integer"),
        (float, "number"),
        (str, "string"),
        (list, "list"),
        (dict, "mapping"),
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _validate_schema(file: str, data: Any, lines: Mapping[str, int]) -> None:
    error = best_match(_validator().iter_errors(data))
    if error is None:
        return
    path = ""
    for part in error.absolute_path:
        path = _join(path, part)
    kind, inst, expected = error.validator, error.instance, error.validator_value
    message = error.message
    if kind == "required":
        missing = next(k for k in expected if k not in inst)
        path, message = _join(path, missing), f"missing required key '{missing}'"
    elif kind == "dependentRequired":
        prop, missing = next(
            (p, d) for p, deps in expected.items() if p in inst for d in deps if d not in inst
        )
        path, message = _join(path, missing), f"missing key '{missing}', needed by '{prop}'"
    elif kind == "additionalProperties":
        allowed = error.schema.get("properties", {})
        extra = next(k for k in inst if k not in allowed)
        path = _join(path, extra) if isinstance(extra, str) else path
        known = ", ".join(allowed) if allowed else "none"
        message = f"unknown key '{extra}' (allowed keys: {known})"
    elif kind == "type":
        names = [expected] if isinstance(expected, str) else list(expected)
        want = " or ".join({"object": "mapping", "array": "list"}.get(n, n) for n in names)
        message = f"expected {want}, got {_yaml_type(inst)} {inst!r}"
        if path in _PATTERN_HINTS:
            message += f"; {_PATTERN_HINTS[path]}"
    elif kind == "enum":
        message = f"must be one of {', '.join(map(str, expected))}; got {inst!r}"
    elif kind == "pattern" and path in _PATTERN_HINTS:
        message = f"{_PATTERN_HINTS[path]}; got {inst!r}"
    elif kind in ("minProperties", "maxProperties") and path.endswith("speculative.draft"):
        message = f"give exactly one of {', '.join(error.schema.get('properties', {}))}"
    elif kind == "minItems" and not inst:
        message = "must not be empty"
    raise RecipeError(file, _line_for(lines, path), path, message)


def _check_finite(file: str, value: Any, path: str, lines: Mapping[str, int]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(file, _line_for(lines, path), path, f"must be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(file, v, _join(path, k), lines)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(file, v, _join(path, i), lines)


# --------------------------------------------------------------------------- passes


def _pass_spec(
    index: int,
    entry: Mapping[str, Any],
    registry: Mapping[str, type | None] | None,
    lines: Mapping[str, int],
    err: typing.Callable[[str, str], RecipeError],
) -> PassSpec:
    here = _join("passes", index)
    name: str = entry["name"]
    options: dict[str, Any] = copy.deepcopy(entry.get("options", {}))
    if registry is not None:
        if name not in registry:
            known = ", ".join(sorted(registry)) or "none"
            raise err(f"{here}.name", f"unknown pass '{name}' (known passes: {known})")
        _check_options(name, options, registry[name], f"{here}.options", err)
    return PassSpec(name=name, options=options, line=_line_for(lines, here) or 1)


def _check_options(
    pass_name: str,
    options: dict[str, Any],
    config: type | None,
    here: str,
    err: typing.Callable[[str, str], RecipeError],
) -> None:
    if config is None:
        if options:
            first = next(iter(options))
            raise err(_join(here, first), f"unknown option '{first}': pass '{pass_name}' takes no options")
        return
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"options type for pass '{pass_name}' must be a dataclass, got {config!r}")
    fields = {f.name: f for f in dataclasses.fields(config) if f.init}
    try:
        hints = typing.get_type_hints(config)
    except (NameError, TypeError):
        hints = {name: f.type for name, f in fields.items()}
    for key, value in options.items():
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise err(
                _join(here, key), f"unknown option '{key}' for pass '{pass_name}' (known options: {known})"
            )
        annotation = hints.get(key, Any)
        if not _matches(value, annotation):
            raise err(
                _join(here, key), f"expected {_type_name(annotation)}, got {_yaml_type(value)} {value!r}"
            )
    for name, f in fields.items():
        if (
            name not in options
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise err(here, f"missing required option '{name}' for pass '{pass_name}'")
    try:
        config(**options)
    except (ValueError, TypeError) as exc:
        raise err(here, f"invalid options for pass '{pass_name}': {exc}") from exc


def _matches(value: Any, annotation: Any) -> bool:
    """Whether a YAML value fits a (simple) type annotation of an options dataclass field."""
    if annotation is Any:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation in (list, tuple):
        return isinstance(value, list)
    if annotation is dict:
        return isinstance(value, dict)
    if origin in (list, tuple):
        item = args[0] if args else Any
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"unsupported option annotation {annotation!r}: use tuple[X, ...] or list[X]")
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        val = args[1] if len(args) == 2 else Any
        return isinstance(value, dict) and all(
            isinstance(k, str) and _matches(v, val) for k, v in value.items()
        )
    raise TypeError(f"unsupported option annotation {annotation!r}")


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[1])}" if len(args) == 2 else "mapping"
    return getattr(annotation, "__name__", str(annotation))


# --------------------------------------------------------------------------- helpers


def _resolve(base: Path, written: str) -> Path:
    return (base / Path(written).expanduser()).resolve()


def _opt_float(value: int | float | None) -> float | None:
    return None if value is None else float(value)
