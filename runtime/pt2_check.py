"""Refuse torch.export archives (model.pt2) that would unpickle anything opaque or run code when loaded.

``torch.export.load`` unpickles in several places: weights and constants saved with ``use_pickle``
(``torch.load(weights_only=False)``), script objects (``pickle.loads``), legacy weight and constant files,
the pre-2.7 archive layout, and the sample inputs (``torch.load(weights_only=True)``, which falls back to
``weights_only=False`` when that fails); an AOTInductor package loads a shared library. A manifest only
proves the bytes are the ones it lists: whoever can rewrite the manifest can rewrite the pickle. So before
the backend calls ``torch.export.load``, the archive is read here with the standard library only:

* only the members the pt2 format defines (version files, ``models/<m>.json``, the weight and constant
  configs and the raw tensor files they name, ``data/sample_inputs/<m>.pt``, ``extra/``);
* every weight and constant is a raw tensor (``use_pickle`` false, no script objects);
* the sample inputs are a torch zip whose pickles are *read without executing anything* by an
  unpickler that refuses every global except the few a tensor rebuild needs (and calls none of them);
* every program (``models/<m>.json``) passes runtime/pt2_program.py: its shape expressions (which torch hands
  to ``sympy.sympify``, i.e. evaluates as Python), node targets (resolved by ``getattr`` from ``torch``),
  guards (compiled into a function) and names are checked against grammars and allow-lists.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from runtime.artifact import ArtifactError
from runtime.pt2_program import check_program

__all__ = ["check_pt2"]

# What the sample-input pickle of a tensor tuple names (torch.save of tensors, ints, tuples, dicts).
_ALLOWED_GLOBALS = frozenset({
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("collections", "OrderedDict"),
    ("torch", "device"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "UntypedStorage"),
}) | {("torch", f"{k}Storage") for k in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short",
                                          "Char", "Byte", "Bool", "ComplexFloat", "ComplexDouble")}
_FIXED = frozenset({".data/version", ".data/serialization_id", "byteorder", "archive_format", "archive_version",
                    "data/weights/model_weights_config.json", "data/constants/model_constants_config.json"})
_MODEL = re.compile(r"^models/([A-Za-z0-9_.-]+)\.json$")


class _Inert:
    """What every allowed global becomes while scanning: accepts anything, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Scanner(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise ArtifactError(f"{self.where}: the pickle names {module}.{name}; only tensor data is "
                                "accepted (it would run when torch.export.load unpickles it)")
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return _Inert()


def _scan_pickle(data: bytes, where: str) -> None:
    try:
        _Scanner(data, where).load()
    except ArtifactError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed pickles are refused, whatever the error
        raise ArtifactError(f"{where}: unreadable pickle ({type(exc).__name__}: {exc})") from exc


def _check_torch_zip(data: bytes, where: str) -> None:
    try:
        inner = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise ArtifactError(f"{where}: not a torch zip file (a legacy pickle stream is refused)") from exc
    with inner:
        pickles = [n for n in inner.namelist() if n.endswith(".pkl")]
        if [n.rsplit("/", 1)[-1] for n in pickles] != ["data.pkl"]:
            raise ArtifactError(f"{where}: expected one data.pkl, found {pickles}")
        _scan_pickle(inner.read(pickles[0]), f"{where}:{pickles[0]}")


def _payloads(zf: zipfile.ZipFile, prefix: str, config_name: str, where: str) -> set[str]:
    name = prefix + config_name
    if name not in zf.namelist():
        return set()
    try:
        config = json.loads(zf.read(name))["config"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{where}: {config_name} is not a pt2 payload config: {exc}") from exc
    files = set()
    folder = config_name.rsplit("/", 1)[0] + "/"
    for fqn, meta in config.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False or not meta.get("tensor_meta"):
            raise ArtifactError(f"{where}: {fqn!r} in {config_name} is stored as a pickle or an opaque "
                                "object; only raw tensors are accepted")
        path = meta.get("path_name")
        if not isinstance(path, str) or "/" in path or path.startswith("."):
            raise ArtifactError(f"{where}: {fqn!r} in {config_name} has path_name {path!r}")
        files.add(folder + path)
    return files


def check_pt2(path: Path) -> None:
    """Raise ArtifactError naming the member when `path` would unpickle anything but tensor data."""
    where = str(path)
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"{where}: not a zip archive: {exc}") from exc
    with zf:
        names = zf.namelist()
        roots = {n.split("/", 1)[0] for n in names}
        if len(roots) != 1 or any("/" not in n for n in names):
            raise ArtifactError(f"{where}: expected one top-level folder in the archive, found {sorted(roots)}")
        prefix = roots.pop() + "/"
        rel = {n[len(prefix):] for n in names if not n.endswith("/")}
        if "archive_format" not in rel or zf.read(prefix + "archive_format").strip() != b"pt2":
            raise ArtifactError(f"{where}: not a pt2 archive (the legacy torch.export layout unpickles its "
                                "weights); re-export with this torch")
        models = {m.group(1) for n in rel if (m := _MODEL.match(n))}
        if not models:
            raise ArtifactError(f"{where}: no models/<name>.json program in the archive")
        allowed = set(_FIXED) | {f"models/{m}.json" for m in models} | \
            {f"data/sample_inputs/{m}.pt" for m in models}
        allowed |= _payloads(zf, prefix, "data/weights/model_weights_config.json", where)
        allowed |= _payloads(zf, prefix, "data/constants/model_constants_config.json", where)
        extra = sorted(n for n in rel - allowed if not n.startswith("extra/"))
        if extra:
            raise ArtifactError(f"{where}: unexpected member(s) {extra[:5]}: only programs, raw tensors and "
                                "configs are accepted (pickles, legacy weight files and compiled libraries are not)")
        for m in sorted(models):
            member = f"models/{m}.json"
            try:
                program = json.loads(zf.read(prefix + member))
            except ValueError as exc:
                raise ArtifactError(f"{where}:{member}: not JSON: {exc}") from exc
            check_program(program, f"{where}:{member}")
            member = f"data/sample_inputs/{m}.pt"
            if member in rel:
                _check_torch_zip(zf.read(prefix + member), f"{where}:{member}")
