"""Compressed caches compute what compression means: the oracle's masked full attention."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from helpers import STEPS, compressed_run
from oracle import evictions_of, greedy_logits, oracle_logits

from kvpatch.attention import packed as packed_attention
from kvpatch.tools.testing import tiny_model

ORACLE_POLICIES = [
    "knorm:0.5",
    "ada-knorm:0.5",
    "streamingllm:0.6",
    "snapkv:0.5",
    "ada-snapkv:0.6",
    "think:0.5",
    "think:0.5+snapkv:0.5",
    "think:0.25+ada-snapkv:0.75",
    "tova:0.5",
]


@pytest.mark.parametrize("attn", ["sdpa", "sdpa-padded", "eager"])
@pytest.mark.parametrize("policy", ORACLE_POLICIES)
def test_compressed_cache_matches_oracle(policy, attn, monkeypatch):
    """``sdpa`` reads packed storage in place on the CPU; ``sdpa-padded`` takes the padded view
    with fake keys, as on an accelerator."""
    if attn == "sdpa-padded":
        monkeypatch.setattr(packed_attention, "DEVICES", ())
    model = make_model("llama", attn.removesuffix("-padded"))
    ids = prompt(400)
    logits, tokens, cache = compressed_run(model, policy, ids)
    evictions = evictions_of(cache)
    assert len(evictions) == model.config.num_hidden_layers
    assert any((~e.keep).any() or e.channel_keep is not None for e in evictions.values())
    if "ada-" in policy:  # head-wise budgets really give heads different lengths
        assert any(len(set(n.flatten().tolist())) > 1 for n in cache.physical_lengths())
    expected = oracle_logits(model, ids, evictions, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_compression_changes_logits():
    """The oracle check has teeth: without masking the evicted keys the logits differ."""
    model = make_model("llama", "sdpa")
    ids = prompt(160)
    logits, tokens, _ = compressed_run(model, "ada-knorm:0.75", ids)
    full = oracle_logits(model, ids, {}, tokens)
    assert (logits[1:] - full[1:]).abs().max() > 1e-3


@pytest.mark.parametrize("policy", ["ada-snapkv:0.6", "think:0.5+ada-knorm:0.5"])
def test_explicit_mask_fallback_matches_oracle(policy, monkeypatch):
    """When no fake key can be guaranteed the padding slots are masked, with the same result."""
    from kvpatch.attention import padded

    real = padded.fake_keys

    def failing(*args, **kwargs):
        keys, ok = real(*args, **kwargs)
        return keys, torch.zeros_like(ok)

    monkeypatch.setattr(padded, "fake_keys", failing)
    monkeypatch.setattr(packed_attention, "DEVICES", ())  # the padded view, with fake keys
    for attn in ("sdpa", "eager"):
        model = make_model("llama", attn)
        ids = prompt(300)
        logits, tokens, cache = compressed_run(model, policy, ids)
        expected = oracle_logits(model, ids, evictions_of(cache), tokens)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma2"])
def test_models_match_oracle(name):
    attn = "eager" if name == "gemma2" else "sdpa"  # Gemma 2 soft-caps logits, which sdpa cannot
    model = make_model(name, attn)
    ids = prompt(300)
    logits, tokens, cache = compressed_run(model, "think:0.5+ada-snapkv:0.5", ids)
    evictions = evictions_of(cache)
    sliding = [
        i for i, t in enumerate(getattr(model.config, "layer_types", None) or []) if "sliding" in t
    ]
    assert evictions and not set(evictions) & set(sliding), "sliding layers stay uncompressed"
    expected = oracle_logits(model, ids, evictions, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


#: Gemma 3 270M's attention (4 query heads sharing 1 KV head of 256 channels, sliding layers
#: between full ones) in 4 tiny layers, 2 of each kind so that layer budgets have a choice
GEMMA3_270M_SHAPE = dict(
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    hidden_size=64,
    num_hidden_layers=4,
    sliding_window=64,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)


@pytest.mark.parametrize("attn", ["sdpa", "sdpa-padded", "eager"])
@pytest.mark.parametrize(
    "policy",
    [
        "snapkv:0.6",
        "ada-snapkv:0.6",
        "global-snapkv:0.6",
        "keydiff:0.75",
        "think:0.5+snapkv:0.5",
        "think-v:0.25+snapkv:0.5",
    ],
)
def test_gemma3_270m_shape_matches_oracle(policy, attn, monkeypatch):
    """At the real model's head shape, the full-attention layers hold what the oracle masks and
    the sliding layers their window, through the prefill and decode steps past the window."""
    if attn == "sdpa-padded":
        monkeypatch.setattr(packed_attention, "DEVICES", ())
    model = tiny_model("gemma3", attn.removesuffix("-padded"), key_scale=4.0, **GEMMA3_270M_SHAPE)
    ids = prompt(300)
    logits, tokens, cache = compressed_run(model, policy, ids)
    evictions = evictions_of(cache)
    assert sorted(evictions) == [1, 3], "only the full-attention layers are compressed"
    expected = oracle_logits(model, ids, evictions, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    held = [layer.keys.shape[-2] for i, layer in enumerate(cache.layers) if i in (0, 2)]
    assert all(n < ids.shape[1] for n in held), "the sliding layers hold their window, not all"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "policy",
    [
        "snapkv",
        "ada-snapkv",
        "tova",
        "ada-tova",
        "knorm",
        "ada-knorm",
        "streamingllm",
        "random",
        "think",
        "think+snapkv",
        "think+ada-knorm",
    ],
)
def test_ratio_zero_is_exact(policy, attn):
    """Removing nothing gives the unpatched model's tokens and logits."""
    spec = "+".join(f"{term}:0" for term in policy.split("+"))
    model = make_model("llama", attn)
    ids = prompt(100)
    from transformers import DynamicCache

    reference, ref_tokens = greedy_logits(model, ids, DynamicCache(config=model.config), STEPS)
    logits, tokens, _ = compressed_run(model, spec, ids)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
