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
