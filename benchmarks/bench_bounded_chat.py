"""Memory of a long scripted chat: every turn kept, each turn compressed at the policy's ratio,
and a bounded history (``max_kv_tokens``), on the demo model (or a random Llama with --random).

Each configuration appends the same user/assistant turns (rendered with the chat template,
about 20 tokens each) to a :class:`~kvpatch.CompressedContext` and prints, at a few turn
counts, the tokens each head holds on average and the cache's bytes.

    python -m benchmarks.bench_bounded_chat --turns 1000 --budget 512
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import kvpatch

CHECKPOINTS = (10, 50, 100, 200, 300, 500, 1000)
WORDS = ["river", "lamp", "orange", "seven", "quiet", "garden", "paper", "north", "violin", "salt"]


def turns(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=12)) + "." for _ in range(count)]


def run(model, tokenizer, label: str, policy: str, budget: int | None, texts: list[str]) -> None:
    from kvpatch.chat import render

    messages, rendered, context = [], "", None
    start = time.perf_counter()
    with kvpatch.enabled(model, policy, tokenizer=tokenizer):
        for index, text in enumerate(texts, 1):
            role = "user" if index % 2 else "assistant"
            messages.append({"role": role, "content": text})
            now = render(tokenizer, messages)
            ids = tokenizer(now[len(rendered) :], return_tensors="pt", add_special_tokens=False)
            ids, rendered = ids.input_ids.to(model.device), now
            if context is None:
                context = kvpatch.prefill(model, ids, max_kv_tokens=budget)
            else:
                context = context.extend(ids)
            if index in CHECKPOINTS:
                stats = context.cache.stats()
                held = torch.stack([layer.held.float().mean() for layer in stats.layers]).mean()
                print(
                    f"| {label} | {index} | {stats.layers[0].seen} | {held:.0f} | "
                    f"{stats.nbytes / 2**20:.1f} | {time.perf_counter() - start:.0f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--policy", default="keydiff:0.5")
    args = parser.parse_args()
    from kvpatch.tools import demo

    model, tokenizer = demo.load(download=False)
    texts = turns(args.turns)
    print("| history | turns | tokens seen | tokens held per head | MiB held | seconds |")
    print("|---|---|---|---|---|---|")
    for label, policy, budget in (
        ("every token kept", f"{args.policy.split(':')[0]}:0", None),
        (f"each turn at {args.policy}", args.policy, None),
        (f"max_kv_tokens={args.budget}", args.policy, args.budget),
    ):
        run(model, tokenizer, label, policy, budget, texts)


if __name__ == "__main__":
    main()
