"""flash_attention_2 on a compressed cache (needs a CUDA GPU and flash-attn; skipped otherwise)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import make_model, prompt
from oracle import evictions_of, greedy_logits, oracle_logits

import kvpatch
from kvpatch import CompressedDynamicCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="flash_attention_2 needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed"
    ),
]


def gpu_model(name="llama"):
    model = make_model(name, "sdpa").to("cuda", torch.float16)
    kvpatch.compat.set_attention_implementation(model, "flash_attention_2")
    return model


@pytest.mark.parametrize("policy", ["snapkv:0.5", "ada-snapkv:0.6", "think:0.5+ada-knorm:0.5"])
def test_flash_attention_matches_oracle(policy):
    model = gpu_model()
    ids = prompt(400).cuda()
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = greedy_logits(model, ids, cache, 10)
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=3e-2, rtol=0)


def test_flash_attention_ratio_zero_matches_unpatched():
    model = gpu_model()
    ids = prompt(300).cuda()
    from transformers import DynamicCache

    reference, ref_tokens = greedy_logits(model, ids, DynamicCache(config=model.config), 10)
    with kvpatch.enabled(model, "ada-snapkv:0"):
        logits, tokens = greedy_logits(model, ids, CompressedDynamicCache(config=model.config), 10)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, reference, atol=1e-3, rtol=0)


@pytest.mark.parametrize("policy", ["kvzip:0.5", "think:0.5+global-kvzip:0.6", "keydiff:0.5"])
def test_flash_attention_question_agnostic_matches_oracle(policy):
    """KVzip's reconstruction computes its own attention, so it runs under flash too."""
    from test_agnostic import ByteTokenizer, prefill_and_decode

    model = gpu_model()
    ids = prompt(400).cuda()
    with kvpatch.enabled(model, policy, tokenizer=ByteTokenizer()):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = prefill_and_decode(model, ids, cache, steps=10)
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=3e-2, rtol=0)
