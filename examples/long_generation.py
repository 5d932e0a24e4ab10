"""A long generation on a bounded cache: ``decode_budget`` keeps the KV bytes constant.

Once every head holds ``budget + interval`` tokens, each layer is compressed back to ``budget``
with the same policy, scored from the newest queries.

    python examples/long_generation.py [--model demo|DIR] [--tokens N] [--budget B]
"""

from __future__ import annotations

import argparse

import torch

import kvpatch
from kvpatch.chat import render
from kvpatch.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--policy", default="snapkv:0.5")
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--interval", type=int, default=64)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "sdpa", "float32")
    text = render(tokenizer, [{"role": "user", "content": "Tell a very long story."}], True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    cache = kvpatch.CompressedDynamicCache(
        config=model.config, decode_budget=args.budget, decode_interval=args.interval
    )
    with kvpatch.enabled(model, args.policy):
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
            min_new_tokens=args.tokens, do_sample=True, top_p=0.9,
            pad_token_id=tokenizer.pad_token_id,
            **{kvpatch.compat.cache_argument(model): cache},
        )  # fmt: skip
    held = max(int(n.float().mean(-1).max()) for n in cache.physical_lengths())
    print(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)[:400], "...")
    print(f"\n{out.shape[1] - ids.shape[1]} tokens generated; {cache.get_seq_length()} seen,")
    print(f"{held} held per head now (budget {args.budget}, compressed every {args.interval})")
    print(cache.stats())


if __name__ == "__main__":
    main()
