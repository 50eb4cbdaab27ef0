"""A torch artifact whose model.pt2 carries a pickle is refused at load, even with its manifest re-hashed
(verify passes): the archive is read without unpickling before torch.export.load runs."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
from conftest import make_random_checkpoint, write_recipe

from runtime.artifact import ArtifactError, read_manifest, verify_artifact, write_manifest
from runtime.engine import LLM
from runtime.pt2_check import check_pt2
from runtime.sampling import SamplingParams


class _Payload:
    """Unpickling this writes a marker file: what an attacker's code would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


@pytest.fixture(scope="module")
def torch_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from compiler.build import build

    folder = tmp_path_factory.mktemp("pt2")
    ckpt = make_random_checkpoint(folder / "ckpt", "LlamaForCausalLM", seed=3)
    return build(write_recipe(folder, ckpt, backend="torch"), progress=False)


def _rewrite(pt2: Path, change: dict[str, bytes | None]) -> None:
    """Rewrite members of the zip (None: remove), keeping the others byte for byte."""
    src = zipfile.ZipFile(pt2)
    prefix = src.namelist()[0].split("/", 1)[0] + "/"
    buf = io.BytesIO()
    with src, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            rel = info.filename[len(prefix):]
            if rel in change:
                continue
            dst.writestr(info, src.read(info.filename))
        for rel, data in change.items():
            if data is not None:
                dst.writestr(prefix + rel, data)
    pt2.write_bytes(buf.getvalue())


def _tampered(artifact: Path, dest: Path, change: dict[str, bytes | None]) -> Path:
    shutil.copytree(artifact, dest)
    _rewrite(dest / "model.pt2", change)
    write_manifest(dest, read_manifest(dest))  # the attacker re-hashes: verify passes
    assert verify_artifact(dest) == []
    return dest


def _torch_zip(obj: object) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_clean_archive_passes_and_runs(torch_artifact: Path) -> None:
    check_pt2(torch_artifact / "model.pt2")
    out = LLM(torch_artifact, threads=1).generate("def f(x):", SamplingParams(max_tokens=4, temperature=0.0,
                                                                             ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_pickled_weight_is_refused(torch_artifact: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with zipfile.ZipFile(torch_artifact / "model.pt2") as zf:
        prefix = zf.namelist()[0].split("/", 1)[0] + "/"
        config = json.loads(zf.read(prefix + "data/weights/model_weights_config.json"))
    fqn, meta = next(iter(config["config"].items()))
    meta["use_pickle"] = True
    bad = _tampered(torch_artifact, tmp_path / "bad", {
        "data/weights/model_weights_config.json": json.dumps(config).encode(),
        f"data/weights/{meta['path_name']}": _torch_zip(_Payload(marker)),
    })
    with pytest.raises(ArtifactError, match=f"{fqn!r} in data/weights/model_weights_config.json is stored as a pickle"):
        LLM(bad, threads=1)
    assert not marker.exists()


def test_malicious_sample_inputs_are_refused(torch_artifact: Path, tmp_path: Path) -> None:
    """torch.export.load reads sample inputs with weights_only=True and, when that fails, retries with
    weights_only=False: the payload below would run there."""
    marker = tmp_path / "marker"
    bad = _tampered(torch_artifact, tmp_path / "bad", {
        "data/sample_inputs/model.pt": _torch_zip(((_Payload(marker),), {})),
    })
    with pytest.raises(ArtifactError, match=r"the pickle names (__builtin__|builtins)\.exec"):
        LLM(bad, threads=1)
    assert not marker.exists()


@pytest.mark.parametrize("member,data,words", [
    ("data/weights/model.pt", b"\x80\x04K\x01.", "unexpected member(s) ['data/weights/model.pt']"),
    ("data/aotinductor/model/model.so", b"\x7fELF", "unexpected member(s) ['data/aotinductor/model/model.so']"),
    ("archive_format", b"legacy", "not a pt2 archive"),
])
def test_legacy_and_compiled_members_are_refused(torch_artifact: Path, tmp_path: Path, member: str, data: bytes,
                                                 words: str) -> None:
    bad = _tampered(torch_artifact, tmp_path / "bad", {member: data})
    with pytest.raises(ArtifactError, match=__import__("re").escape(words)):
        check_pt2(bad / "model.pt2")
