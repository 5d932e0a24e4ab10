"""``kvpatch bench``: decode speed and KV bytes of policies against the full cache, on a model.

Every configuration prefills the same random context and decodes ``--tokens`` tokens greedily;
a stopping criterion stamps the clock at every step, so a decode step is timed where it happens
(the prefill is not subtracted). Configurations are interleaved over ``--rounds`` rounds against
the machine's drift; the table gives medians, and ratios to the full cache of the same rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import pairwise

import torch

import kvpatch
from kvpatch.loading import add_model_options, load_model

FULL = "full"


class StepClock:
    """A stopping criterion that never stops and records when each step ends."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores=None, **kwargs) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_seconds(self) -> float:
        """Median seconds between two decode steps (the first stamp ends the prefill)."""
        gaps = [b - a for a, b in pairwise(self.stamps)]
        return statistics.median(gaps)


def decode_once(model, ids: torch.Tensor, policy: str, tokens: int) -> tuple[float, int]:
    """Seconds per decoded token and KV bytes held at the end, for one configuration."""
    from transformers import DynamicCache, StoppingCriteriaList

    clock = StepClock()
    if policy == FULL:
        cache = DynamicCache(config=model.config)
    else:
        cache = kvpatch.CompressedDynamicCache(config=model.config, policy=policy)
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
        do_sample=False, stopping_criteria=StoppingCriteriaList([clock]),
        pad_token_id=model.generation_config.pad_token_id or 0,
        **{kvpatch.compat.cache_argument(model): cache},
    )  # fmt: skip
    return clock.step_seconds(), kvpatch.cache_nbytes(cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpatch bench", description=__doc__.splitlines()[0])
    add_model_options(parser, "snapkv:0.75")
    parser.add_argument("--policies", nargs="+", help="several policies (instead of --policy)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    policies = args.policies or [args.policy]
    try:
        for policy in policies:
            kvpatch.parse_policy(policy)
        model, _ = load_model(args.model, args.attn, args.dtype)
    except ValueError as error:
        print(f"kvpatch bench: error: {error}", file=sys.stderr)
        return 2
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, args.context), generator=generator).to(model.device)
    runs: dict[str, list[tuple[float, int]]] = {p: [] for p in [FULL, *policies]}
    kvpatch.enable(model)  # each compressed cache carries its policy; the full one stays stock
    try:
        for _ in range(args.rounds):
            for policy in runs:
                runs[policy].append(decode_once(model, ids, policy, args.tokens))
    finally:
        kvpatch.disable(model)
    print_table(runs, args.context)
    return 0


def print_table(runs: dict[str, list[tuple[float, int]]], context: int) -> None:
    full_s = statistics.median(s for s, _ in runs[FULL])
    full_bytes = runs[FULL][0][1]
    print(f"context {context} tokens; medians of {len(runs[FULL])} interleaved rounds")
    print("| policy | KV MB | KV / full | ms per token | decode / full |")
    print("|---|---|---|---|---|")
    for policy, results in runs.items():
        seconds = statistics.median(s for s, _ in results)
        held = results[0][1]
        print(
            f"| {policy} | {held / 2**20:.1f} | {held / full_bytes:.3f} | {seconds * 1e3:.1f} | "
            f"{seconds / full_s:.2f} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
