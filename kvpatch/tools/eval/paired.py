"""Two policies of one run compared on the same samples.

Every policy of a run answers the same samples, so two accuracy cells can be compared pair by
pair: the samples both answer or both miss say nothing about which is better, only those one
answers and the other misses do. McNemar's exact test asks how likely a split of those samples
at least as uneven is if neither policy is better (each such sample a fair coin); it separates
two policies sooner than two independent intervals would.

A sample counts as answered when its score is 1 (every value it asks for found).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
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


def compare(records: Iterable[dict], first: str, second: str) -> list[PairedCounts]:
    """The paired counts of policies ``first`` and ``second`` (as the records name them) at
    every (task, mode, ratio) where both answered; the full cache (ratio 0) is compared at
    every ratio of the other policy."""
    answered = _answered_by_policy(records)
    missing = [p for p in (first, second) if p not in answered]
    if missing:
        raise ValueError(
            f"no records of {', '.join(map(repr, missing))} in this run; its policies: "
            f"{', '.join(sorted(answered))}"
        )
    cells = sorted({cell for p in (first, second) for cell in answered[p] if cell[2] != 0.0})
    out = []
    for cell in cells:
        a, b = (answered[p].get(_cell_of(p, cell), {}) for p in (first, second))
        shared = a.keys() & b.keys()
        if shared:
            out.append(_counts(*cell, [(a[s], b[s]) for s in sorted(shared)]))
    if not out:
        raise ValueError(
            f"{first!r} and {second!r} answered no samples of a task, placement and ratio in "
            "common (the full cache is compared at another policy's ratios)"
        )
    return out


def _answered_by_policy(records: Iterable[dict]) -> dict[str, dict[tuple, dict[int, bool]]]:
    """``{policy: {(task, mode, ratio): {sample: answered}}}``."""
    out: dict[str, dict[tuple, dict[int, bool]]] = {}
    for r in records:
        cell = (r["task"], r["mode"], r["ratio"])
        out.setdefault(r["policy"], {}).setdefault(cell, {})[r["sample"]] = r["score"] == 1.0
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
