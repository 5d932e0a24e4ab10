"""The published results are data, and can be reproduced from the documentation.

Every published run is a folder ``results/NAME/``: ``manifest.json`` (the command, the commit,
the versions, the hardware, the settings, the summary with 95% intervals) and
``records.jsonl.gz`` (every answer). Checked here: each manifest names its commit and versions
(or says how they were found), holds the summary its records give, with intervals that an
independent Wilson computation gives; ``docs/`` holds no records; the README's tables quote the
manifests. Every ``kvpatch eval`` command the README and the documentation pages give (in a shell
block or inline) that writes to ``results/`` must parse and name the settings its run was made
with (the manifest's ``config``), and every run must have such a command. Set order (policies,
ratios, tasks, modes) changes only the order of a table's rows. Marked ``slow`` (the real
models): rerun on its first contexts, a published result gives its stored answers.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import shlex
import subprocess
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from kvpatch.policies import GlobalBudgets, KVzap, KVzip, TokenScorer
from kvpatch.tools.eval.cli import parser
from kvpatch.tools.eval.config import EvalConfig
from kvpatch.tools.eval.published import MARKER, expand_markers, published_runs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
RUNS = sorted(path.parent.name for path in RESULTS.glob("*/manifest.json"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`((?:python -m kvpatch\.tools\.eval|kvpatch eval) [^`]*)`")
PREFIXES = (["python", "-m", "kvpatch.tools.eval"], ["kvpatch", "eval"])
#: settings that decide a result (the rest: where it is written, progress, plots)
SETTINGS = (
    "context_tokens",
    "samples",
    "seed",
    "model",
    "attn_implementation",
    "dtype",
    "digits",
    "shared_prefill",
    "prefill_chunk",
    "quantize",
)
AS_SETS = ("policies", "ratios", "tasks", "modes")


def _is_kvzip(term: str) -> bool:
    """Whether a term's scorer is KVzip or KVzip+ (under any budget prefix or span)."""
    return term.partition(":")[0].endswith(("kvzip", "kvzip-plus"))


def _is_kvzap(term: str) -> bool:
    """Whether a term's scorer is KVzap (under any budget prefix or span)."""
    return term.partition(":")[0].endswith("kvzap")


def _is_global(term: str) -> bool:
    return term.startswith("global-")


def _always(settings: set[str], run: str) -> bool:
    return True


def _question_in_the_prompt(settings: set[str], run: str) -> bool:
    """Whether ``run`` asked with the question in the prompt, where a prompt window is kept."""
    return "prefill" in manifest(run)["config"]["modes"]


def _floor_past_the_cap(settings: set[str], run: str) -> bool:
    """Whether capping the floor changes a global term of ``run``: the term keeps a floor (its
    ``settings``, the defaults of its day included) and the run a ratio past the cap (KVzip's,
    the only one measured)."""
    floors = [float(s.partition("=")[2]) for s in settings if s.startswith("layer_floor=")]
    return floors != [0.0] and max(manifest(run)["config"]["ratios"]) > KVzip.layer_floor_max_ratio


@dataclass(frozen=True)
class DefaultChange:
    """A default that changed after runs were published: a term it ``applies`` to (by name), in
    a run started before ``since`` (and from ``then_from``), ran with ``field=then``, which
    today's command must spell where it ``mattered`` (given the term's settings, the defaults of
    its day included, and the run)."""

    applies: Callable[[str], bool]
    field: str
    then: str
    today: object
    since: str
    mattered: Callable[[set[str], str], bool] = _always
    #: when ``then`` became the default (runs before it ran with an older one)
    then_from: str = ""


DEFAULT_CHANGES = (
    # global budgets keep a floor in every layer; before, they ranked every token together
    DefaultChange(
        _is_global,
        "layer_floor",
        "0",
        GlobalBudgets.__dataclass_fields__["layer_floor"].default,
        "2026-12-07T04:08:00+00:00",
    ),
    # KVzip keeps the tokens leading to a high score; before, it scored each token alone
    DefaultChange(
        _is_kvzip,
        "span_before",
        "0",
        KVzip.__dataclass_fields__["span_before"].default,
        "2026-12-07T05:55:00+00:00",
    ),
    # past r = 0.75 KVzip's floor stays what it is there; before, it shrank with the budget
    DefaultChange(
        lambda term: _is_global(term) and _is_kvzip(term),
        "floor_max_ratio",
        "1",
        KVzip.layer_floor_max_ratio,
        "2026-12-07T15:00:00+00:00",
        _floor_past_the_cap,
    ),
    # and for a while every scorer's did, which cost KVzap answers at r = 0.9
    DefaultChange(
        lambda term: _is_global(term) and not _is_kvzip(term),
        "floor_max_ratio",
        "0.75",
        f"{TokenScorer.layer_floor_max_ratio:g}",
        "2026-12-07T16:35:00+00:00",
        _floor_past_the_cap,
        then_from="2026-12-07T15:00:00+00:00",
    ),
    # KVzap keeps the last tokens of a prompt generate continues from; before, it scored them
    DefaultChange(
        _is_kvzap,
        "prompt_window",
        "0",
        KVzap.__dataclass_fields__["prompt_window"].default,
        "2026-12-07T18:25:00+00:00",
        _question_in_the_prompt,
    ),
)
VERSIONS = ("python", "kvpatch", "torch", "transformers")
#: questions asked of each context, where a task asks more than one
QUESTIONS = {"multiquestion": 3, "multifact": 3}
#: a version as a process reports it (a pin such as ``>=4.56,<6`` is not one)
RELEASE = re.compile(r"\d+(\.\d+)*([.+\-]?[0-9A-Za-z.]+)*")


def manifest(name: str) -> dict:
    return json.loads((RESULTS / name / "manifest.json").read_text())


def records(name: str) -> list[dict]:
    with gzip.open(RESULTS / name / manifest(name)["records_file"], "rt") as f:
        return [json.loads(line) for line in f]


def eval_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every eval command of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = [
            line
            for block in SHELL_BLOCK.findall(text)
            for line in block.replace("\\\n", " ").splitlines()
        ]
        lines += [" ".join(span.split()) for span in INLINE.findall(text)]
        for line in lines:
            words = shlex.split(line, comments=True)
            for prefix in PREFIXES:
                if words[: len(prefix)] == prefix:
                    found.append((page.name, words[len(prefix) :]))
    return found


def output_of(argv: list[str]) -> str:
    """The ``--output`` an argv gives (read without parsing, so a command that no longer parses
    fails its test rather than the collection)."""
    spelled = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--output"]
    return spelled[-1].rstrip("/") if spelled else ""


COMMANDS = [
    (page, argv) for page, argv in eval_commands() if output_of(argv).startswith("results/")
]


def former_defaults(run: str, name: str, given: set[str]) -> set[str]:
    """The settings a policy term of ``run`` (its ``name`` and the settings it is ``given``)
    had by default then and that mattered, which its name does not say and today's command must."""
    made = manifest(run)["provenance"][0]["date"]
    settings = set(given)
    # measured while the chunk's own softmax was KVzip's default (docs/performance.md says so)
    if run == "kvzip-plus" and "kvzip" in name:
        settings.add("normalise=chunk")
    for change in DEFAULT_CHANGES:  # in the order they came: each sees the defaults before it
        fields = {s.partition("=")[0] for s in settings}
        made_then = change.then_from <= made < change.since
        if change.applies(name) and made_then and change.field not in fields:
            then = f"{change.field}={change.then}"
            if change.mattered(settings | {then}, run):
                settings.add(then)
    return settings - given


def spelled(policy: str, run: str | None = None) -> str:
    """``policy`` as today's names spell it: each term's settings in one order, without those
    that are today's defaults, and, given the ``run`` it was stored in, with those that were its
    defaults then and mattered (a setting the name gives is kept)."""
    terms = []
    for term in policy.split("+"):
        name, _, given = term.partition("/")
        settings = {s.strip() for s in given.split(",") if s.strip()}
        if run is not None:
            settings |= former_defaults(run, name, settings)
        for change in DEFAULT_CHANGES:
            if change.applies(name):
                settings.discard(f"{change.field}={change.today}")
        terms.append(f"{name}/{','.join(sorted(settings))}" if settings else name)
    return "+".join(terms)


def assert_names_its_settings(where: str, argv: list[str], written_then: bool = False) -> None:
    """``argv`` parses, writes to a published run, and gives the settings it was made with, as
    today's names spell them; a command ``written_then`` may leave out what was a default."""
    try:
        args = parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `kvpatch eval {shlex.join(argv)}` does not parse")
    config = asdict(EvalConfig(**vars(args)))
    output = config["output"].rstrip("/")
    assert (ROOT / output / "manifest.json").is_file(), f"{where}: {output} has no manifest"
    run = Path(output).name
    made_with = dict(manifest(run)["config"])
    made_with["policies"] = [spelled(p, run) for p in made_with["policies"]]
    config["policies"] = [spelled(p, run if written_then else None) for p in config["policies"]]
    for name in AS_SETS:
        assert sorted(config[name]) == sorted(made_with[name]), f"{where}: {output}: {name}"
    for name in SETTINGS:
        assert config[name] == made_with.get(name, config[name]), f"{where}: {output}: {name}"
    if config["prompt_format"] is not None:  # else the tokenizer's choice, stored resolved
        assert config["prompt_format"] == made_with["prompt_format"], f"{where}: {output}"


def test_the_pages_give_commands_for_published_results():
    assert len(COMMANDS) >= 20 and len(RUNS) >= 20


@pytest.mark.parametrize(
    "page, argv", COMMANDS, ids=[f"{page}:{output_of(argv)}" for page, argv in COMMANDS]
)
def test_a_published_command_names_its_results_settings(page, argv):
    assert_names_its_settings(page, argv)


def test_every_published_result_has_its_command():
    named = {output_of(argv) for _, argv in COMMANDS}
    assert {f"results/{name}" for name in RUNS} - named == set()


@pytest.mark.parametrize("name", RUNS)
def test_a_manifest_gives_the_command_that_makes_it(name):
    words = shlex.split(manifest(name)["command"])
    assert words[:3] == PREFIXES[0]
    assert output_of(words) == f"results/{name}"
    assert_names_its_settings(f"results/{name}/manifest.json", words[3:], written_then=True)


def _commit_exists(commit: str) -> bool | None:
    """Whether the repository has ``commit``; None where there is no git history to ask."""
    if not (ROOT / ".git").exists():
        return None
    done = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    )
    return done.returncode == 0


@pytest.mark.parametrize("name", RUNS)
def test_every_manifest_names_its_commit_and_versions(name):
    """Each part of a run names the commit, the versions and the hardware it was made with; what
    the run did not record itself (a version given as a pin, hardware unknown) says how it was
    found."""
    parts = manifest(name)["provenance"]
    assert parts and sum(part["records"] for part in parts) == manifest(name)["records"]
    for part in parts:
        assert re.fullmatch(r"[0-9a-f]{40}", part["commit"]), part["commit"]
        assert _commit_exists(part["commit"]) in (True, None), part["commit"]
        versions = part["versions"]
        assert set(VERSIONS) <= set(versions) and all(versions[v] for v in VERSIONS)
        if not all(RELEASE.fullmatch(versions[v]) for v in VERSIONS):
            assert part["versions_from"].strip(), f"{name}: versions without how they were known"
        if all(value is None for value in part["hardware"].values()):
            assert part["hardware_from"].strip(), f"{name}: no hardware, and no word of why"


def wilson(successes: float, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval, written out from its definition (Wilson 1927): the p
    whose normal test against the observed share p̂ is not rejected at 5%, the roots of
    (p̂ - p)^2 = z^2 p (1 - p) / n."""
    z = 1.959963984540054
    share = successes / n
    # (1 + z²/n) p² - (2 p̂ + z²/n) p + p̂² = 0
    a, b, c = 1 + z * z / n, -(2 * share + z * z / n), share * share
    root = math.sqrt(b * b - 4 * a * c)
    return (max(0.0, (-b - root) / (2 * a)), min(1.0, (-b + root) / (2 * a)))


@pytest.mark.parametrize("name", RUNS)
def test_a_manifest_holds_what_its_records_give(name):
    """Its counts and every accuracy cell follow from its records; each cell's interval is the
    95% Wilson interval of that cell's count."""
    stored = manifest(name)
    answers = records(name)
    assert len(answers) == stored["records"]
    cells = defaultdict(list)
    for record in answers:
        cells[record["task"], record["mode"], record["policy"], record["ratio"]].append(record)
    assert len(cells) == len(stored["summary"])
    for row in stored["summary"]:
        cell = cells[row["task"], row["mode"], row["policy"], row["ratio"]]
        scores = [record["score"] for record in cell]
        assert row["samples"] == len(cell)
        assert row["accuracy"] == pytest.approx(sum(scores) / len(scores), abs=1e-12)
        low, high = wilson(sum(scores), len(scores))
        assert (row["accuracy_low"], row["accuracy_high"]) == pytest.approx((low, high), abs=1e-9)
    # every cell: the samples of its task (a multiquestion context asks three questions)
    config = stored["config"]
    assert stored["samples"] == config["samples"]
    runs = 1 + len(config["policies"]) * len(config["ratios"])  # the full cache's, then each
    assert len(cells) == len(config["tasks"]) * len(config["modes"]) * runs
    for (task, *_), cell in cells.items():
        assert len(cell) == config["samples"] * QUESTIONS.get(task, 1)


def test_wilson_gives_the_textbook_interval():
    """The test's own interval against published values (Newcombe 1998, Statistics in
    Medicine 17, table II, the score method: 81 of 263, 15 of 148, 0 of 20, 1 of 29)."""
    assert wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert wilson(15, 148) == pytest.approx((0.0624, 0.1605), abs=1e-4)
    assert wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)
    assert wilson(1, 29) == pytest.approx((0.0061, 0.1718), abs=1e-4)


def test_a_pages_markers_become_a_runs_figures():
    """``<!-- results: NAME -->`` becomes the run's tables, each accuracy shown with its 95%
    interval as the tables show it; ``<!-- results-plot: NAME -->`` its plot."""
    runs = published_runs(RESULTS)
    page = "Before.\n\n<!-- results: default -->\n\n<!-- results-plot: default -->\nAfter.\n"
    text = expand_markers(page, runs, plot_link=lambda name: f"runs/{name}.png")
    assert "<!--" not in text and text.startswith("Before.") and text.endswith("After.\n")
    assert "![accuracy against compression ratio, default](runs/default.png)" in text
    for row in manifest("default")["summary"]:
        low, high = wilson(row["accuracy"] * row["samples"], row["samples"])
        shown = f"{row['accuracy']:.2f} [{low:.2f}, {high:.2f}]"
        assert f"| {row['mode']} | {row['policy']} | {row['ratio']:g} | {shown} |" in text
    with pytest.raises(ValueError, match="no published run 'nothing'"):
        expand_markers("<!-- results: nothing -->", runs, plot_link=str)
    quoted = "Write `<!-- results: NAME -->` on a line of its own.\n"  # a marker quoted stays
    assert expand_markers(quoted, runs, plot_link=str) == quoted


def test_the_command_prints_a_runs_tables_and_draws_its_plot(tmp_path, capsys):
    from kvpatch.tools.eval.published import main

    assert main(["default", "--results", str(RESULTS)]) == 0
    printed = capsys.readouterr().out
    full = manifest("default")["summary"][0]
    assert printed.startswith("| task | question | policy |")
    assert f"| single | prefill | full | 0 | 1.00 [0.84, 1.00] | {full['kv_mb']:.2f} |" in printed
    pytest.importorskip("matplotlib")
    assert main(["default", "--results", str(RESULTS), "--plot", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_marker_of_the_pages_names_a_published_run():
    marked = {m["name"] for page in PAGES for m in MARKER.finditer(page.read_text())}
    assert marked and marked <= set(RUNS)


def test_docs_hold_no_records():
    """The records live in results/; docs/ holds pages and their pictures."""
    raw = ("results.json", "results.csv", "manifest.json")
    found = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "docs").rglob("*")
        if path.name in raw or ".jsonl" in path.name or path.suffix == ".csv"
    ]
    assert found == []


def test_a_published_run_is_its_manifest_and_records():
    folders = sorted(path.name for path in RESULTS.iterdir() if path.is_dir())
    assert folders == RUNS
    for name in RUNS:
        assert (RESULTS / name / manifest(name)["records_file"]).is_file(), name


#: the README's tables of published figures: the header that starts each, the runs their rows come
#: from (the first that has the row's policy), and each column's cells (one or several, joined by
#: " / "): (what, the placements in order of preference, ratio). Its KV MB column takes the
#: question-in-prompt measurement where a run has one (the cache as it holds the whole prompt).
R = (0.5, 0.75, 0.9)
README_TABLES = [
    (
        "| policy (ratio 0.5) | exact answers | KV MB |",
        ("spans",),
        [[("answers", ("prefill",), 0.5)], [("kv_mb", ("prefill",), 0.5)]],
    ),
    (
        "| policy | r = 0.5 | 0.75 | 0.9 | KV MB at 0.75 |",
        ("grid", "kvzap", "layer-floor", "kvzap-layer-floor", "kvzip-spans", "floor-cap"),
        [
            *([("accuracy", ("agnostic",), r)] for r in R),
            [("kv_mb", ("prefill", "agnostic"), 0.75)],
        ],
    ),
    (
        "| policy | question in the prompt | question-agnostic |",
        (
            "gemma-2k",
            "gemma-2k-more",
            "gemma-2k-layer-floor-both",
            "gemma-2k-kvzip-spans",
            "gemma-2k-kvzip-spans-prefill",
            "gemma-2k-floor-cap",
            "gemma-2k-kvzap-prompt-window",
        ),
        [[("accuracy", ("prefill",), r) for r in R], [("accuracy", ("agnostic",), r) for r in R]],
    ),
]


def _table(text: str, header: str) -> list[list[str]]:
    """The rows (cells) of the table starting with ``header``."""
    lines = text[text.index(header) :].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _policy(label: str) -> str | None:
    """A row's policy, from its label: ``kvpatch `snapkv``` is snapkv; another library's rows
    are not the manifests' (None)."""
    if label.startswith("kvpress"):
        return None
    label = label.removeprefix("kvpatch ").strip("`")
    return "full" if label == "full cache" else label


def _figure(runs: tuple[str, ...], policy: str, what: str, modes: tuple[str, ...], ratio: float):
    for name in runs:
        for row in manifest(name)["summary"]:
            if row["task"] != "single" or spelled(row["policy"], name) != spelled(policy):
                continue
            wanted = 0.0 if policy == "full" else ratio  # the full cache's row serves every ratio
            if row["ratio"] == wanted and row["mode"] == _first_mode(name, policy, modes):
                if what == "answers":
                    return f"{round(row['accuracy'] * row['samples'])} / {row['samples']}"
                return f"{row[what]:.1f}" if what == "kv_mb" else f"{row[what]:.2f}"
    pytest.fail(f"no run of {runs} has {policy} at {ratio}")


def _first_mode(name: str, policy: str, modes: tuple[str, ...]) -> str | None:
    rows = manifest(name)["summary"]
    have = {row["mode"] for row in rows if spelled(row["policy"], name) == spelled(policy)}
    return next((mode for mode in modes if mode in have), None)


@pytest.mark.parametrize("header, runs, columns", README_TABLES, ids=lambda x: str(x)[:30])
def test_the_readmes_tables_quote_the_manifests(header, runs, columns):
    """The README is read without a build: its tables are written out, and must give what the
    manifests give (bold marks aside)."""
    rows = _table((ROOT / "README.md").read_text(), header)
    checked = 0
    for label, *cells in rows:
        policy = _policy(label)
        if policy is None:
            continue
        for cell, column in zip(cells, columns, strict=True):
            expected = " / ".join(_figure(runs, policy, *spec) for spec in column)
            assert cell.replace("**", "") == expected, f"{label}: {cell}"
            checked += 1
    assert checked >= 2 * len(columns)


class Rerun(NamedTuple):
    """Policies of a published run rerun on its first context, at one ratio."""

    name: str
    policies: list[str]
    model: str
    modes: list[str] | None = None
    ratio: float = 0.75


#: a published result, the policies rerun from it, on the model it was made with (no kvzap: the
#: tests give it a random map), and the placements rerun (None: the run's). Only what kvpatch
#: still does alike: KVzip with the question in the prompt keeps its prompt_window since the
#: runs before kvzip-question-window, so theirs are rerun question-agnostically.
RERUNS = [
    Rerun("gemma-2k", ["span-snapkv", "keydiff", "tova"], "gemma3-270m"),
    Rerun("gemma-2k-layer-floor", ["kvzip"], "gemma3-270m"),
    Rerun("gemma-2k-kvzip-question-window", ["kvzip"], "gemma3-270m"),
    Rerun("gemma-multikey-multivalue", ["keydiff/n_sink=0", "tova"], "gemma3-270m"),
    Rerun("grid", ["snapkv", "keydiff"], "smollm2"),
    Rerun("grid", ["global-kvzip"], "smollm2", ["agnostic"]),
    Rerun("kvzip-question-window", ["global-kvzip"], "smollm2"),
    # their global-kvzip answers made again once the floor came on top of the question window
    Rerun("gemma-2k-kvzip-spans-prefill", ["global-kvzip"], "gemma3-270m"),
    Rerun("kvzip-spans-both", ["global-kvzip"], "smollm2", ["prefill"]),
    Rerun(
        "gemma-2k-layer-floor-both", ["global-kvzip/layer_floor=0.25"], "gemma3-270m", ["prefill"]
    ),
    # past r = 0.75 KVzip's floor kept: the first needle is held where the shrinking floor lost it
    Rerun("floor-cap", ["global-kvzip"], "smollm2", ["agnostic"], 0.9),
    Rerun("kvzip-spans-both", ["global-kvzip"], "smollm2", ["agnostic"], 0.9),
]


def answer_key(record: dict, run: str | None = None) -> tuple:
    """A record's cell and sample, known by its needles (its index depends on how many samples
    each task has) and its policy as today's name spells it (see :func:`spelled`)."""
    policy = spelled(record["policy"], run)
    return (
        record["task"],
        record["mode"],
        policy,
        record["ratio"],
        str(record["expected"]),
        record["depth"],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, policies, model, modes, ratio",
    RERUNS,
    ids=[f"{r.name}:{'+'.join(r.policies)}:{r.ratio}" for r in RERUNS],
)
def test_a_published_result_reproduces(name, policies, model, modes, ratio, tmp_path):
    """Its command, on the first context of each task and one ratio, gives the stored answers
    word for word (the same seed and samples; a run on another CPU may round differently)."""
    from kvpatch.tools import demo
    from kvpatch.tools.eval.run import run_eval

    if not demo.is_cached(model=model):
        pytest.skip(f"{model} is not cached: python -m kvpatch.tools.demo --model {model}")
    stored = manifest(name)["config"]
    made_with = {k: v for k, v in stored.items() if k in EvalConfig.__dataclass_fields__}
    today = [spelled(p, name) for p in policies]  # what the stored names meant when measured
    rerun_with = dict(policies=today, ratios=[ratio], samples=1, output=str(tmp_path))
    if modes is not None:
        rerun_with["modes"] = modes
    config = EvalConfig(**{**made_with, **rerun_with, "plot": False, "progress": False})
    rerun = run_eval(config)["records"]
    expected = {answer_key(r, name): r["answer"] for r in records(name)}
    assert rerun and all(answer_key(r) in expected for r in rerun)
    assert {answer_key(r): r["answer"] for r in rerun} == {
        answer_key(r): expected[answer_key(r)] for r in rerun
    }
