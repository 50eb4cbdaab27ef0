"""The import graphs of compiler/ and runtime/: no cycle between their files or their folders, and the runtime
imports nothing from the compiler.

Every import counts, also those written inside functions (a cycle hidden in a function is still a cycle to
whoever reads the code). Between folders the package root is left out: it holds the modules every folder shares
(runtime/forward_batch.py and artifact.py; compiler/context.py, export.py, streamed.py), so its subfolders
import it and it imports them (the build driver runs the passes); a cycle among the subfolders is what the test
refuses.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` (or any other top-level name, kept as written) it imports."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for name in names:
                target = name
                while target and target not in files and target.split(".")[0] == package:
                    target = target.rpartition(".")[0]
                if target.split(".")[0] != package:
                    out.add(name.split(".")[0])
                elif target and target != mod and not mod.startswith(target + "."):  # not its own package
                    out.add(target)
                    break
        graph[mod] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["runtime", "compiler"])
def test_files_import_no_cycle(package: str) -> None:
    graph = import_graph(package)
    assert len(graph) > 20
    assert cycles({m: {t for t in ts if t.startswith(package)} for m, ts in graph.items()}) == []


def test_the_runtime_imports_nothing_from_the_compiler() -> None:
    graph = import_graph("runtime")
    assert "runtime.backends" in graph["runtime.engine"]  # the walk sees first-party imports
    assert sorted(m for m, targets in graph.items() if "compiler" in targets) == []


@pytest.mark.parametrize("package", ["runtime", "compiler"])
def test_folders_import_no_cycle(package: str) -> None:
    graph = import_graph(package)

    def folder(mod: str) -> str:
        parts = mod.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or (ROOT / Path(*parts)).is_dir() else package

    folders: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        for t in targets:
            if not t.startswith(package):
                continue
            a, b = folder(mod), folder(t)
            if a != b and package not in (a, b):
                folders.setdefault(a, set()).add(b)
    assert folders, folders  # the subfolders import each other somewhere
    assert cycles(folders) == [], folders


def test_the_compiler_imports_nothing_from_the_engine() -> None:
    """The build runs an artifact through the runtime's pieces (backend, tokenizer, evaluation), and the command
    line's run commands are the runtime's own (runtime/cli.py): no compiler module imports runtime.engine."""
    users = []
    for path in (ROOT / "compiler").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) else []
            if any(n == "runtime.engine" or n.startswith("runtime.engine.") for n in names):
                users.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert users == []


# Third-party modules worth importing only where used: the optional extras (not in a runtime-only install: the
# compiler's, the GPU targets') and the slow ones, with the import time measured on a 2-core CPU machine.
HEAVY = {
    "torch": "2.6 s, compiler extra",
    "onnxscript": "2.0 s, compiler extra",
    "onnx_ir": "1.6 s, compiler extra (onnxscript's IR)",
    "transformers": "1.5 s, compiler extra",
    "onnx": "1.3 s, compiler extra",
    "safetensors": "compiler extra",
    "tensorrt": "gpu extra",
    "pycuda": "gpu extra",
    "cuda": "gpu extra (cuda-python)",
    "triton": "gpu extra",
    "flashinfer": "flashinfer extra",
    "aiohttp": "0.44 s: the HTTP server and client only",
    "onnxruntime": "0.37 s: the ONNX Runtime backends only",
    "llguidance": "structured output only; where it is missing the request is refused with the install hint",
}
# Files whose functions import what they run, whatever it costs: each command of the command line imports
# its own modules, so `optimize --help` and the registry commands start in a fraction of a second.
DEFERRING_FILES = {
    "compiler/cli.py": "command line: each command imports what it runs",
    "runtime/cli.py": "command line: each command imports what it runs",
    "runtime/__init__.py": "lazy package attributes (LLM, SamplingParams): `import runtime` loads no engine",
}


def _loaded_at_import(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> what importing it runs: its packages, its module-level imports (not under TYPE_CHECKING, not
    in functions), first-party as module names and third-party as their top-level names."""
    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    def body_imports(body: list[ast.stmt]) -> list[str]:
        out: list[str] = []
        for n in body:
            if isinstance(n, ast.Import):
                out += [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
                out += [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            elif isinstance(n, ast.If):
                is_typing = isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
                out += body_imports(n.orelse) + ([] if is_typing else body_imports(n.body))
            elif isinstance(n, ast.Try):
                out += body_imports(n.body + n.orelse + n.finalbody + [s for h in n.handlers for s in h.body])
            elif isinstance(n, (ast.With, ast.ClassDef)):
                out += body_imports(n.body)
        return out

    def with_packages(mod: str) -> set[str]:
        parts = mod.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}

    loads: dict[str, set[str]] = {}
    for mod, path in modules.items():
        found = with_packages(mod) - {mod}
        for name in body_imports(ast.parse(path.read_text(encoding="utf-8")).body):
            top = name.split(".")[0]
            found |= with_packages(resolve(name)) if top in ("compiler", "runtime") else {top}
        loads[mod] = found - {mod, ""}
    return loads


def deferred_imports_without_reason() -> list[str]:
    """Imports written inside functions of compiler/ and runtime/ that defer nothing heavy: neither a module of
    HEAVY nor a first-party module whose import reaches one, nor a package's own module imported by the package
    (runtime.backends.load_backend: each backend imports the package), outside DEFERRING_FILES."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for pkg in ("compiler", "runtime") for p in (ROOT / pkg).rglob("*.py")}
    loads = _loaded_at_import(modules)

    def heavy(mod: str) -> bool:
        seen, todo = set(), [mod]
        while todo:
            m = todo.pop()
            if m in HEAVY:
                return True
            if m not in seen:
                seen.add(m)
                todo += loads.get(m, ())
        return False

    def module_of(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    found = []
    for mod, path in modules.items():
        rel = str(path.relative_to(ROOT))
        if rel in DEFERRING_FILES:
            continue
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    targets = [[a.name] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    targets = [[node.module, f"{node.module}.{a.name}"] for a in node.names]
                else:
                    continue
                for names in targets:
                    tops = {n.split(".")[0] for n in names}
                    first_party = tops <= {"compiler", "runtime"}
                    if first_party and path.name == "__init__.py" and module_of(names[-1]).startswith(mod + "."):
                        continue  # a package's factory picking one of its modules, which import the package
                    if not any(heavy(module_of(n)) if first_party else n.split(".")[0] in HEAVY for n in names):
                        found.append(f"{rel}:{node.lineno}: {names[-1]}")
    return found


def test_functions_import_only_what_is_heavy() -> None:
    """An import inside a function is a dependency the reader does not see at the top of the file; it is there
    only to keep a heavy or optional module (HEAVY, or first-party code that imports one) out of what loads
    this one, or in a command-line file (DEFERRING_FILES)."""
    assert deferred_imports_without_reason() == []
