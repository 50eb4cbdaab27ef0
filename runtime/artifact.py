"""The artifact format: manifest schema, writing, reading, integrity and compatibility checks.

An artifact is a folder ``<output>/<name>/<version>/`` holding ``manifest.json`` (what was
built: provenance, target, passes, quality, and the size and sha256 of every payload file),
``build.json`` (run-to-run facts -- timings, host, absolute paths; neither hashed nor part of
the payload) and the payload files (``model.onnx``, ``tokenizer/...``, ``runtime.json``, ...).

The format is defined here, once, on the runtime side; the compiler writes through this
module. It imports only the standard library so that ``optimize verify`` and the serving
process stay light (never ``compiler``, never ``torch``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "BUILD_INFO",
    "MANIFEST",
    "SCHEMA_VERSION",
    "Artifact",
    "ArtifactError",
    "IncompatibleArtifactError",
    "check_version_unused",
    "describe",
    "file_entries",
    "quality_line",
    "read_manifest",
    "sha256_file",
    "verify_artifact",
    "write_build_info",
    "write_manifest",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1.0.0"
MANIFEST = "manifest.json"
BUILD_INFO = "build.json"
_NOT_PAYLOAD = frozenset({MANIFEST, BUILD_INFO})
_CHUNK = 1 << 20
_SEMVER = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)([-+][0-9A-Za-z.+-]*)?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ArtifactError(Exception):
    """An artifact is missing, unreadable, corrupt or malformed; the message names the file(s)."""


class IncompatibleArtifactError(ArtifactError):
    """The artifact's schema major version is not the one this runtime reads."""


# --------------------------------------------------------------------------- hashing and listing


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _scan(root: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Payload files under root by posix relative path, plus entries that are not regular files."""
    files: dict[str, Path] = {}
    odd: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in list(dirnames):
            if (here / d).is_symlink():
                odd[(here / d).relative_to(root).as_posix()] = (
                    "is a symlink; payload files must be regular files"
                )
                dirnames.remove(d)
        dirnames.sort()
        for name in filenames:
            full = here / name
            rel = full.relative_to(root).as_posix()
            if rel in _NOT_PAYLOAD:
                continue
            if full.is_symlink():
                odd[rel] = "is a symlink; payload files must be regular files"
            elif not full.is_file():
                odd[rel] = "is not a regular file"
            else:
                files[rel] = full
    return files, odd


def file_entries(root: Path) -> list[dict[str, Any]]:
    """``{"path", "bytes", "sha256"}`` for every payload file under root, sorted by path.

    manifest.json and build.json at the top level are not payload. Raises ArtifactError for
    symlinks and special files, which an artifact must not contain.
    """
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"{root}: not a folder")
    files, odd = _scan(root)
    if odd:
        raise ArtifactError("\n".join(f"{root / rel}: {why}" for rel, why in sorted(odd.items())))
    return [
        {"path": rel, "bytes": files[rel].stat().st_size, "sha256": sha256_file(files[rel])}
        for rel in sorted(files)
    ]


# --------------------------------------------------------------------------- writing


def _check_json(value: Any, where: str, file: Path) -> None:
    """Refuse what would make the manifest non-deterministic or not strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ArtifactError(f"{file}: {where} is {value}; NaN and infinity are not allowed in a manifest")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ArtifactError(f"{file}: {where} has a non-string key {key!r}")
            _check_json(item, f"{where}.{key}", file)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", file)
    elif not (value is None or isinstance(value, str | int | float)):
        raise ArtifactError(f"{file}: {where} is a {type(value).__name__}, not JSON data")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(text.encode("utf-8"))
    os.replace(tmp, path)


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    """Fill ``schema_version`` and ``files`` into ``manifest`` (in place) and write manifest.json.

    The bytes are deterministic: sorted keys, 2-space indent, UTF-8, trailing newline. Floats
    must be finite. Call this last, once every payload file is in place.
    """
    root = Path(root)
    path = root / MANIFEST
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: the manifest must be a dict, got {type(manifest).__name__}")
    for key in ("name", "version"):
        if not isinstance(manifest.get(key), str) or not manifest[key]:
            raise ArtifactError(f"{path}: the manifest needs a non-empty string '{key}'")
    manifest["schema_version"] = SCHEMA_VERSION
    manifest["files"] = file_entries(root)
    _check_json(manifest, "manifest", path)
    _atomic_write(path, json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False) + "\n")
    log.debug("wrote %s (%d payload files)", path, len(manifest["files"]))
    return path


def write_build_info(root: Path, info: dict[str, Any]) -> Path:
    """Write build.json: the run-to-run facts (timings, host, absolute paths). Paths become strings."""
    path = Path(root) / BUILD_INFO

    def default(value: Any) -> Any:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise TypeError(f"{type(value).__name__} is not JSON data")

    try:
        text = json.dumps(
            info, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False, default=default
        )
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{path}: cannot write build info: {exc}") from exc
    _atomic_write(path, text + "\n")
    return path


# --------------------------------------------------------------------------- reading


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _major(version: str) -> int:
    return int(version.split(".", 1)[0])


def _check_files(path: Path, files: Any) -> None:
    if not isinstance(files, list):
        raise ArtifactError(f"{path}: 'files' must be a list")
    seen: set[str] = set()
    for i, entry in enumerate(files):
        where = f"{path}: files[{i}]"
        if not isinstance(entry, dict):
            raise ArtifactError(f"{where} must be an object with path, bytes and sha256")
        rel = entry.get("path")
        if not isinstance(rel, str) or not rel:
            raise ArtifactError(f"{where}.path must be a non-empty string")
        pure = PurePosixPath(rel)
        if pure.is_absolute() or "\\" in rel or any(part in ("", ".", "..") for part in rel.split("/")):
            raise ArtifactError(f"{where}.path {rel!r} must be a relative path inside the artifact")
        if rel in _NOT_PAYLOAD or rel in seen:
            raise ArtifactError(f"{where}.path {rel!r} is reserved or listed twice")
        seen.add(rel)
        size = entry.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ArtifactError(f"{where}.bytes must be a non-negative integer ({rel})")
        if not isinstance(entry.get("sha256"), str) or not _SHA256.match(entry["sha256"]):
            raise ArtifactError(f"{where}.sha256 must be 64 lowercase hex digits ({rel})")


def read_manifest(root: Path) -> dict[str, Any]:
    """Read and check manifest.json; refuse a schema of another major version."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact folder")
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; {root} is not a built artifact")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{path}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from exc
    except (UnicodeDecodeError, ValueError, OSError) as exc:
        raise ArtifactError(f"{path}: unreadable: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: must hold a JSON object")
    schema = manifest.get("schema_version")
    if not isinstance(schema, str) or not _SEMVER.match(schema):
        raise ArtifactError(f"{path}: 'schema_version' must be a semver string, got {schema!r}")
    if _major(schema) != _major(SCHEMA_VERSION):
        raise IncompatibleArtifactError(
            f"{path}: artifact schema {schema} is not supported by this runtime "
            f"(supports {_major(SCHEMA_VERSION)}.x, {SCHEMA_VERSION})"
        )
    if schema != SCHEMA_VERSION:
        log.info("%s: artifact schema %s, this runtime reads %s", path, schema, SCHEMA_VERSION)
    for key in ("name", "version"):
        if not isinstance(manifest.get(key), str) or not manifest[key]:
            raise ArtifactError(f"{path}: '{key}' must be a non-empty string")
    _check_files(path, manifest.get("files"))
    return manifest


def _verify(root: Path, manifest: dict[str, Any]) -> list[str]:
    listed = {e["path"]: e for e in manifest["files"]}
    found, odd = _scan(root)
    problems: dict[str, str] = {}
    for rel, why in odd.items():
        problems[rel] = f"{rel}: {why}"
    for rel, entry in listed.items():
        if rel in problems:
            continue
        if rel not in found:
            problems[rel] = f"{rel}: missing (listed in {MANIFEST})"
            continue
        size = found[rel].stat().st_size
        if size != entry["bytes"]:
            problems[rel] = f"{rel}: size differs (expected {entry['bytes']} bytes, found {size})"
            continue
        digest = sha256_file(found[rel])
        if digest != entry["sha256"]:
            problems[rel] = f"{rel}: sha256 differs (expected {entry['sha256']}, found {digest})"
    for rel in found.keys() - listed.keys():
        problems[rel] = f"{rel}: extra file, not listed in {MANIFEST}"
    return [problems[rel] for rel in sorted(problems)]


def verify_artifact(root: Path) -> list[str]:
    """Check every payload file against the manifest; one problem string per bad file, [] if intact.

    Raises ArtifactError (or IncompatibleArtifactError) when the manifest itself is unusable.
    """
    root = Path(root)
    return _verify(root, read_manifest(root))


# --------------------------------------------------------------------------- the loaded artifact


@dataclass
class Artifact:
    """An artifact folder and its manifest, checked on open."""

    root: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Artifact:
        """Read the manifest and (by default) verify every file; raise ArtifactError on any problem."""
        root = Path(path)
        manifest = read_manifest(root)
        if verify:
            problems = _verify(root, manifest)
            if problems:
                listing = "\n".join(f"  {p}" for p in problems)
                raise ArtifactError(
                    f"artifact {root} failed verification ({len(problems)} problem(s)):\n{listing}"
                )
        return cls(root=root, manifest=manifest)

    @property
    def name(self) -> str:
        return str(self.manifest["name"])

    @property
    def version(self) -> str:
        return str(self.manifest["version"])

    @property
    def runtime_config(self) -> dict[str, Any]:
        """The serving defaults from runtime.json."""
        path = self.root / "runtime.json"
        try:
            config = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_reject_constant)
        except FileNotFoundError as exc:
            raise ArtifactError(f"{path}: missing") from exc
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{path}: unreadable: {exc}") from exc
        if not isinstance(config, dict):
            raise ArtifactError(f"{path}: must hold a JSON object")
        return config

    @property
    def model_path(self) -> Path:
        """The model file named by runtime.json (model.onnx, or model.pt2 for the torch backend)."""
        name = self.runtime_config.get("model_file", "model.onnx")
        if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
            raise ArtifactError(f"{self.root / 'runtime.json'}: model_file must be a file name, got {name!r}")
        return self.root / name

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    def manifest_sha256(self) -> str:
        """sha256 of the manifest.json bytes: one id for everything the artifact holds."""
        return sha256_file(self.root / MANIFEST)

    def check_runtime(self, *, num_blocks: int | None = None, max_model_len: int | None = None,
                      device: str | None = None, max_num_seqs: int | None = None,
                      max_num_batched_tokens: int | None = None) -> RuntimeLimits:
        """runtime.json, checked against the model before anything is allocated (ArtifactError if wrong), and the
        serving limits in effect: the one place they are computed, which every later reader takes.

        Checks the types of the fields the runtime reads; that the context (max_model_len, or the
        override) fits the model's positions (model.max_position_embeddings and the rows of the ONNX
        graph's rotary cache); and, on the CPU, that the KV pool fits the memory available now.
        `num_blocks` / `max_model_len` / `device` / `max_num_seqs` / `max_num_batched_tokens`: the serving
        overrides (a max_model_len override never raises the artifact's).
        """
        path = self.root / "runtime.json"
        cfg = self.runtime_config
        sched = _section(cfg, "scheduler", path)
        kv = _section(cfg, "kv_cache", path)
        model = _section(cfg, "model", path)
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive(sched, key, f"{path}: scheduler.{key}")
        _positive(kv, "block_size", f"{path}: kv_cache.block_size")
        if "num_blocks" in kv or num_blocks is None:
            _positive(kv, "num_blocks", f"{path}: kv_cache.num_blocks")
        _positive(model, "vocab_size", f"{path}: model.vocab_size")
        context = min(max_model_len or sched["max_model_len"], sched["max_model_len"])
        positions = model.get("max_position_embeddings")
        if positions is not None:
            _positive(model, "max_position_embeddings", f"{path}: model.max_position_embeddings")
            if context > positions:
                raise ArtifactError(f"{path}: scheduler.max_model_len {context} is over the model's "
                                    f"max_position_embeddings {positions}")
        rows = _rotary_rows(self.root / str(cfg.get("model_file", "model.onnx")))
        if rows is not None and context > rows:
            raise ArtifactError(f"{path}: scheduler.max_model_len {context} is over the {rows} positions of the "
                                "model's rotary cache (rotary_cos_cache)")
        geometry = [model.get(k) for k in ("num_layers", "num_kv_heads", "head_dim")]
        if (device or cfg.get("device", "cpu")) == "cpu" and all(_is_pos_int(v) for v in geometry):
            blocks = num_blocks or kv["num_blocks"]
            width = _DTYPE_BYTES.get(str(kv.get("dtype", "float32")), 4)
            layers, heads, dim = geometry
            need = 2 * layers * blocks * kv["block_size"] * heads * dim * width
            free = _available_memory()
            if free is not None and need > free:
                raise ArtifactError(f"{path}: a KV pool of {blocks} blocks needs {need / 2**30:.1f} GiB; "
                                    f"{free / 2**30:.1f} GiB of memory is available (lower kv_cache.num_blocks "
                                    "or --num-kv-blocks)")
        return RuntimeLimits(max_model_len=context, num_blocks=int(num_blocks or kv["num_blocks"]),
                             max_num_seqs=int(max_num_seqs or sched["max_num_seqs"]),
                             max_num_batched_tokens=int(max_num_batched_tokens or sched["max_num_batched_tokens"]))


@dataclass(frozen=True)
class RuntimeLimits:
    """The serving limits in effect (Artifact.check_runtime): runtime.json's, with the serving overrides."""

    max_model_len: int  # the context, at most runtime.json's (which the build clamped to the model's positions)
    num_blocks: int  # KV blocks in the pool
    max_num_seqs: int
    max_num_batched_tokens: int


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1,
                "fp8": 1, "int4": 1}


def _is_pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _section(cfg: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    section = cfg.get(name)
    if not isinstance(section, dict):
        raise ArtifactError(f"{path}: '{name}' must be an object")
    return section


def _positive(section: dict[str, Any], key: str, where: str) -> int:
    v = section.get(key)
    if not _is_pos_int(v):
        raise ArtifactError(f"{where} must be a positive integer, got {v!r}")
    return v


def _rotary_rows(model_file: Path) -> int | None:
    """Rows of the ONNX graph's rotary_cos_cache initializer (the positions it can rotate), or None when
    there is none. Reads the protobuf wire format directly (model -> graph -> initializer: name, dims),
    skipping every other field, so the serving side needs no `onnx` package."""
    if model_file.suffix != ".onnx" or not model_file.is_file():
        return None
    try:
        with open(model_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for field_no, start, end in _pb_fields(buf, 0, len(buf)):
                if field_no != 7:  # ModelProto.graph
                    continue
                for gfield, gs, ge in _pb_fields(buf, start, end):
                    if gfield != 5:  # GraphProto.initializer (TensorProto)
                        continue
                    name, dims = None, []
                    for tfield, ts, te in _pb_fields(buf, gs, ge, varints=True):
                        if tfield == 8:
                            name = bytes(buf[ts:te])
                        elif tfield == 1:  # dims: one varint, or packed varints
                            dims.extend(_pb_varints(buf, ts, te) if te > ts else [ts])
                    if name == b"rotary_cos_cache" and dims:
                        return int(dims[0])
    except (OSError, ValueError, IndexError) as exc:
        raise ArtifactError(f"{model_file}: not a readable ONNX model: {exc}") from exc
    return None


def _pb_varint(buf: Any, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def _pb_varints(buf: Any, start: int, end: int) -> list[int]:
    out = []
    while start < end:
        v, start = _pb_varint(buf, start)
        out.append(v)
    return out


def _pb_fields(buf: Any, start: int, end: int, varints: bool = False) -> Any:
    """(field number, start, end) of each length-delimited field in buf[start:end]; with `varints`, a
    varint field is yielded as (field number, value, value) (an empty range holding its value)."""
    i = start
    while i < end:
        key, i = _pb_varint(buf, i)
        field_no, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _pb_varint(buf, i)
            if varints:
                yield field_no, v, v
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = _pb_varint(buf, i)
            if i + n > end:
                raise ValueError("a field runs past its message")
            yield field_no, i, i + n
            i += n
        else:
            raise ValueError(f"protobuf wire type {wire} is not read here")


def _available_memory() -> int | None:
    """Bytes of memory available now (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_version_unused(output_root: Path, name: str, version: str) -> Path:
    """``output_root/name/version``, refusing a version folder that already holds anything."""
    for what, value in (("name", name), ("version", version)):
        if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value:
            raise ArtifactError(f"artifact {what} {value!r} is not a single folder name")
    dest = Path(output_root) / name / version
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ArtifactError(
            f"artifact {name} {version} already exists at {dest}; versions are immutable: "
            "bump `version` in the recipe or remove it"
        )
    return dest


# --------------------------------------------------------------------------- describing


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list | tuple):
        return ", ".join(_short(v) for v in value) or "-"
    return "-" if value is None else str(value)


def _line(value: Any, limit: int = 200) -> str:
    text = _short(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _sha_of(section: Any) -> str:
    if isinstance(section, dict):
        return str(section.get("sha256", _line(section)))
    return _line(section)


def quality_line(quality: Any) -> str:
    """The manifest's quality record in one line (inspect's `quality` row; verify and serve print it as
    "quality: <line>"): the measured values and whether they passed, or "not evaluated (reason)" when the
    gate could not run on the build machine, or "no bounds set" when the recipe gave nothing to gate."""
    if not isinstance(quality, dict):
        return _line(quality)
    bounds = quality.get("bounds")
    if quality.get("evaluated") is False:
        reason = str(quality.get("reason", "no reason recorded"))
        if bounds is None:  # a manifest from before the record kept its bounds
            return f"not evaluated ({reason})"
        if bounds == {} and quality.get("eval_data") is None:
            return f"no bounds set: nothing gated ({reason})"
        if not bounds:
            return f"not evaluated ({reason}); no bounds set"
        allowed = f", allowed by {quality['allowed_by']}" if quality.get("allowed_by") else ""
        return f"not evaluated ({reason}); bounds not checked: {_short(bounds)}{allowed}"
    m = quality.get("metrics")
    if not isinstance(m, dict):
        return _line(quality)
    shown = [f"{label} {_short(m[k])}" for k, label in (
        ("perplexity", "perplexity"), ("perplexity_increase_pct", "change %"), ("kl_divergence", "KL"),
        ("token_agreement", "token agreement")) if k in m]
    if "perplexity_increase_se_pct" in m and "perplexity_increase_ci_pct" in m:  # gates with error bars
        ci = m["perplexity_increase_ci_pct"]
        shown = [f"{t} +- {_short(m['perplexity_increase_se_pct'])} (95% interval {_short(ci[0])}..{_short(ci[1])}, "
                 f"{m.get('eval_chunks', '?')} chunks)" if t.startswith("change %") else t for t in shown]
    if not bounds:
        return "measured, no bounds set: " + ", ".join(shown)
    return (f"{'passed' if quality.get('passed') else 'not passed'}: " + ", ".join(shown)
            + f" (bounds: {_short(bounds)})")


def pass_changes(entry: dict[str, Any]) -> str:
    """One line saying what a pass changed, from its manifest record (nodes before -> after,
    fusions fired, weights quantized, kernels chosen, plans made); the whole record is in --json."""
    if entry.get("status") == "skipped":
        return f"skipped: {entry.get('reason', '-')}"
    st = entry.get("stats") or {}
    if not isinstance(st, dict):
        return _line(st)
    parts: list[str] = []
    if "nodes_before" in st and ("nodes_after" in st or "nodes" in st):
        parts.append(f"nodes {st['nodes_before']} -> {st.get('nodes_after', st.get('nodes'))}")
        per_layer = st.get("nodes_per_layer")
        if isinstance(per_layer, dict) and per_layer.get("before") and per_layer.get("after"):
            parts[-1] += f" (per decoder layer {per_layer['before']} -> {per_layer['after']})"
    elif "nodes" in st or "graph_nodes" in st:
        parts.append(f"nodes {st.get('nodes', st.get('graph_nodes'))}")
    fusions = st.get("fusions")
    if isinstance(fusions, dict):
        fired = [f"{k} x{v}" for k, v in fusions.items() if isinstance(v, int) and v]
        parts.append("fused: " + ", ".join(fired) if fired else "no fusion fired")
    if "quantized_count" in st:
        schemes = st.get("schemes") or {}
        kept = sorted((st.get("not_quantized") or {}).keys())
        parts.append(f"quantized {st['quantized_count']} weights ({_short(schemes)})"
                     + (f", float: {', '.join(kept)}" if kept else ""))
    if st.get("matmulnbits_fused"):
        parts.append(f"MatMulNBits x{st['matmulnbits_fused']}")
    if st.get("int8_matmuls"):
        parts.append(f"{st.get('int8_op')} x{st['int8_matmuls']} (int8 activations {st.get('int8_activations')}, "
                     f"{st.get('int8_input_quantizations')} input quantizations)")
    linears = [f"{label} Linears x{st[key]}" for key, label in (("fp8_linears", "FP8"), ("int4_linears", "INT4"))
               if st.get(key)]
    if linears:
        parts.append(f"{', '.join(linears)} ({st.get('weight_bytes', 0):,} of "
                     f"{st.get('float_weight_bytes', 0):,} weight bytes)")
    if st.get("activation_qdq_pairs"):
        parts.append(f"activation Q/DQ x{st['activation_qdq_pairs']}")
    if isinstance(st.get("kv_cache"), dict):
        parts.append(f"KV cache {st['kv_cache'].get('dtype')}")
    for key in ("choice", "kernel", "chosen"):
        if isinstance(st.get(key), str):
            how = st.get("chosen_by") or st.get("reason") or st.get("by")
            parts.append(f"chose {st[key]}" + (f" ({how})" if how else ""))
            break
    if "decode_buckets" in st:
        parts.append(f"decode buckets {_short(st['decode_buckets'])}; capturable "
                     f"{'yes' if st.get('capturable') else 'no'}; applies {'yes' if st.get('applies') else 'no'}")
    if "engine_bytes" in st and "tensorrt_version" in st:
        profiles = [p.get("name") for p in st.get("profiles") or [] if isinstance(p, dict)]
        parts.append(f"TensorRT {st['tensorrt_version']} engine for {st.get('gpu')} "
                     f"({st.get('compute_capability')}): {st.get('layers')} layers, {st['engine_bytes']:,} bytes, "
                     f"profiles {', '.join(map(str, profiles))}")
    if "weights_bytes" in st:
        parts.append(f"{len(st.get('files') or [])} files, weights {st['weights_bytes']:,} bytes")
    return "; ".join(parts) if parts else _line(st, 160)


def describe(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows summarising a manifest, for ``optimize inspect``; a readable manifest with
    fields of unexpected types is shown raw, field by field, rather than refused."""
    try:
        return _describe(manifest)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        log.debug("describe: falling back to raw fields", exc_info=True)
        return [*((str(k), _line(v)) for k, v in manifest.items()),
                ("note", f"some fields have unexpected types ({type(exc).__name__}: {_line(exc, 120)}); shown raw")]


def _describe(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("name", _line(manifest.get("name"))),
        ("version", _line(manifest.get("version"))),
        ("schema", _line(manifest.get("schema_version"))),
    ]
    if "created_by" in manifest:
        rows.append(("created by", _line(manifest["created_by"])))
    rows.append(("source sha256", _sha_of(manifest.get("source"))))
    rows.append(("recipe sha256", _sha_of(manifest.get("recipe"))))
    target = manifest.get("target")
    if isinstance(target, dict):
        main = [str(target[k]) for k in ("backend", "device", "dtype") if k in target]
        rest = {k: v for k, v in target.items() if k not in ("backend", "device", "dtype")}
        rows.append(("target", " ".join(main) + (f" ({_short(rest)})" if rest else "")))
    else:
        rows.append(("target", _line(target)))
    for i, entry in enumerate(manifest.get("passes") or []):
        if isinstance(entry, dict):
            rows.append((f"pass {entry.get('name', i)}", pass_changes(entry)))
        else:
            rows.append((f"pass {i}", _line(entry)))
    kernels = manifest.get("kernels")
    if isinstance(kernels, dict):
        rows.append(("kernels", ", ".join(
            f"{k}: {v.get('implementation', _short(v)) if isinstance(v, dict) else v}" for k, v in kernels.items())))
    elif kernels is not None:
        rows.append(("kernels", _line(kernels)))
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict):
        cls = tok.get("class")
        where = (f"tokenizer.json as found ({cls})" if tok.get("source") == "file"
                 else f"resolved by transformers' {cls} (replaces the file's {_short(tok.get('resolved'))})")
        parity = tok.get("parity") or {}
        rows.append(("tokenizer", f"{where}; parity with transformers on {parity.get('texts')} texts, "
                                  f"{parity.get('tokens')} tokens"))
    elif tok is not None:
        rows.append(("tokenizer", _line(tok)))
    spec = manifest.get("speculative")
    if isinstance(spec, dict) and isinstance(spec.get("draft"), dict):
        d = spec["draft"]
        layers = f", {d['num_layers']} layers" if d.get("num_layers") else ""
        rows.append(("speculative", f"draft {d.get('name')} {d.get('version')} at {d.get('path')} "
                                    f"(manifest sha256 {str(d.get('manifest_sha256'))[:12]}{layers}; "
                                    f"from {d.get('source')}), k={spec.get('num_tokens')}"))
    elif spec is not None:
        rows.append(("speculative", _line(spec)))
    cg = manifest.get("cuda_graphs")
    if isinstance(cg, dict):
        text = f"{'applies' if cg.get('applies') else 'does not apply'}: {cg.get('reason', '-')}"
        if "decode_buckets" in cg:
            text += f"; buckets {_short(cg['decode_buckets'])}, capturable {'yes' if cg.get('capturable') else 'no'}"
        rows.append(("cuda graphs", text))
    elif cg is not None:
        rows.append(("cuda graphs", _line(cg)))
    if "quality" in manifest:
        rows.append(("quality", quality_line(manifest["quality"])))
    files = [f for f in manifest.get("files") or [] if isinstance(f, dict)]
    total = sum(int(f.get("bytes", 0)) for f in files)
    rows.append(("files", f"{len(files)} files, {total:,} bytes ({total / 2**20:.1f} MiB)"))
    return rows
