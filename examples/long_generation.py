"""A long generation on a bounded cache: ``decode_budget`` keeps the KV bytes constant.

Once every head holds ``budget + interval`` tokens, each layer is compressed back to ``budget``
with the same policy, scored from the newest queries. The story streams as it is written, with
the bytes held every ``interval`` tokens; a cache that kept every token would grow all along.

    python examples/long_generation.py [--model demo|DIR] [--tokens N] [--budget B]
"""

from __future__ import annotations

import argparse

import torch
from transformers import StoppingCriteria, TextStreamer

import kvpatch
from kvpatch.chat import render
from kvpatch.tools.loading import load_model


class ShowBytes(StoppingCriteria):
    """Prints, every ``every`` decoded tokens, what the cache holds (never stops generation)."""

    def __init__(self, cache, every: int, prompt_tokens: int):
        self.cache, self.every, self.prompt_tokens = cache, every, prompt_tokens

    def __call__(self, input_ids, scores, **kwargs):
        decoded = input_ids.shape[1] - self.prompt_tokens
        if decoded % self.every == 0:
            held = max(int(n.max()) for n in self.cache.physical_lengths() if n is not None)
            mib = self.cache.nbytes() / 2**20
            print(f"\n  [{decoded} tokens: {held} held per head, {mib:.2f} MiB]", flush=True)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, a checkpoint directory, ...")
    parser.add_argument("--policy", default="snapkv:0.5", help="what to keep when compressing")
    parser.add_argument("--tokens", type=int, default=400, help="tokens to generate")
    parser.add_argument("--budget", type=int, default=256, help="tokens per head kept")
    parser.add_argument("--interval", type=int, default=64, help="tokens between compressions")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "sdpa", "float32")
    text = render(tokenizer, [{"role": "user", "content": "Tell a very long story."}], True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    cache = kvpatch.CompressedDynamicCache(
        config=model.config, decode_budget=args.budget, decode_interval=args.interval
    )
    show = ShowBytes(cache, args.interval, ids.shape[1])
    with kvpatch.enabled(model, args.policy):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            do_sample=True,
            top_p=0.9,
            pad_token_id=tokenizer.pad_token_id,
            stopping_criteria=[show],
            streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
            **{kvpatch.compat.cache_argument(model): cache},
        )
    lengths = [n for n in cache.physical_lengths() if n is not None]  # None: a sliding layer
    held = max(int(n.float().mean(-1).max()) for n in lengths)
    print(f"\n{out.shape[1] - ids.shape[1]} tokens generated; {cache.get_seq_length()} seen,")
    print(f"{held} held per head now (budget {args.budget}, compressed every {args.interval})")
    print(cache.stats())


if __name__ == "__main__":
    main()
