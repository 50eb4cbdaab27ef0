"""The repository's licence (Apache-2.0, as pyproject.toml says) and its notices: every file that declares a
third-party ABI, or names a borrowed algorithm or constant, is listed in THIRD_PARTY_NOTICES with that source,
and the demo model says where its text comes from and under which licence."""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# sha256 of the Apache License 2.0 text as published (https://www.apache.org/licenses/LICENSE-2.0.txt)
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

# What marks a file as declaring a third-party ABI, and the section of THIRD_PARTY_NOTICES that must name it.
ABI_MARKERS = {
    "ONNX Runtime C API": re.compile(r"^\s*typedef\s+(struct|enum)\b[^;]*\bOrt[A-Z]\w*", re.M),
    "DLPack": re.compile(r"^\s*typedef\s+struct\s+DL(Managed)?Tensor\b", re.M),
}
# Borrowed algorithms and constants, by the name (or value) a file uses for them.
SOURCE_MARKERS = {
    "Cephes": re.compile(r"\bCephes\b"),
    "xoshiro256**": re.compile(r"xoshiro", re.I),
    "splitmix64": re.compile(r"splitmix", re.I),
    "fdlibm": re.compile(r"0x1\.62e42fee|0x1\.a39ef35793c76p-33|6\.93147180369123816490e-01"),
}


def _notice_sections() -> dict[str, str]:
    """THIRD_PARTY_NOTICES split at its numbered headings: heading -> body."""
    text = (ROOT / "THIRD_PARTY_NOTICES").read_text(encoding="utf-8")
    parts = re.split(r"^(\d+\. .+)\n-+\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _files_named(body: str) -> set[str]:
    files = re.search(r"^Files: (.+?)\n\n", body, re.M | re.S)
    assert files, "a notice without its Files: line"
    return set(re.findall(r"[\w./-]+\.(?:c|h|py|txt|md)\b", files.group(1)))


def _sources(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*")
                  if p.suffix in (".c", ".h", ".py") and "__pycache__" not in p.parts)


def test_the_licence_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256, "LICENSE is not the Apache License 2.0 text"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] in ({"text": "Apache-2.0"}, "Apache-2.0")


def test_every_declared_abi_is_in_the_notices() -> None:
    sections = _notice_sections()
    declaring = {}
    for path in _sources(("runtime/kernels", "runtime/core")):
        for abi, marker in ABI_MARKERS.items():
            if marker.search(path.read_text(encoding="utf-8")):
                declaring[path.relative_to(ROOT).as_posix()] = abi
    assert "runtime/kernels/ort_api.h" in declaring  # the check sees the one it must
    for rel, abi in declaring.items():
        section = next((b for h, b in sections.items() if abi in h), None)
        assert section is not None, f"{rel} declares the {abi} but THIRD_PARTY_NOTICES has no section for it"
        assert rel in _files_named(section), f"{rel} declares the {abi}: name it in that notice's Files: line"
        assert "License" in section


def test_every_borrowed_algorithm_or_constant_is_in_the_notices() -> None:
    sections = _notice_sections()
    found: dict[str, set[str]] = {}
    for path in _sources(("runtime", "compiler", "bench")):
        text = path.read_text(encoding="utf-8")
        for source, marker in SOURCE_MARKERS.items():
            if marker.search(text):
                found.setdefault(source, set()).add(path.relative_to(ROOT).as_posix())
    assert set(found) == set(SOURCE_MARKERS), f"markers that match nothing: {set(SOURCE_MARKERS) - set(found)}"
    for source, files in found.items():
        section = next((b for h, b in sections.items() if source in h), None)
        assert section is not None, f"{sorted(files)} use {source}: THIRD_PARTY_NOTICES has no section for it"
        missing = files - _files_named(section)
        assert not missing, f"{sorted(missing)} use {source}: name them in that notice's Files: line"


def test_the_demo_data_names_its_source_and_licence() -> None:
    sections = _notice_sections()
    data = next(b for h, b in sections.items() if "CPython standard library" in h)
    assert {"models/pycode-llama-6m/calib.txt", "models/pycode-llama-6m/eval.txt"} <= _files_named(data)
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in data
    readme = (ROOT / "models" / "pycode-llama-6m" / "README.md").read_text(encoding="utf-8")
    assert "CPython **3.11.7** standard-library source" in readme
    assert "Python Software Foundation License Version 2" in readme and "THIRD_PARTY_NOTICES" in readme
