"""The published runs as the documentation shows them, rendered from their manifests.

Each run is a folder ``results/NAME/`` holding ``manifest.json`` and ``records.jsonl.gz``
(:mod:`~kvpatch.tools.eval.manifest`). When the documentation builds, every run gets a page
(:func:`run_page`: its command, where it comes from, its tables and plot), the runs an index
(:func:`index_page`), and a page's markers, each on a line of its own, are replaced
(:func:`expand_markers`):

- ``<!-- results: NAME -->`` by the run's tables (those ``kvpatch eval`` prints and writes to
  ``results.md``);
- ``<!-- results-plot: NAME -->`` by its plot, accuracy against the ratio.

Nothing here imports torch: the documentation build reads the manifests only.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvpatch.tools.eval.manifest import MANIFEST, RECORDS, read_manifest, read_records
from kvpatch.tools.eval.report import format_run

if TYPE_CHECKING:
    from kvpatch.tools.eval.paired import PairedCounts

#: a marker in a page, on a line of its own (one quoted in a sentence stays as written):
#: ``<!-- results: NAME -->`` or ``<!-- results-plot: NAME -->``
MARKER = re.compile(
    r"^[ \t]*<!--\s*results(?P<plot>-plot)?:\s*(?P<name>[\w.-]+)\s*-->[ \t]*$", re.M
)
VERSIONS = ("kvpatch", "torch", "transformers", "python")


def published_runs(root: Path) -> dict[str, dict]:
    """The manifest of every run under ``root`` (``results/``), by the run's folder name."""
    return {
        path.parent.name: read_manifest(path.parent) for path in sorted(root.glob(f"*/{MANIFEST}"))
    }


def expand_markers(markdown: str, runs: dict[str, dict], plot_link: Callable[[str], str]) -> str:
    """``markdown`` with its markers replaced; ``plot_link(name)`` is where a run's plot is, from
    the page. A marker naming no published run is a ValueError (a page must not lose a table
    quietly)."""

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in runs:
            raise ValueError(f"no published run {name!r}: results/{name}/{MANIFEST} is missing")
        if match["plot"]:
            return f"![accuracy against compression ratio, {name}]({plot_link(name)})"
        return format_run(runs[name]["summary"]).rstrip("\n")

    return MARKER.sub(replace, markdown)


def marked_runs(markdown: str) -> set[tuple[str, bool]]:
    """``(name, is_plot)`` of every marker of a page."""
    return {(m["name"], bool(m["plot"])) for m in MARKER.finditer(markdown)}


def run_page(name: str, manifest: dict, plot: str | None) -> str:
    """A run's page: where its data is, the command that makes it, where it comes from (commit,
    versions, hardware, and how each was known), its tables and (``plot``: a link) its plot."""
    records = manifest["records"]
    lines = [
        f"# Published run `{name}`",
        "",
        f"`results/{name}/`: `{MANIFEST}` and `{manifest.get('records_file', RECORDS)}`, "
        f"{records:,} answers ({_count(manifest['samples'], 'sample')} per task). Made with",
        "",
        "```bash",
        manifest["command"],
        "```",
        "",
        *provenance_section(manifest),
        "## Tables",
        "",
        format_run(manifest["summary"]).rstrip("\n"),
    ]
    if plot is not None:
        lines += ["", f"![accuracy against compression ratio, {name}]({plot})"]
    return "\n".join(lines) + "\n"


def provenance_section(manifest: dict) -> list[str]:
    """The manifest's provenance: one row per part of the run, then how what was not recorded
    by the run itself was found."""
    lines = [
        "| answers | commit | date | versions | hardware |",
        "|---|---|---|---|---|",
    ]
    notes = []
    if manifest.get("command_from"):
        notes.append(f"- command: {_plain(manifest['command_from'])}")
    for part in manifest["provenance"]:
        commit = f"`{part['commit'][:10]}`" if part.get("commit") else "not recorded"
        if part.get("changed"):
            commit += f" with {len(part['changed'])} files changed"
        date = (part.get("date") or "not recorded")[:10]
        answers = str(part["records"])
        if part.get("policies"):  # a part that made some policies' answers only
            answers += f" ({', '.join(part['policies'])})"
        row = [answers, commit, date, versions_text(part), hardware_text(part)]
        lines.append("| " + " | ".join(row) + " |")
        for what in ("commit", "versions", "hardware"):
            if part.get(f"{what}_from"):
                notes.append(f"- {what}: {_plain(part[f'{what}_from'])}")
    return [*lines, "", *notes, *([""] if notes else [])]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _plain(text: str) -> str:
    """``text`` shown as written: a note names files such as ``kvpatch/__init__.py``, whose
    underscores Markdown would take for emphasis."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", text)


def versions_text(part: dict) -> str:
    versions = part.get("versions") or {}
    return ", ".join(f"{name} {versions.get(name) or 'not recorded'}" for name in VERSIONS)


def hardware_text(part: dict) -> str:
    hardware = {k: v for k, v in (part.get("hardware") or {}).items() if v is not None}
    if not hardware:
        return "not recorded"
    described = [hardware.get("gpu"), hardware.get("cpu")]
    if hardware.get("cores"):
        described.append(f"{hardware['cores']} cores")
    if hardware.get("threads"):
        described.append(f"{hardware['threads']} threads")
    if hardware.get("device"):
        described.append(f"model on {hardware['device']}")
    return ", ".join(text for text in described if text)


def index_page(runs: dict[str, dict], link: Callable[[str], str]) -> str:
    """Every published run in one table: its settings at a glance and where it comes from."""
    lines = [
        "# Published runs",
        "",
        "Every evaluation the documentation quotes, kept as data in `results/NAME/` (a",
        f"`{MANIFEST}` and the answers, `{RECORDS}`); each page is rendered from its manifest.",
        "",
        "| run | model | tasks | question | policies | samples | answers | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, manifest in runs.items():
        config = manifest["config"]
        commits = ", ".join(
            f"`{p['commit'][:10]}`" for p in manifest["provenance"] if p.get("commit")
        )
        row = [
            f"[{name}]({link(name)})",
            config["model"],
            ", ".join(config["tasks"]),
            ", ".join(config["modes"]),
            str(len(config["policies"])),
            str(manifest["samples"]),
            f"{manifest['records']:,}",
            commits or "not recorded",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpatch.tools.eval.published NAME``: a published run's tables; with ``--plot
    PATH``, its plot drawn to PATH (the README's figure, which GitHub shows without a build);
    with ``--compare FIRST SECOND``, two of its policies compared sample by sample (``--against
    RUN``: the second of another run)."""
    import argparse

    from kvpatch.tools.eval.paired import format_comparison
    from kvpatch.tools.eval.report import plot_accuracy

    p = argparse.ArgumentParser(prog="python -m kvpatch.tools.eval.published")
    p.add_argument("name", help="the run: its folder under --results")
    p.add_argument("--results", default="results", help="the published runs (default: results)")
    p.add_argument("--plot", metavar="PATH", help="draw its plot to PATH instead")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("FIRST", "SECOND"),
        help="instead, two policies of the run (as its tables name them, 'full' for the full "
        "cache) on the same samples: which each answers alone, McNemar's exact p-value",
    )
    p.add_argument(
        "--against",
        metavar="RUN",
        help="with --compare: SECOND is a policy of this other run, made with the same sample "
        "settings (model, prompt format, context tokens, digits, seed); samples are matched by "
        "what they ask",
    )
    args = p.parse_args(argv)
    folder = Path(args.results) / args.name
    if args.against is not None and args.compare is None:
        p.error("--against needs --compare FIRST SECOND")
    if args.compare is not None:
        try:
            counts = _paired_counts(folder, Path(args.results), args.compare, args.against)
        except ValueError as error:
            p.error(str(error))
        first, second = args.compare
        if args.against is not None:
            first, second = f"{first} ({args.name})", f"{second} ({args.against})"
        print(format_comparison(counts, first, second), end="")
        return 0
    summary = read_manifest(folder)["summary"]
    if args.plot is None:
        print(format_run(summary), end="")
    elif plot_accuracy(summary, Path(args.plot)) is None:
        print("the plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    return 0


def _paired_counts(
    folder: Path, results: Path, policies: list[str], against: str | None
) -> list[PairedCounts]:
    """``--compare``'s counts: two policies of the run in ``folder``, or the second of the run
    ``against``."""
    from kvpatch.tools.eval.paired import check_same_samples, compare

    if against is None:
        return compare(read_records(folder), *policies)
    other = results / against
    check_same_samples(read_manifest(folder)["config"], read_manifest(other)["config"])
    return compare(read_records(folder), *policies, second_records=read_records(other))


if __name__ == "__main__":
    raise SystemExit(main())
