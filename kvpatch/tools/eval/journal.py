"""The runs an evaluation has finished, one JSON line each, so a stopped run can resume.

``OUTPUT/records.jsonl`` starts with a line holding the settings that decide what is run (the
samples, policies, ratios, model, ...); every finished answer is appended as one line at once.
``--resume`` reads it back, keeps its answers and runs only the rest; a journal written with other
settings is refused, naming them, rather than mixed with this run's answers.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "records.jsonl"
#: settings that change where or how a run reports, not what it measures
NOT_COMPARED = ("output", "plot", "progress", "resume")


class CannotResume(ValueError):
    """The journal in the output directory cannot be continued by this run."""


def run_key(mode: str, policy: str, ratio: float, sample: int) -> tuple:
    return (mode, policy, float(ratio), int(sample))


class Journal:
    """Finished records of one evaluation, on disk as they finish."""

    def __init__(self, path: Path, settings: dict, records: list[dict]):
        self.path, self.settings, self.records = path, settings, records
        self.done = {run_key(r["mode"], r["policy"], r["ratio"], r["sample"]) for r in records}

    @classmethod
    def open(cls, output: Path, settings: dict, resume: bool) -> Journal:
        """The journal in ``output``: continued if ``resume`` (and one exists), else begun."""
        compared = {k: v for k, v in settings.items() if k not in NOT_COMPARED}
        path = Path(output) / FILE
        records = _read(path, compared) if resume and path.exists() else []
        path.parent.mkdir(parents=True, exist_ok=True)
        # written anew, so that a line cut short by the stop is not followed by new ones
        lines = [json.dumps({"settings": compared})] + [json.dumps(r, default=str) for r in records]
        path.write_text("\n".join(lines) + "\n")
        return cls(path, compared, records)

    def is_done(self, mode: str, policy: str, ratio: float, sample: int) -> bool:
        return run_key(mode, policy, ratio, sample) in self.done

    def add(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        self.records.append(record)
        self.done.add(run_key(record["mode"], record["policy"], record["ratio"], record["sample"]))


def _read(path: Path, settings: dict) -> list[dict]:
    lines = path.read_text().splitlines()
    try:
        header = json.loads(lines[0])["settings"]
    except (IndexError, KeyError, TypeError, json.JSONDecodeError) as error:
        message = f"{path} is not an evaluation journal; remove it to start anew"
        raise CannotResume(message) from error
    differ = sorted(k for k in set(header) | set(settings) if header.get(k) != settings.get(k))
    if differ:
        shown = ", ".join(f"{k}: {header.get(k)!r} there, {settings.get(k)!r} now" for k in differ)
        raise CannotResume(
            f"cannot resume {path}: it was written with other settings ({shown}); run with the "
            "same settings, or without --resume to start anew"
        )
    records = []
    for line in lines[1:]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short when the run was stopped: that answer runs again
    return records
