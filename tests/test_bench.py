"""Step-interleaved timing (kvpatch.tools.bench.take_turns): the runs take turns one step at a time,
each step is timed alone, and an error in one run reaches the caller without stalling the rest."""

from __future__ import annotations

import pytest
import torch

from kvpatch.tools import bench
from kvpatch.tools.bench import take_turns

IDS = torch.zeros(1, 1, dtype=torch.long)


class VirtualTime:
    """A clock that moves only when a fake step says it worked: exact durations, whatever
    else the machine is doing (one run works at a time, by construction)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def fake_generate(name: str, steps: int, log: list[str], pause: float = 0.0, clock=None):
    """What generate does with a stopping criterion: a step (``pause`` seconds of ``clock``),
    then the criterion, ``steps`` times."""

    def run(criterion):
        for _ in range(steps):
            log.append(name)
            if clock is not None:
                clock.now += pause
            assert not criterion(IDS).any()
        return f"{name} done"

    return run


def test_runs_take_turns_one_step_each_and_finished_runs_drop_out():
    log: list[str] = []
    runs = {"a": fake_generate("a", 3, log), "b": fake_generate("b", 1, log)}
    runs["c"] = fake_generate("c", 2, log)
    results = take_turns(runs)
    assert log == ["a", "b", "c", "a", "c", "a"]
    assert {name: value for name, (_, value) in results.items()} == {
        "a": "a done",
        "b": "b done",
        "c": "c done",
    }


def test_a_step_is_timed_without_the_other_runs_steps(monkeypatch):
    time = VirtualTime()
    monkeypatch.setattr(bench, "time", time)
    log: list[str] = []
    runs = {
        "fast": fake_generate("fast", 4, log, 0.01, time),
        "slow": fake_generate("slow", 4, log, 0.06, time),
    }
    clocks = {name: clock for name, (clock, _) in take_turns(runs).items()}
    fast, slow = clocks["fast"], clocks["slow"]
    assert fast.step_seconds() == pytest.approx(0.01)  # not the 0.07 between its steps
    gaps = [b - a for a, b in zip(fast.ends, fast.ends[1:], strict=False)]
    assert gaps == pytest.approx([0.07] * 3)
    assert slow.step_seconds() == pytest.approx(0.06)
    assert fast.prefill_seconds == pytest.approx(0.01)


def test_an_error_in_one_run_is_raised_after_the_others_finish():
    log: list[str] = []

    def failing(clock):
        clock(IDS)
        raise RuntimeError("out of memory")

    runs = {"ok": fake_generate("ok", 3, log), "bad": failing}
    with pytest.raises(RuntimeError, match="out of memory"):
        take_turns(runs)
    assert log == ["ok"] * 3
