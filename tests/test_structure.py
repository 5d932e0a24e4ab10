"""The shape of the code: rooms import downward only, no import cycle, small files and functions."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvpatch"
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60
#: a longer function says why in a comment starting with this, among its first lines
LONG_REASON = "# long:"


def test_import_contracts(monkeypatch):
    """The layers in setup.cfg's [importlinter] contracts hold (the same as ``lint-imports``)."""
    from importlinter.cli import lint_imports

    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename="setup.cfg", no_cache=True, no_logo=True) == 0


def _cycle(graph: grimp.ImportGraph) -> list[str] | None:
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(imports[module]):
            if state.get(imported) == "open":
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(imports):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle():
    graph = grimp.build_graph("kvpatch", exclude_type_checking_imports=True)
    assert _cycle(graph) is None


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    assert _cycle(graph) is None
    graph.add_import(importer="c", imported="a")
    assert _cycle(graph) == ["a", "b", "c", "a"]


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_file_size(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.name} has {lines} lines; split it by responsibility"


def long_functions(source: str) -> list[str]:
    """Functions over the limit that give no reason (a ``# long:`` comment in their first
    lines)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            head = lines[node.lineno - 1 : node.lineno + 5]
            if length > MAX_FUNCTION_LINES and not any(LONG_REASON in line for line in head):
                found.append(f"{node.name} ({length} lines)")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_function_size(path: Path):
    assert long_functions(path.read_text()) == []


def test_the_function_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    reasoned = f"def f():\n    {LONG_REASON} a table of options\n{body}\n"
    assert long_functions(reasoned) == []
