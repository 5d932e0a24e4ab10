"""A run as data: ``manifest.json`` (what made it and what it found) and its records compressed.

The manifest holds the command that makes the run, the settings (``config``), how many samples
and records it has, the summary (every accuracy with its 95% Wilson interval) and its
*provenance*: for each part of the run (one, unless a stopped run was resumed) the commit of
kvpatch's checkout, the files changed from it, the versions of Python, kvpatch, torch and
transformers, and the hardware. ``records.jsonl.gz`` holds one JSON line per answer. Tables and
plots are renderings of these two files; the published runs under ``results/`` are kept in this
form only.

Only the standard library is imported here (torch where a running process is described): the
documentation build reads manifests without loading a model.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import platform
import shlex
import subprocess
from pathlib import Path

MANIFEST = "manifest.json"
RECORDS = "records.jsonl.gz"
#: the manifest's layout; a reader refuses a newer one rather than misread it
FORMAT = 1
#: the command that runs the harness, as manifests spell it
PROGRAM = "python -m kvpatch.tools.eval"
#: settings a manifest and its command leave out: continuing a run does not change what it
#: measures (its provenance says it was continued)
NOT_IN_COMMAND = ("resume",)


def describe_process(device: str | None = None) -> dict:
    """The provenance of answers made by this process: when, from which commit, with which
    versions, on which hardware (``device``: where the model runs, e.g. ``cpu`` or ``cuda:0``)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.isoformat(timespec="seconds"),
        **source_commit(),
        "versions": versions(),
        "hardware": hardware(device),
    }


def versions() -> dict[str, str]:
    import torch
    import transformers

    import kvpatch

    return {
        "python": platform.python_version(),
        "kvpatch": kvpatch.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def hardware(device: str | None) -> dict:
    import torch

    gpu = None
    if device is not None and device.startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": device,
        "gpu": gpu,
        "platform": platform.platform(),
    }


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what Python knows, else None)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def source_commit() -> dict:
    """``commit``: the commit of the git checkout kvpatch is imported from, and ``changed``: the
    tracked files that differ from it (the code that ran is the commit plus those changes);
    ``commit`` None, with why in ``commit_from``, when kvpatch is not run from a checkout."""
    import kvpatch

    package = Path(kvpatch.__file__).resolve().parent
    top = _git(package, "rev-parse", "--show-toplevel")
    commit = _git(package, "rev-parse", "HEAD")
    if top is None or commit is None or Path(top.strip(), "kvpatch") != package:
        return {"commit": None, "commit_from": f"kvpatch was imported from {package}, no checkout"}
    # porcelain lines: two status letters, a space, the path
    status = _git(package, "status", "--porcelain", "--untracked-files=no") or ""
    changed = sorted(line[3:] for line in status.splitlines() if line.strip())
    return {"commit": commit.strip(), "changed": changed}


def _git(where: Path, *args: str) -> str | None:
    """What ``git args`` prints in ``where``, as printed; None if git fails or is missing."""
    try:
        done = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None  # no git: the commit is unknown, which the manifest then says
    return done.stdout if done.returncode == 0 else None


def command_for(settings: dict) -> str:
    """The command line that runs ``settings``: every setting that differs from the command's
    default, in the order ``--help`` lists them (parsed back, it gives the same settings)."""
    from kvpatch.tools.eval.arguments import parser

    words = shlex.split(PROGRAM)
    for action in parser()._actions:
        if not action.option_strings or action.dest not in settings:
            continue
        if action.dest in NOT_IN_COMMAND or settings[action.dest] == action.default:
            continue
        words += _option(action, settings[action.dest])
    return shlex.join(words)


def _option(action, value) -> list[str]:
    """The words that give ``action`` the value ``value``."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch: present means the value it stores
        return [flag]
    if isinstance(value, list | tuple):
        return [flag, *(_word(v) for v in value)]
    return [flag, _word(value)]


def _word(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def make_manifest(settings: dict, summary: list[dict], parts: list[dict], records: int) -> dict:
    """The manifest of a run with ``records`` answers summarised in ``summary`` (rows carrying
    ``accuracy_low`` and ``accuracy_high``), made in ``parts`` (each a provenance with its
    number of ``records``)."""
    return {
        "format": FORMAT,
        "command": command_for(settings),
        "config": {k: v for k, v in settings.items() if k not in NOT_IN_COMMAND},
        "samples": settings["samples"],
        "records": records,
        "records_file": RECORDS,
        "provenance": parts,
        "summary": summary,
    }


def write_run(output: Path, manifest: dict, records: list[dict]) -> None:
    """``records`` compressed, then the manifest naming them: each file replaced whole, so that
    a stop while writing leaves the previous pair, not half of one."""
    output.mkdir(parents=True, exist_ok=True)
    _replace(output / RECORDS, compress_records(records))
    text = json.dumps(manifest, indent=1, default=str) + "\n"
    _replace(output / MANIFEST, text.encode())


def compress_records(records: list[dict]) -> bytes:
    """One JSON line per record, gzipped without a timestamp: the same records, the same bytes
    (a rewritten run changes in git only where its answers do)."""
    text = "".join(json.dumps(r, default=str) + "\n" for r in records)
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)


def _replace(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def read_manifest(folder: Path) -> dict:
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    if manifest.get("format", 0) > FORMAT:
        raise ValueError(
            f"{folder}: manifest format {manifest['format']}; this kvpatch reads up to {FORMAT}"
        )
    return manifest


def read_records(folder: Path) -> list[dict]:
    manifest = read_manifest(folder)
    with gzip.open(Path(folder) / manifest.get("records_file", RECORDS), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]
