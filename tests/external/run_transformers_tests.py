"""Run transformers' own model tests with and without kvpatch, and list what kvpatch breaks.

transformers' wheel and source distribution hold no model tests: give a checkout of its
repository at the installed version (``git clone --depth 1 --branch vX.Y.Z`` of
huggingface/transformers or a mirror holding the tags; nothing of it is kept here)::

    python tests/external/run_transformers_tests.py --source ~/src/transformers \\
        --models llama qwen2 gemma2 --policies snapkv:0 ada-snapkv:0

For each model, its ``tests/models/NAME/test_modeling_NAME.py`` runs once without kvpatch and
once per policy with :mod:`tests.external.kvpatch_plugin` (kvpatch enabled on every model that
generates). A *regression* is a test that passes without kvpatch and fails or errors with it.
A regression whose error is one of kvpatch's documented refusals (:data:`REFUSALS`: what kvpatch
turns down by design, with an error that says so) is counted apart; every other one is listed.
Prints one summary line per (model, policy) and the regressions; ``--json`` writes them. Exits
with 1 if a regression is not a documented refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# loaded by its own name from this folder: transformers' checkout has a ``tests`` package too
PLUGIN = "kvpatch_plugin"
#: kvpatch's documented refusals (docs/bad-input.md), by a fragment of their error message
REFUSALS = {
    "a cache_implementation kvpatch cannot compress (static, ...)": "which would hold the whole "
    "cache uncompressed",
    "a model with no full-attention layer (nothing to compress)": "which already bounds its cache",
}


def outcomes_of(found: dict[str, tuple[str, str]]) -> dict[str, str]:
    """``test id -> passed | failed | skipped`` of :func:`results`."""
    return {name: outcome for name, (outcome, _) in found.items()}


def results(junit: Path) -> dict[str, tuple[str, str]]:
    """``test id -> (outcome, failure message)`` from a junit XML report (errors count as
    failures)."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failures = [child for child in case if child.tag in ("failure", "error")]
        if failures:
            found[name] = ("failed", _failure_text(failures[0]))
        elif any(child.tag == "skipped" for child in case):
            found[name] = ("skipped", "")
        else:
            found[name] = ("passed", "")
    return found


def _failure_text(failure: ElementTree.Element) -> str:
    """A failure's message, then the error lines pytest printed for it (``E   ...``): a refusal
    that a test's own error wraps (its chained cause) is found there."""
    text = failure.text or ""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    message = failure.get("message") or (errors[0] if errors else text)
    return "\n".join([message, *errors])


def regressions(without: dict[str, str], with_kvpatch: dict[str, str]) -> list[str]:
    """Tests that pass without kvpatch and do not pass with it (missing ones included)."""
    return sorted(
        name
        for name, outcome in without.items()
        if outcome == "passed" and with_kvpatch.get(name, "missing") in ("failed", "missing")
    )


def refusal_of(message: str) -> str | None:
    """The documented refusal ``message`` is, or None."""
    return next((what for what, says in REFUSALS.items() if says in message), None)


def source_version(source: Path) -> str | None:
    init = source / "src" / "transformers" / "__init__.py"
    if not init.exists():
        return None
    found = re.search(r'__version__ = "([^"]+)"', init.read_text())
    return found.group(1) if found else None


def run_pytest(
    source: Path,
    test_file: Path,
    junit: Path,
    policy: str | None,
    extra: list[str],
    slow: bool = False,
):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), str(source)])}
    env.pop("KVPATCH_POLICY", None)
    if slow:  # transformers' slow tests: torch.export and torch.compile among them
        env["RUN_SLOW"] = "1"
    command = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider"]
    command += ["--junitxml", str(junit), "-o", "addopts=", *extra]
    if policy is not None:
        env["KVPATCH_POLICY"] = policy
        command += ["-p", PLUGIN]
    junit.unlink(missing_ok=True)  # a report left by an earlier run is not this one's
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
    if not junit.exists():
        raise RuntimeError(
            f"pytest wrote no report for {test_file} (policy {policy}):\n"
            f"{(done.stdout + done.stderr)[-2000:]}"
        )
    return results(junit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a transformers checkout")
    parser.add_argument("--models", nargs="+", default=["llama", "qwen2", "gemma2"])
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["snapkv:0", "ada-snapkv:0", "think:0+snapkv:0", "global-kvzip:0"],
    )
    parser.add_argument("--out", type=Path, default=Path("transformers_tests_out"))
    parser.add_argument("--json", type=Path, help="write the summary and regressions here")
    parser.add_argument("-k", help="only the tests pytest -k selects")
    parser.add_argument(
        "--slow",
        action="store_true",
        help="run transformers' slow tests too (RUN_SLOW=1), e.g. -k 'torch_export or compile'",
    )
    args = parser.parse_args(argv)

    import transformers

    installed, checkout = transformers.__version__, source_version(args.source)
    if checkout is None:
        parser.error(f"--source {args.source}: no src/transformers/__init__.py with a version")
    if checkout != installed:
        print(f"warning: the checkout is transformers {checkout}, {installed} is installed")
    extra = ["-k", args.k] if args.k else []
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"transformers": installed, "checkout": checkout, "runs": []}
    for model in args.models:
        test_file = args.source / "tests" / "models" / model / f"test_modeling_{model}.py"
        if not test_file.exists():
            parser.error(f"no {test_file}; --models names folders of tests/models")
        stock = run_pytest(
            args.source, test_file, args.out / f"{model}.xml", None, extra, args.slow
        )
        without = outcomes_of(stock)
        for policy in args.policies:
            junit = args.out / f"{model}-{re.sub(r'[^a-z0-9.]+', '_', policy)}.xml"
            with_kvpatch = run_pytest(args.source, test_file, junit, policy, extra, args.slow)
            report["runs"].append(summarise(model, policy, without, with_kvpatch))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if any(run["regressions"] for run in report["runs"]) else 0


def summarise(model: str, policy: str, without: dict[str, str], found: dict) -> dict:
    """One (model, policy) run (``found``: :func:`results` with kvpatch): its counts, the
    refusals by kind, the other regressions (and their messages), printed and returned."""
    refused: dict[str, list[str]] = {}
    others = {}
    for name in regressions(without, outcomes_of(found)):
        message = found.get(name, ("missing", "not run"))[1]
        kind = refusal_of(message)
        if kind is None:
            others[name] = message.splitlines()[0][:300] if message else ""
        else:
            refused.setdefault(kind, []).append(name)
    passed = sum(outcome == "passed" for outcome in without.values())
    refusals = sum(len(names) for names in refused.values())
    print(
        f"{model:8} {policy:20} tests {len(without)}, passed without kvpatch {passed}, "
        f"documented refusals {refusals}, regressions {len(others)}",
        flush=True,
    )
    for kind, names in refused.items():
        print(f"    refused, {kind}: {len(names)}")
    for name, message in others.items():
        print(f"    {name}: {message}")
    return {
        "model": model,
        "policy": policy,
        "tests": len(without),
        "passed": passed,
        "refusals": refused,
        "regressions": sorted(others),
        "messages": others,
    }


if __name__ == "__main__":
    raise SystemExit(main())
