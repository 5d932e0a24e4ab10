"""``kvpatch bench``: decode speed and KV bytes of policies against the full cache, on a model
(its options in :mod:`kvpatch.tools.cli.bench`).

Every configuration prefills the same random context and decodes ``--tokens`` tokens greedily.
The configurations' ``generate`` calls run side by side and take turns, one decode step each
(:func:`take_turns`), so that the machine's drift hits them alike; a stopping criterion times
each step where it happens (the prefill is not subtracted). Each of ``--rounds`` rounds starts
from fresh caches; the table gives medians over the rounds, and ratios to the full cache.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch

import kvpatch
from kvpatch.attention import kernels
from kvpatch.tools.loading import load_model

FULL = "full"
T = TypeVar("T")


class _Turns:
    """Lets one of several named threads run at a time, handing over in a fixed cycle."""

    def __init__(self, names):
        self._order = list(names)
        self._current = self._order[0] if self._order else None
        self._changed = threading.Condition()

    def wait(self, name: str) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._current == name)

    def hand_over(self, name: str, leave: bool = False) -> None:
        """Give the turn to the thread after ``name`` (which drops out if ``leave``)."""
        with self._changed:
            position = self._order.index(name)
            if leave:
                self._order.remove(name)
            else:
                position += 1
            self._current = self._order[position % len(self._order)] if self._order else None
            self._changed.notify_all()


class TurnClock:
    """A stopping criterion that never stops, times each step of its ``generate`` and, between
    two steps, lets the other configurations of :func:`take_turns` run one step each."""

    def __init__(self, turns: _Turns, name: str):
        self._turns, self._name = turns, name
        self.start = 0.0  # when its generate began
        self.ends: list[float] = []  # when each step ended (the first: the prefill)
        self.resumes: list[float] = []  # when it got its turn back after each

    def __call__(self, input_ids, scores=None, **kwargs) -> torch.Tensor:
        if input_ids.is_cuda:  # the step's kernels are queued, not done
            torch.cuda.synchronize(input_ids.device)
        self.ends.append(time.perf_counter())
        self._turns.hand_over(self._name)
        self._turns.wait(self._name)
        self.resumes.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    @property
    def prefill_seconds(self) -> float:
        """The prefill and its first token."""
        return self.ends[0] - self.start

    def step_seconds(self) -> float:
        """Median seconds of a decode step, its own time only."""
        steps = zip(self.resumes[:-1], self.ends[1:], strict=True)
        return statistics.median(end - resume for resume, end in steps)


def take_turns(runs: dict[str, Callable[[TurnClock], T]]) -> dict[str, tuple[TurnClock, T]]:
    """Call every ``runs[name](clock)`` — a ``generate`` given ``clock`` as a stopping criterion
    — in a thread of its own, one at a time: each runs until its next step ends, then waits for
    the others to run one step each. Returns each clock and what its call returned; re-raises
    the first error."""
    turns = _Turns(runs)
    clocks = {name: TurnClock(turns, name) for name in runs}
    returned: dict[str, T] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        turns.wait(name)
        clocks[name].start = time.perf_counter()
        try:
            returned[name] = runs[name](clocks[name])
        except BaseException as error:  # handed to the caller
            errors.append(error)
        finally:
            turns.hand_over(name, leave=True)

    threads = [threading.Thread(target=run, args=(name,)) for name in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {name: (clocks[name], returned[name]) for name in runs}


def decode_into(model, ids: torch.Tensor, policy: str, tokens: int, clock: TurnClock) -> int:
    """Generate ``tokens`` tokens greedily from ``ids`` into a fresh cache of ``policy``, timed
    by ``clock``; returns the KV bytes held at the end."""
    from transformers import DynamicCache, StoppingCriteriaList

    if policy == FULL:
        cache = DynamicCache(config=model.config)
    else:
        cache = kvpatch.CompressedDynamicCache(config=model.config, policy=policy)
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([clock]),
        pad_token_id=model.generation_config.pad_token_id or 0,
        **{kvpatch.compat.cache_argument(model): cache},
    )
    return kvpatch.cache_nbytes(cache)


def run(args: argparse.Namespace) -> int:
    """Time ``args.policies`` against the full cache (the options of
    :mod:`kvpatch.tools.cli.bench`)."""
    policies = args.policies
    for policy in policies:
        kvpatch.parse_policy(policy)
    model, _ = load_model(args.model, args.attn, args.dtype)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, args.context), generator=generator).to(model.device)
    runs: dict[str, list[tuple[float, int]]] = {p: [] for p in [FULL, *policies]}
    kvpatch.enable(model)  # each compressed cache carries its policy; the full one stays stock
    try:
        for _ in range(args.rounds):
            one_round = {p: partial(decode_into, model, ids, p, args.tokens) for p in runs}
            for policy, (clock, held) in take_turns(one_round).items():
                runs[policy].append((clock.step_seconds(), held))
    finally:
        kvpatch.disable(model)
    print_table(runs, args.context)
    print(kernels.describe(model.device))
    return 0


def print_table(runs: dict[str, list[tuple[float, int]]], context: int) -> None:
    full_s = statistics.median(s for s, _ in runs[FULL])
    full_bytes = runs[FULL][0][1]
    print(f"context {context} tokens; medians of {len(runs[FULL])} rounds, steps interleaved")
    print("| policy | KV MB | KV / full | ms per token | decode / full |")
    print("|---|---|---|---|---|")
    for policy, results in runs.items():
        seconds = statistics.median(s for s, _ in results)
        held = results[0][1]
        print(
            f"| {policy} | {held / 2**20:.1f} | {held / full_bytes:.3f} | {seconds * 1e3:.1f} | "
            f"{seconds / full_s:.2f} |"
        )
