"""Every Markdown table of the repository renders as a table: a header, a separator row
(``|---|``) and rows of as many cells (a table without its separator renders as a paragraph, and
``mkdocs build --strict`` does not notice). So does every table the documentation build renders
from the published runs' manifests (``results/``: a page per run, and the pages' markers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpatch.tools.eval.published import expand_markers, index_page, published_runs, run_page

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    p
    for p in ROOT.rglob("*.md")
    if not any(part.startswith(".") or part in ("site", "build") for part in p.parts)
    and "egg-info" not in str(p)
)
RUNS = published_runs(ROOT / "results")
SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")
CELL_BORDER = re.compile(r"(?<!\\)\|")


def _cells(row: str) -> int:
    return len(CELL_BORDER.split(row.strip().strip("|")))


def _tables(text: str) -> list[tuple[int, list[str]]]:
    """Each run of lines starting with ``|`` outside code fences, with its first line number."""
    tables, current, fenced = [], [], False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and line.lstrip().startswith("|"):
            current.append((number, line.strip()))
            continue
        if current:
            tables.append((current[0][0], [row for _, row in current]))
            current = []
    return tables


def table_errors(text: str) -> list[str]:
    errors = []
    for line, rows in _tables(text):
        if len(rows) < 2 or not SEPARATOR.match(rows[1]):
            errors.append(f"line {line}: a table without its |---| separator row")
            continue
        width = _cells(rows[0])
        for offset, row in enumerate(rows[1:], 1):
            if _cells(row) != width:
                errors.append(f"line {line + offset}: {_cells(row)} cells, the header has {width}")
    return errors


def test_the_check_finds_a_table_without_its_separator():
    good = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert table_errors(good) == []
    assert table_errors("text\n\n| a | b |\n| 1 | 2 |\n") == [
        "line 3: a table without its |---| separator row"
    ]
    assert table_errors("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n") == [
        "line 3: 3 cells, the header has 2"
    ]
    assert table_errors("```\n| not | a table |\n```\n") == []
    assert table_errors(r"| a \| b | c |" + "\n|---|---|\n| 1 | 2 |\n") == []


def test_the_repository_has_pages_with_tables():
    assert len(PAGES) > 10 and sum(bool(_tables(p.read_text())) for p in PAGES) > 8
    assert len(RUNS) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_is_well_formed(page):
    assert table_errors(page.read_text()) == []


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_table_rendered_from_a_published_run_is_well_formed(name):
    page = run_page(name, RUNS[name], plot=f"{name}.png")
    assert len(_tables(page)) >= 3 and table_errors(page) == []
    marked = expand_markers(f"text\n\n<!-- results: {name} -->\n", RUNS, lambda n: f"{n}.png")
    assert len(_tables(marked)) >= 2 and table_errors(marked) == []


def test_the_index_of_published_runs_is_well_formed():
    index = index_page(RUNS, link=lambda name: f"{name}.md")
    assert [len(rows) for _, rows in _tables(index)] == [2 + len(RUNS)]
    assert table_errors(index) == []
