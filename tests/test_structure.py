"""The shape of the code: rooms import downward only, no import cycle; functions short and of
bounded complexity, classes of bounded size (what makes code hard to read, where a cap on a
file's lines only made code be squeezed); nothing exempt from the formatter."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvpatch"
MAX_FUNCTION_LINES = 60
#: McCabe's cyclomatic complexity: 1 + each branch (if, loop, except, case, conditional
#: expression, comprehension and its conditions, and each further operand of and/or)
MAX_COMPLEXITY = 15
BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler, ast.match_case)
MAX_CLASS_LINES = 300
MAX_CLASS_METHODS = 30
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
    """Not even through imports for type checking alone: what a lower room needs of a higher one
    it names as a Protocol (``kvpatch.cache.requests``)."""
    graph = grimp.build_graph("kvpatch", exclude_type_checking_imports=False)
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


def complexity(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The cyclomatic complexity of ``function``, its nested functions and lambdas apart."""
    count, pending = 1, list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, BRANCHES):
            count += 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        pending.extend(ast.iter_child_nodes(node))
    return count


def _functions(source: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_function_complexity(path: Path):
    found = {f.name: complexity(f) for f in _functions(path.read_text())}
    assert {name: c for name, c in found.items() if c > MAX_COMPLEXITY} == {}


def test_the_complexity_counts_branches():
    source = """
def f(xs, flag):
    if flag and xs:
        return [x for x in xs if x]
    for x in xs:
        try:
            pass
        except ValueError:
            continue
    return 1 if flag else 2
"""
    # 1 + if + and + comprehension and its condition + for + except + conditional expression
    assert complexity(next(_functions(source))) == 8


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_class_size(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            lines = node.end_lineno - node.lineno + 1
            methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
            assert lines <= MAX_CLASS_LINES, f"{node.name}: {lines} lines; split its roles"
            assert methods <= MAX_CLASS_METHODS, f"{node.name}: {methods} methods"


def test_nothing_is_exempt_from_the_formatter():
    marker = "fmt: " + "skip"  # not this file's own text
    python = [
        *ROOT.glob("*.py"),
        *(
            p
            for d in ("kvpatch", "tests", "benchmarks", "examples")
            for p in (ROOT / d).rglob("*.py")
        ),
    ]
    assert [str(p.relative_to(ROOT)) for p in python if marker in p.read_text()] == []


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


def test_tests_share_code_through_helpers_not_through_each_other():
    """A test module imports what it shares from conftest, oracle or helpers, never from another
    test module (whose tests would then be collected twice, or its fixtures in hiding);
    ``bad_input_table.py``, the script that writes the bad-input page, reads the cases."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name == "bad_input_table.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                found.append(f"{path.name}: from {node.module}")
    assert found == []


#: the names of particular policy kinds; the policies declare what they need instead
POLICY_KINDS = re.compile(r"kvzip|kvzap|replay", re.IGNORECASE)


def test_no_module_outside_the_policies_names_a_policy_kind():
    """The cache, attention, prefill, patching and tools ask a policy what it needs (its
    reconstruction, hidden-state scorer, fitted map): the next policy kind is one new file."""
    named = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "policies" not in path.relative_to(PACKAGE).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if POLICY_KINDS.search(line)
    ]
    assert named == []


def test_the_check_for_policy_kinds_sees_them():
    assert POLICY_KINDS.search("scorer = KVzip()") and not POLICY_KINDS.search("reconstruction")


def test_the_top_of_the_package_holds_at_most_ten_modules():
    """The core's rooms are packages; a newcomer reads the rest of the file list at a glance."""
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= 10, modules
