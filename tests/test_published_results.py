"""The published results can be reproduced from the documentation.

Every ``kvpatch eval`` command the README and the documentation pages give (in a shell block or
inline) that writes to ``docs/`` must parse, and must name the settings its stored results were
made with (``results.json``'s ``config``); every stored result must have such a command. Set
order (policies, ratios, tasks, modes) changes only the order of a table's rows. Marked ``slow``
(the real models): rerun on its first contexts, a published result gives its stored answers.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict
from pathlib import Path

import pytest

from kvpatch.tools.eval.cli import parser
from kvpatch.tools.eval.config import EvalConfig

ROOT = Path(__file__).resolve().parents[1]
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
#: results stored under a policy's former name: what the command's names add to it today
RENAMED = {
    # measured while the chunk's own softmax was KVzip's default (docs/performance.md says so)
    "docs/results-kvzip-plus": "/normalise=chunk",
}


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


COMMANDS = [(page, argv) for page, argv in eval_commands() if output_of(argv).startswith("docs/")]


def test_the_pages_give_commands_for_published_results():
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize(
    "page, argv", COMMANDS, ids=[f"{page}:{output_of(argv)}" for page, argv in COMMANDS]
)
def test_a_published_command_names_its_results_settings(page, argv):
    try:
        args = parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{page}: `kvpatch eval {shlex.join(argv)}` does not parse")
    config = asdict(EvalConfig(**vars(args)))
    output = config["output"].rstrip("/")
    stored = ROOT / output / "results.json"
    assert stored.is_file(), f"{page}: {output} has no results.json"
    made_with = json.loads(stored.read_text())["config"]
    renamed = RENAMED.get(output)
    if renamed:
        config["policies"] = [p.replace(renamed, "") for p in config["policies"]]
    for name in AS_SETS:
        assert sorted(config[name]) == sorted(made_with[name]), f"{page}: {output}: {name}"
    for name in SETTINGS:
        assert config[name] == made_with.get(name, config[name]), f"{page}: {output}: {name}"
    if config["prompt_format"] is not None:  # else the tokenizer's choice, stored resolved
        assert config["prompt_format"] == made_with["prompt_format"], f"{page}: {output}"


def test_every_published_result_has_its_command():
    named = {output_of(argv) for _, argv in COMMANDS}
    stored = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "docs").glob("*/results.json")}
    assert stored - named == set()


#: a published result and the policies rerun from it, on the model it was made with (no kvzap:
#: the tests give it a random map)
RERUNS = [
    ("docs/results-gemma-2k", ["span-snapkv", "keydiff", "kvzip"], "gemma3-270m"),
    ("docs/results-gemma-multikey-multivalue", ["keydiff/n_sink=0", "tova"], "gemma3-270m"),
    ("docs/results", ["snapkv", "keydiff", "global-kvzip"], "smollm2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("output, policies, model", RERUNS, ids=[r[0] for r in RERUNS])
def test_a_published_result_reproduces(output, policies, model, tmp_path):
    """Its command, on the first context of each task and one ratio, gives the stored answers
    word for word (the same seed and samples; a run on another CPU may round differently)."""
    from kvpatch.tools import demo
    from kvpatch.tools.eval.run import run_eval

    if not demo.is_cached(model=model):
        pytest.skip(f"{model} is not cached: python -m kvpatch.tools.demo --model {model}")
    stored = json.loads((ROOT / output / "results.json").read_text())
    made_with = {k: v for k, v in stored["config"].items() if k in EvalConfig.__dataclass_fields__}
    rerun_with = dict(policies=policies, ratios=[0.75], samples=1, output=str(tmp_path))
    config = EvalConfig(**{**made_with, **rerun_with, "plot": False, "progress": False})
    rerun = run_eval(config)["records"]
    # a sample is known by its needles (its index depends on how many samples each task has)
    key = lambda r: (r["task"], r["mode"], r["spec"], str(r["expected"]), r["depth"])
    expected = {key(r): r["answer"] for r in stored["records"]}
    assert rerun and all(key(r) in expected for r in rerun)
    assert {key(r): r["answer"] for r in rerun} == {key(r): expected[key(r)] for r in rerun}
