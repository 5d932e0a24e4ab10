"""The commands start at once: ``--help``, argument errors and a misspelt policy import neither
torch nor transformers; ``import kvpatch`` imports its names on first use, and the pipeline is
still registered once transformers' pipelines are imported."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers")


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, status",
    [
        (["--help"], 0),
        (["ask", "--help"], 0),
        (["generate", "--help"], 0),
        (["eval", "--help"], 0),
        (["bench", "--help"], 0),
        (["fit-scorer", "--help"], 0),
        (["generate", "hello", "--policy", "snapvk"], 2),
        (["chat", "--policy", "think+snapvk:0.5"], 2),
        (["eval", "--policies", "snapkv", "tovva"], 2),
        (["bench", "--policies", "knrom"], 2),
        (["generate"], 2),  # no prompt
        (["compress", "doc.txt"], 2),  # no --out
    ],
)
def test_help_and_errors_import_neither_torch_nor_transformers(argv, status):
    code = (
        "import sys\nfrom kvpatch.tools.cli import main\n"
        f"try:\n    code = main({argv!r})\nexcept SystemExit as stop:\n    code = stop.code\n"
        f"print(code, [m for m in {HEAVY!r} if m in sys.modules])"
    )
    assert run_python(code) == f"{status} []"


def test_a_misspelt_policy_names_the_close_matches_then_the_names_line_by_line(capsys):
    from kvpatch.tools.cli import main

    assert main(["generate", "hello", "--policy", "ada-snapvk:0.5"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(
        "kvpatch generate: error: unknown policy 'ada-snapvk'. Did you mean 'ada-snapkv' or "
    )
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "token scorers",
        "prefixes",
        "channels",
    ]
    assert all(len(line) <= 160 for line in lines)


def test_the_pipeline_is_registered_whichever_is_imported_first():
    check = (
        "from transformers.pipelines import PIPELINE_REGISTRY\n"
        "print('kvpatch-text-generation' in PIPELINE_REGISTRY.get_supported_tasks())"
    )
    assert run_python(f"import kvpatch\nfrom transformers import pipeline\n{check}") == "True"
    assert run_python(f"from transformers import pipeline\nimport kvpatch\n{check}") == "True"
    assert run_python(f"import kvpatch\n{check}") == "True"


LAZY_PACKAGES = ("kvpatch", "kvpatch.policies", "kvpatch.tools.eval")


def _type_checking_imports(package: str) -> dict[str, tuple[str, ...]]:
    """What the ``if TYPE_CHECKING:`` block of ``package``'s ``__init__`` imports, by module."""
    path = ROOT / Path(*package.split(".")) / "__init__.py"
    found: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for statement in node.body:
                names = tuple(alias.name for alias in statement.names)
                if names == ("*",):  # everything the module declares public
                    names = tuple(importlib.import_module(statement.module).__all__)
                found[statement.module] = names
    return found


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_the_lazy_exports_are_what_static_tools_read(package):
    module = importlib.import_module(package)
    assert {m: sorted(n) for m, n in module.EXPORTS.items()} == {
        m: sorted(n) for m, n in _type_checking_imports(package).items()
    }


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_exported_name_is_its_modules_object(package):
    module = importlib.import_module(package)
    for source, names in module.EXPORTS.items():
        for name in names:
            assert getattr(module, name) is getattr(importlib.import_module(source), name)
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_submodules_are_attributes_of_the_package():
    code = "import kvpatch\nprint(kvpatch.compat.cache_argument.__name__, kvpatch.cache.__name__)"
    assert run_python(code) == "cache_argument kvpatch.cache"
