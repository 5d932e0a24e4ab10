"""The runs an evaluation has finished, one JSON line each, so a stopped run can resume.

``OUTPUT/records.jsonl`` starts with a line holding the settings that decide what is run (the
samples, policies, ratios, model, ...) and the provenance of each part of the run (the commit,
versions and hardware of the process that made its answers, from which answer on); every finished
answer is appended as one line at once. ``--resume`` reads it back, keeps its answers and runs
only the rest; a journal written with other settings is refused, naming them, rather than mixed
with this run's answers. A finished run keeps its answers in ``records.jsonl.gz`` beside its
``manifest.json`` (:mod:`~kvpatch.tools.eval.manifest`) instead, and resumes from those.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvpatch.tools.eval.manifest import MANIFEST, RECORDS, read_manifest, read_records

FILE = "records.jsonl"
#: settings that change where or how a run reports, not what it measures
NOT_COMPARED = ("output", "plot", "progress", "resume")


class CannotResume(ValueError):
    """The journal in the output directory cannot be continued by this run."""


def run_key(mode: str, policy: str, ratio: float, sample: int) -> tuple:
    return (mode, policy, float(ratio), int(sample))


class Journal:
    """Finished records of one evaluation, on disk as they finish."""

    def __init__(self, path: Path, settings: dict, records: list[dict], parts: list[dict]):
        self.path, self.settings, self.records = path, settings, records
        #: the provenance of each part of the run, ``first``: the index of its first record
        self.parts = parts
        self.done = {run_key(r["mode"], r["policy"], r["ratio"], r["sample"]) for r in records}

    @classmethod
    def open(cls, output: Path, settings: dict, resume: bool, made_by: dict) -> Journal:
        """The journal in ``output``: continued if ``resume`` (and one exists), else begun;
        its answers from now on are ``made_by`` this provenance."""
        compared = {k: v for k, v in settings.items() if k not in NOT_COMPARED}
        path = Path(output) / FILE
        records, parts = _previous(Path(output), compared) if resume else ([], [])
        parts = [*parts, {**made_by, "first": len(records)}]
        path.parent.mkdir(parents=True, exist_ok=True)
        # written anew, so that a line cut short by the stop is not followed by new ones
        header = {"settings": compared, "parts": parts}
        lines = [json.dumps(header, default=str)]
        lines += [json.dumps(r, default=str) for r in records]
        path.write_text("\n".join(lines) + "\n")
        return cls(path, compared, records, parts)

    def is_done(self, mode: str, policy: str, ratio: float, sample: int) -> bool:
        return run_key(mode, policy, ratio, sample) in self.done

    def add(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        self.records.append(record)
        self.done.add(run_key(record["mode"], record["policy"], record["ratio"], record["sample"]))

    def provenance(self) -> list[dict]:
        """Each part that made answers, with how many (``records``) in place of ``first``."""
        ends = [p["first"] for p in self.parts[1:]] + [len(self.records)]
        counted = [
            {**{k: v for k, v in part.items() if k != "first"}, "records": end - part["first"]}
            for part, end in zip(self.parts, ends, strict=True)
        ]
        return [part for part in counted if part["records"] > 0]

    def remove(self) -> None:
        """Once the records are kept compressed beside the manifest: the journal is not needed."""
        self.path.unlink(missing_ok=True)


def _previous(output: Path, settings: dict) -> tuple[list[dict], list[dict]]:
    """The records and parts a stopped run left (its journal) or a finished one (its manifest
    and compressed records); none if there are neither."""
    if (output / FILE).exists():
        return _read(output / FILE, settings)
    if (output / MANIFEST).exists() and (output / RECORDS).exists():
        manifest = read_manifest(output)
        made_with = {k: v for k, v in manifest["config"].items() if k not in NOT_COMPARED}
        _check_settings(output / MANIFEST, made_with, settings)
        return read_records(output), _parts(manifest.get("provenance", []))
    return [], []


def _parts(provenance: list[dict]) -> list[dict]:
    """A manifest's provenance as journal parts: each from the record after the last's."""
    parts, first = [], 0
    for part in provenance:
        parts.append({**{k: v for k, v in part.items() if k != "records"}, "first": first})
        first += part["records"]
    return parts


def _read(path: Path, settings: dict) -> tuple[list[dict], list[dict]]:
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0])
        made_with = header["settings"]
    except (IndexError, KeyError, TypeError, json.JSONDecodeError) as error:
        message = f"{path} is not an evaluation journal; remove it to start anew"
        raise CannotResume(message) from error
    _check_settings(path, made_with, settings)
    records = []
    for line in lines[1:]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short when the run was stopped: that answer runs again
    parts = header.get("parts") or [_UNRECORDED]
    return records, parts


#: the part of a journal written before journals recorded their provenance
_UNRECORDED = {"first": 0, "commit": None, "commit_from": "not recorded by the journal"}


def _check_settings(path: Path, made_with: dict, settings: dict) -> None:
    differ = sorted(
        k for k in set(made_with) | set(settings) if made_with.get(k) != settings.get(k)
    )
    if differ:
        shown = ", ".join(
            f"{k}: {made_with.get(k)!r} there, {settings.get(k)!r} now" for k in differ
        )
        raise CannotResume(
            f"cannot resume {path}: it was written with other settings ({shown}); run with the "
            "same settings, or without --resume to start anew"
        )
