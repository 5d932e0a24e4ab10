"""Compressed generation in a few lines.

Builds a small random Llama-style model from a config (no download), generates from a 2,000-token
prompt with the full cache and with ``ada-snapkv:0.75``, and prints what each cache holds.

    python examples/quickstart.py [--policy POLICY] [--prompt-tokens N]
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvpatch


def small_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        eos_token_id=None,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def cache_bytes(cache) -> int:
    if isinstance(cache, kvpatch.CompressedDynamicCache):
        return cache.nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def run(model, ids, cache, new_tokens: int):
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            **{kvpatch.compat.cache_argument(model): cache},
        )
    return out[0, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="ada-snapkv:0.75", help="e.g. think+snapkv")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    model = small_model()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens))

    full_cache = DynamicCache(config=model.config)
    full_answer = run(model, ids, full_cache, args.new_tokens)

    with kvpatch.enabled(model, args.policy):
        cache = kvpatch.CompressedDynamicCache(config=model.config)
        answer = run(model, ids, cache, args.new_tokens)

    full, held = cache_bytes(full_cache), cache_bytes(cache)
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
