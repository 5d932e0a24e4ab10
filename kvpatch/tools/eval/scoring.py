"""From per-answer records to one summary row per (task, mode, policy, ratio)."""

from __future__ import annotations

import math
from collections import defaultdict

from kvpatch.tools.eval.options import FULL

#: the normal quantile of a two-sided 95% interval
Z_95 = 1.959963984540054


def wilson_interval(share: float, samples: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``share`` of ``samples`` (95% by default):
    unlike share ± z·se it stays inside [0, 1] and is not empty at 0 or 1. A sample's score
    may be a fraction (several values to find): the interval then treats the mean score as a
    proportion of ``samples``, which is what it is for 0/1 scores."""
    if samples <= 0:
        return (math.nan, math.nan)
    center = (share + z * z / (2 * samples)) / (1 + z * z / samples)
    half = (
        z
        / (1 + z * z / samples)
        * math.sqrt(share * (1 - share) / samples + z * z / (4 * samples * samples))
    )
    return (max(0.0, center - half), min(1.0, center + half))


def with_intervals(row: dict) -> dict:
    """``row`` with the 95% interval of its accuracy (``accuracy_low``, ``accuracy_high``)."""
    low, high = wilson_interval(row["accuracy"], row["samples"])
    return {**row, "accuracy_low": low, "accuracy_high": high}


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, mode, policy, ratio), in the order first seen."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["task"], record["mode"], record["policy"], record["ratio"])].append(record)
    full_kv = {
        (task, mode): _mean(r["kv_bytes"] for r in rows)
        for (task, mode, policy, _), rows in groups.items()
        if policy == FULL
    }
    return [_row(key, rows, full_kv.get(key[:2])) for key, rows in groups.items()]


def _row(key: tuple, rows: list[dict], full_kv: float | None) -> dict:
    """The summary of one (task, mode, policy, ratio)'s records; ``full_kv`` the full cache's
    mean KV bytes on the same samples (None if it was not run)."""
    task, mode, policy, ratio = key
    kv = _mean(r["kv_bytes"] for r in rows)
    decode_s = sum(r["decode_s"] for r in rows)
    row = {
        "task": task,
        "mode": mode,
        "policy": policy,
        "ratio": ratio,
        "samples": len(rows),
        "accuracy": _mean(r["score"] for r in rows),
        "kv_mb": kv / 2**20,
        "kv_saved": 1 - kv / full_kv if full_kv is not None else None,
        "prefill_s": _mean(r["prefill_s"] for r in rows),
        "decode_tok_s": sum(r["new_tokens"] for r in rows) / decode_s if decode_s else 0,
        **_needle_kept(rows),
    }
    return with_intervals(row)


def _needle_kept(rows: list[dict]) -> dict:
    """The share of the needles' tokens held (over layers and KV heads): on average, of the
    least-held needle of each sample, and token by token."""
    survivals = [r["needle_survival"] for r in rows if r["needle_survival"]]
    every = [share for survival in survivals for share in survival]
    return {
        "needle_kept": _mean(every) if every else None,
        "needle_min_kept": _mean(min(s) for s in survivals) if survivals else None,
        "needle_kept_by_token": _mean_by_index(survivals),
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _mean_by_index(lists) -> list[float] | None:
    """Element-wise mean of lists that may differ in length (index i over those that have it)."""
    columns: dict[int, list[float]] = defaultdict(list)
    for values in lists:
        for index, value in enumerate(values):
            columns[index].append(value)
    return [_mean(columns[i]) for i in range(len(columns))] or None
