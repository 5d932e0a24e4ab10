"""Two policies compared on the same samples, of one run or of two.

Every policy of a run answers the same samples, so two accuracy cells can be compared pair by
pair: the samples both answer or both miss say nothing about which is better, only those one
answers and the other misses do. McNemar's exact test asks how likely a split of those samples
at least as uneven is if neither policy is better (each such sample a fair coin); it separates
two policies sooner than two independent intervals would.

Two runs made with the same sample settings (:data:`SAMPLE_SETTINGS`) asked the same questions
of their first contexts whatever their number of samples or other tasks; their samples are
matched by what they ask (the expected values and where they are).

A sample counts as answered when its score is 1 (every value it asks for found).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpatch.tools.eval.options import FULL


@dataclass(frozen=True)
class PairedCounts:
    """How two policies answered the same samples of one (task, question placement, ratio)."""

    task: str
    mode: str
    ratio: float
    both: int
    first_only: int
    second_only: int
    neither: int

    @property
    def samples(self) -> int:
        return self.both + self.first_only + self.second_only + self.neither

    @property
    def p_value(self) -> float:
        """McNemar's exact two-sided p-value: the probability, with each discordant sample a fair
        coin, of a split at least as uneven as this one."""
        return mcnemar_exact(self.first_only, self.second_only)


def mcnemar_exact(first_only: int, second_only: int) -> float:
    """Two-sided exact p-value of ``first_only`` against ``second_only`` discordant samples."""
    n = first_only + second_only
    fewer = min(first_only, second_only)
    tail = sum(math.comb(n, k) for k in range(fewer + 1)) / 2**n
    return min(1.0, 2 * tail)


#: the settings that decide a run's samples (with its tasks and number of samples, which decide
#: only how many there are and how they are numbered)
SAMPLE_SETTINGS = ("model", "prompt_format", "context_tokens", "digits", "seed")


def compare(
    records: Iterable[dict],
    first: str,
    second: str,
    second_records: Iterable[dict] | None = None,
) -> list[PairedCounts]:
    """The paired counts of policies ``first`` and ``second`` (as the records name them) at
    every (task, mode, ratio) where both answered; the full cache (ratio 0) is compared at
    every ratio of the other policy. ``second_records``: the run ``second`` is in, if another
    (made with the same :data:`SAMPLE_SETTINGS`; see :func:`check_same_samples`)."""
    one_run = second_records is None
    sample = _sample_index if one_run else _sample_identity
    answered = _answered_by_policy(records, sample)
    theirs = answered if one_run else _answered_by_policy(second_records, sample)
    for policy, run, which in ((first, answered, "the first"), (second, theirs, "the second")):
        _require(policy, run, "this" if one_run else which)
    pairs = ((first, answered), (second, theirs))
    cells = sorted({cell for p, run in pairs for cell in run[p] if cell[2] != 0.0})
    out = []
    for cell in cells:
        a, b = (run[p].get(_cell_of(p, cell), {}) for p, run in pairs)
        shared = a.keys() & b.keys()
        if shared:
            out.append(_counts(*cell, [(a[s], b[s]) for s in sorted(shared)]))
    if not out:
        raise ValueError(
            f"{first!r} and {second!r} answered no samples of a task, placement and ratio in "
            "common (the full cache is compared at another policy's ratios)"
        )
    return out


def _require(policy: str, answered: dict, run: str) -> None:
    if policy not in answered:
        raise ValueError(
            f"no records of {policy!r} in {run} run; its policies: {', '.join(sorted(answered))}"
        )


def check_same_samples(first: dict, second: dict) -> None:
    """Refuses two runs' settings (their manifests' ``config``) that made different samples."""
    differ = [k for k in SAMPLE_SETTINGS if first.get(k) != second.get(k)]
    if differ:
        shown = ", ".join(f"{k}: {first.get(k)!r} and {second.get(k)!r}" for k in differ)
        raise ValueError(f"the two runs asked different samples ({shown})")


def _sample_index(record: dict) -> object:
    return record["sample"]


def _sample_identity(record: dict) -> object:
    """What a sample asks, the same in every run of the same sample settings."""
    return (str(record["expected"]), record["depth"])


def _answered_by_policy(
    records: Iterable[dict], sample: Callable[[dict], object]
) -> dict[str, dict[tuple, dict[object, bool]]]:
    """``{policy: {(task, mode, ratio): {sample(record): answered}}}``; two samples of a cell
    that ``sample`` cannot tell apart are an error."""
    out: dict[str, dict[tuple, dict[object, bool]]] = {}
    for r in records:
        cell = (r["task"], r["mode"], r["ratio"])
        answers = out.setdefault(r["policy"], {}).setdefault(cell, {})
        key = sample(r)
        if key in answers:
            raise ValueError(f"two samples of {r['policy']!r} in {cell} ask the same: {key}")
        answers[key] = r["score"] == 1.0
    return out


def _cell_of(policy: str, cell: tuple) -> tuple:
    """Where ``policy``'s answers for ``cell`` are: the full cache's at ratio 0, whatever the
    cell's ratio."""
    return (*cell[:2], 0.0) if policy == FULL else cell


def _counts(task: str, mode: str, ratio: float, pairs: list[tuple[bool, bool]]) -> PairedCounts:
    return PairedCounts(
        task,
        mode,
        ratio,
        both=sum(a and b for a, b in pairs),
        first_only=sum(a and not b for a, b in pairs),
        second_only=sum(b and not a for a, b in pairs),
        neither=sum(not (a or b) for a, b in pairs),
    )


def format_comparison(counts: list[PairedCounts], first: str, second: str) -> str:
    """A Markdown table of :func:`compare`'s counts."""
    lines = [
        f"first: {first}",
        f"second: {second}",
        "",
        "| task | question | ratio | samples | both | first only | second only | neither "
        "| p (McNemar, exact) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in counts:
        lines.append(
            f"| {c.task} | {c.mode} | {c.ratio:g} | {c.samples} | {c.both} | {c.first_only} "
            f"| {c.second_only} | {c.neither} | {c.p_value:.3f} |"
        )
    return "\n".join(lines) + "\n"
