"""The eval's one recorded prefill per sample (:class:`kvpatch.SharedPrefill`) on a model that
mixes sliding-window and full-attention layers (Gemma 3): every policy's cache, for the whole
context or a prefix of it, is the cache that policy's own prefill of those tokens builds."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpatch
from kvpatch import compat
from kvpatch.cache import CompressedLayer
from kvpatch.tools.testing import byte_tokenizer, random_prompt, tiny_model

#: Gemma 3's pattern (sliding layers, then a full one), cut short; 1 KV head as in Gemma 3 270M
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
WINDOW = 24
TOKENS = 120


@pytest.fixture(scope="module")
def setup():
    tokenizer = byte_tokenizer()
    # eager: a prefix's own prefill gives bit-identical keys (sdpa's kernels round differently
    # at another length, which can flip a near-tie in what a policy keeps)
    model = tiny_model(
        "gemma3",
        "eager",
        key_scale=4.0,
        vocab_size=len(tokenizer),
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    ids = random_prompt(TOKENS, vocab=len(tokenizer))
    with kvpatch.enabled(model):
        shared = kvpatch.SharedPrefill.run(model, ids)
    return model, tokenizer, ids, shared


def own_prefill(model, ids, policy, tokenizer, recent_tokens=0):
    if policy is None:
        cache = DynamicCache(config=model.config)
        model(ids, use_cache=True, **{compat.cache_argument(model): cache})
        return cache
    options = dict(policy=policy, tokenizer=tokenizer, recent_tokens=recent_tokens)
    return kvpatch.prefill(model, ids, **options).cache


def next_logits(model, cache, token: torch.Tensor) -> torch.Tensor:
    return model(token, use_cache=True, **{compat.cache_argument(model): cache}).logits[:, -1]


@pytest.mark.parametrize("policy", [None, "snapkv:0.5", "ada-knorm:0.75", "global-kvzip:0.75"])
@pytest.mark.parametrize("length", [TOKENS, 70], ids=["whole", "prefix"])
@pytest.mark.parametrize("recent", [0, 30], ids=["context", "question-window"])
@torch.no_grad()
def test_a_shared_prefill_builds_what_a_prefill_of_those_tokens_does(setup, policy, length, recent):
    model, tokenizer, ids, shared = setup
    with kvpatch.enabled(model):
        built = shared.cache(model, policy, length, tokenizer, recent_tokens=recent)
        own = own_prefill(model, ids[:, :length], policy, tokenizer, recent_tokens=recent)
        for index, (a, b) in enumerate(zip(built.layers, own.layers, strict=True)):
            if isinstance(b, CompressedLayer):
                assert torch.equal(a.physical_lengths(), b.physical_lengths()), index
                continue
            if LAYER_TYPES[index] == "sliding_attention":  # the prefix's newest tokens only
                assert a.keys.shape[-2] < WINDOW < length, index
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), index
        if policy is not None:
            assert built.stats().nbytes == own.stats().nbytes
        token = ids[:, -1:]  # any next token reads every layer's cache
        torch.testing.assert_close(next_logits(model, built, token), next_logits(model, own, token))
