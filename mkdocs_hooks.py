"""The documentation's hooks (``mkdocs.yml``'s ``hooks:``): the published runs, rendered as the
documentation builds.

Every run under ``results/`` (``results/NAME/manifest.json``) gets a page, ``runs/NAME.md``: its
command, where it comes from, its tables and its plot; ``runs/index.md`` lists them. A page's
markers become a run's figures: ``<!-- results: NAME -->`` its tables, ``<!-- results-plot: NAME
-->`` its plot (:mod:`kvpatch.tools.eval.published`). The plots are drawn here, into the site
only: ``results/`` holds data, not renderings.
"""

from __future__ import annotations

import logging
import posixpath
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from kvpatch.tools.eval.published import (
    expand_markers,
    index_page,
    marked_runs,
    published_runs,
    run_page,
)
from kvpatch.tools.eval.report import plot_accuracy

RESULTS = Path(__file__).resolve().parent / "results"
#: where the runs' pages and plots go in the site
PAGES = "runs"
log = logging.getLogger("mkdocs.hooks.results")

_runs: dict[str, dict] = {}
#: each run's plot, with the manifest's modification time it was drawn from (``mkdocs serve``
#: rebuilds on every edit: a plot is drawn again only when its manifest changes)
_plots: dict[str, tuple[float, bytes]] = {}


def on_files(files: Files, config) -> Files:
    _runs.clear()
    _runs.update(published_runs(RESULTS))
    plots = _draw(_runs)
    for name, manifest in _runs.items():
        plot = f"{name}.png" if name in plots else None
        page = run_page(name, manifest, plot)
        files.append(File.generated(config, f"{PAGES}/{name}.md", content=page))
        if plot is not None:
            files.append(File.generated(config, f"{PAGES}/{plot}", content=plots[name]))
    index = index_page(_runs, link=lambda name: f"{name}.md")
    files.append(File.generated(config, f"{PAGES}/index.md", content=index))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = page.file.src_uri
    for name, is_plot in marked_runs(markdown):
        if is_plot and name in _runs and name not in _plots:
            raise PluginError(f"{source}: the plot of {name!r} needs matplotlib to be drawn")
    here = posixpath.dirname(source) or "."
    try:
        return expand_markers(
            markdown, _runs, plot_link=lambda name: posixpath.relpath(f"{PAGES}/{name}.png", here)
        )
    except ValueError as error:
        raise PluginError(f"{source}: {error}") from error


def _draw(runs: dict[str, dict]) -> dict[str, bytes]:
    """Each run's plot as PNG bytes; none without matplotlib (the pages then show tables only,
    and a page that asks for a plot fails the build)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.info("matplotlib is not installed: the published runs' pages have no plots")
        return {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, manifest in runs.items():
            changed = (RESULTS / name / "manifest.json").stat().st_mtime
            if name not in _plots or _plots[name][0] != changed:
                path = plot_accuracy(manifest["summary"], Path(scratch) / f"{name}.png")
                _plots[name] = (changed, path.read_bytes())
    return {name: _plots[name][1] for name in runs}
