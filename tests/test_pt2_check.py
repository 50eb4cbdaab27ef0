"""A torch artifact whose model.pt2 carries a pickle, or a program string torch would evaluate or resolve to
code, is refused at load, even with its manifest re-hashed (verify passes): the archive is read without
unpickling, and the program JSON checked against grammars and allow-lists, before torch.export.load runs."""

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
from runtime.pt2_program import ALLOWED_TARGETS, check_expression, check_guard
from runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


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


# ---- the program JSON: what torch.export.load evaluates or resolves ------------------------------------------


def _program(artifact: Path) -> dict:
    with zipfile.ZipFile(artifact / "model.pt2") as zf:
        prefix = zf.namelist()[0].split("/", 1)[0] + "/"
        return json.loads(zf.read(prefix + "models/model.json"))


def _tampered_program(artifact: Path, dest: Path, program: dict) -> Path:
    return _tampered(artifact, dest, {"models/model.json": json.dumps(program).encode()})


def _first_node(program: dict, op: str) -> dict:
    return next(n for n in program["graph_module"]["graph"]["nodes"] if n["target"] == op)


def test_sympify_payload_is_refused_and_runs_nothing(torch_artifact: Path, tmp_path: Path) -> None:
    """torch.export.load hands every expr_str to sympy.sympify, which evaluates it as Python: a tampered
    expression would run at load. It is refused, naming the file, the tensor and the string."""
    marker = tmp_path / "MARKER"
    program = _program(torch_artifact)
    sizes = program["graph_module"]["graph"]["tensor_values"]["input_ids"]["sizes"]
    payload = f"__import__('os').system('touch {marker}') or s0"
    sizes[0]["as_expr"]["expr_str"] = payload
    bad = _tampered_program(torch_artifact, tmp_path / "bad", program)
    with pytest.raises(ArtifactError) as err:
        LLM(bad, threads=1)
    assert not marker.exists(), "the payload ran"
    message = str(err.value)
    assert f"{bad / 'model.pt2'}:models/model.json" in message and "node 'input_ids'" in message
    assert f"expr_str {payload!r} refused" in message


@pytest.mark.parametrize("target", ["builtins.exec", "torch.os.system", "_operator.methodcaller",
                                    "math.__loader__.load_module", "torch.ops.aten.from_file.default",
                                    "#custom:op"])
def test_code_targets_are_refused(torch_artifact: Path, tmp_path: Path, target: str) -> None:
    """Node targets are resolved by getattr from torch, operator or math (torch.os is the os module) or from the
    extension registry; only the allow-listed torch.ops overloads and symbolic-int operators are accepted."""
    marker = tmp_path / "MARKER"
    program = _program(torch_artifact)
    node = _first_node(program, "torch.ops.aten._assert_tensor_metadata.default")
    node["target"] = target
    node["inputs"] = [{"name": "command", "arg": {"as_string": f"touch {marker}"}, "kind": 1}]
    bad = _tampered_program(torch_artifact, tmp_path / "bad", program)
    with pytest.raises(ArtifactError) as err:
        LLM(bad, threads=1)
    assert not marker.exists(), "the payload ran"
    message = str(err.value)
    assert f"{bad / 'model.pt2'}:models/model.json" in message and f"node {node['name']!r}" in message
    assert f"target {target!r} refused: not an allowed operator" in message


def test_code_in_guards_and_names_is_refused(torch_artifact: Path, tmp_path: Path) -> None:
    """guards_code is compiled into a function by ExportedProgram.module() (with guards), and names become
    identifiers in the source FX generates: neither may carry anything but sizes and identifiers."""
    marker = tmp_path / "MARKER"
    program = _program(torch_artifact)
    guard = f"__import__('os').system('touch {marker}') == 0"
    program["guards_code"].append(guard)
    bad = _tampered_program(torch_artifact, tmp_path / "guard", program)
    with pytest.raises(ArtifactError, match=r"guards_code\[\d+\]: guards_code .* refused"):
        LLM(bad, threads=1)
    program = _program(torch_artifact)
    node = _first_node(program, "torch.ops.aten.embedding.default")
    evil = f"x=__import__('os').system('touch {marker}');x"
    node["name"] = evil
    bad = _tampered_program(torch_artifact, tmp_path / "name", program)
    with pytest.raises(ArtifactError, match=r"name .* refused: not an identifier"):
        LLM(bad, threads=1)
    assert not marker.exists()


@pytest.mark.parametrize("text", [
    "Symbol('s72', positive=True, integer=True)",
    "Add(Mul(Integer(16), Symbol('s26', positive=True, integer=True)), Integer(-1))",
    "Mul(Integer(4), Pow(Symbol('s72', positive=True, integer=True), Integer(2)))",
    "Max(Integer(1), FloorDiv(Symbol('u0', integer=True), Integer(2)))",
    "Min(Mod(Symbol('s1', integer=True), Integer(8)), Symbol('s2', integer=True))",
    "Mul(Rational(1, 2), Symbol('s0', integer=True))",
    "Unequality(Symbol('u0', integer=True), Integer(1))",
    "And(GreaterThan(Symbol('u0', integer=True), Integer(0)), StrictLessThan(Symbol('u0', integer=True), oo))",
    "true",
])
def test_the_expression_grammar_takes_what_torch_writes(text: str) -> None:
    check_expression(text)


def test_the_expression_grammar_takes_torch_s_printer_output() -> None:
    """What torch writes for the functions its size arithmetic uses (serialize.py's _print_sympy is srepr)."""
    import sympy
    from torch.utils._sympy.functions import CeilDiv, CleanDiv, FloorDiv, Mod, ModularIndexing, PythonMod

    s0, s1 = sympy.Symbol("s0", positive=True, integer=True), sympy.Symbol("s1", positive=True, integer=True)
    u0 = sympy.Symbol("u0", integer=True)
    for expr in (FloorDiv(s0, 2) + 1, Mod(s0, 4) * s1, PythonMod(s1, 3), CleanDiv(8 * s0, 4), CeilDiv(s0, 16),
                 ModularIndexing(s0, 2, 4), sympy.Max(1, s0 - 1), sympy.Min(s0, s1), sympy.Eq(u0, 3),
                 sympy.Ne(u0, 1), u0 >= 0, s0 ** 2 * 4, -s0 + 2 * s1, sympy.And(u0 >= 0, u0 < 10)):
        check_expression(sympy.srepr(expr))


@pytest.mark.parametrize("text,why", [
    ("__import__('os').system('true') or s0", "characters outside"),
    ("Symbol('s0').__class__", "characters outside"),
    ('Symbol("s0")', "characters outside"),
    ("Add(Integer(1), Symbol('s0'))\n", "characters outside"),
    ("Integer(1)#", "characters outside"),
    ("exec('x')", "exec is not one of the functions"),
    ("Function('f')(Symbol('s0'))", "Call is not"),
    ("Symbol('os', integer=True)", "Symbol takes one size-symbol name"),
    ("Symbol('s0', evaluate=True)", "Symbol assumption evaluate="),
    ("Integer(100000000000000000000000000)", "integer literal below 2**64"),
    ("Pow(Integer(2), Integer(100000))", "integer exponent of at most 64"),
    ("Pow(Integer(2), Integer(64))", "Pow of a number literal"),
    ("Add(x, Integer(1))", "Name is not a sympy constructor call"),
    ("lambda: 0", "characters outside"),
    ("Add(" * 40 + "Integer(1)" + ", Integer(1))" * 40, "nested deeper"),
])
def test_the_expression_grammar_refuses_anything_else(text: str, why: str) -> None:
    from runtime.pt2_program import _Refused

    with pytest.raises(_Refused, match=__import__("re").escape(why)):
        check_expression(text)


def test_the_guard_grammar() -> None:
    from runtime.pt2_program import _Refused

    for ok in ("(-1) + L['cu_seqlens'].size()[0] >= 2", "L['kv_cache'][10].size()[0] == L['kv_cache'][1].size()[0]",
               "L['cu_seqlens'].size()[0] == (1 + L['block_table'].size()[0])",
               "2 <= L['x'].size()[1] <= 4096 and L['x'].stride()[0] == max(1, L['x'].size()[1] // 2)"):
        check_guard(ok)
    for bad in ("__import__('os').system('true') == 0", "L['x'].size()[0] == L['x'].numpy()",
                "L['x'].__class__ == 0", "L[L] == 0", "L['x'].size()[0]", "(lambda: 0)() == 0",
                "L['x'].size()[0] == 1; 0", 'L["x"].size()[0] == 1'):
        with pytest.raises(_Refused):
            check_guard(bad)


def test_the_allow_list_holds_the_project_s_ops() -> None:
    """Every optimize:: op runtime/backends/torch_ops.py registers can appear in a program (and nothing else of
    that namespace), with torch's default overload name."""
    source = (ROOT / "runtime" / "backends" / "torch_ops.py").read_text()
    registered = set(__import__("re").findall(r'custom_op\("optimize::(\w+)"', source))
    assert registered and {f"torch.ops.optimize.{n}.default" for n in registered} == \
        {t for t in ALLOWED_TARGETS if t.startswith("torch.ops.optimize.")}
