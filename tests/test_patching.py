"""enable / disable: reversible, clear about what is supported, and wired into generate."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from oracle import greedy_logits
from transformers import DynamicCache, T5Config, T5ForConditionalGeneration

import kvpatch
from kvpatch import CompressedDynamicCache, compat
from kvpatch.attention.modules import _policies as _module_policies


def fingerprint(model):
    """Everything enable may touch, and the model's behaviour."""
    with torch.no_grad():
        logits, tokens = greedy_logits(model, prompt(80), DynamicCache(config=model.config), 5)
    return {
        "implementation": compat.attention_implementation(model),
        "instance_attributes": sorted(vars(model)),
        "hooks": [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()],
        "generate": model.generate.__func__,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "logits": logits,
        "tokens": tokens,
    }


def assert_same(a, b):
    for key in a:
        if key in ("state",):
            assert a[key].keys() == b[key].keys()
            assert all(torch.equal(a[key][k], b[key][k]) for k in a[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_enable_disable_round_trip(attn):
    model = make_model("llama", attn)
    before = fingerprint(model)
    kvpatch.enable(model, "think+ada-snapkv")
    assert kvpatch.is_enabled(model)
    assert compat.attention_implementation(model) == attn  # the shared config is untouched
    modules = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    assert all(m.config._attn_implementation == f"kvpatch_{attn}" for m in modules)
    model.generate(prompt(100), max_new_tokens=3, do_sample=False)
    kvpatch.disable(model)
    assert all(m.config is model.config for m in modules)
    assert not kvpatch.is_enabled(model)
    assert not any(m in _module_policies for m in model.modules())
    assert_same(before, fingerprint(model))


def test_context_manager_restores_on_error():
    model = make_model("llama")
    before = fingerprint(model)
    with pytest.raises(RuntimeError, match="boom"), kvpatch.enabled(model, "snapkv"):
        assert kvpatch.is_enabled(model)
        raise RuntimeError("boom")
    assert_same(before, fingerprint(model))


def test_generate_without_cache_gets_a_compressed_one():
    model = make_model("llama")
    ids = prompt(300)
    with kvpatch.enabled(model, "ada-snapkv:0.75"):
        out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    cache = compat.cache_of(out)
    assert isinstance(cache, CompressedDynamicCache)
    assert cache.get_seq_length() == 300 + 4
    assert all(lengths.sum() < 2 * 300 for lengths in cache.physical_lengths())


def test_generate_matches_step_by_step_decoding():
    """generate() on an explicit cache makes the greedy choices of forward-by-forward decoding."""
    model = make_model("llama")
    ids = prompt(300)
    with kvpatch.enabled(model, "think+ada-knorm:0.6"):
        _, expected = greedy_logits(model, ids, CompressedDynamicCache(config=model.config), 8)
        out = model.generate(
            ids,
            max_new_tokens=9,
            do_sample=False,
            **{compat.cache_argument(model): CompressedDynamicCache(config=model.config)},
        )
    assert torch.equal(out[:, 300:-1], expected)


def test_cache_policy_overrides_model_policy():
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.25"):
        cache = CompressedDynamicCache(config=model.config, policy="knorm:0.75")
        greedy_logits(model, prompt(400), cache, 0)
    assert all(lengths.sum() == 2 * 100 for lengths in cache.physical_lengths())


def test_cache_policy_alone_compresses():
    model = make_model("llama")
    with kvpatch.enabled(model):  # no model policy
        plain = CompressedDynamicCache(config=model.config)
        greedy_logits(model, prompt(200), plain, 0)
        own = CompressedDynamicCache(config=model.config, policy="knorm:0.5")
        greedy_logits(model, prompt(200), own, 0)
    assert all(lengths.sum() == 2 * 200 for lengths in plain.physical_lengths())
    assert all(lengths.sum() == 2 * 100 for lengths in own.physical_lengths())


def test_compressed_cache_without_enable_raises():
    model = make_model("llama")
    cache = CompressedDynamicCache(config=model.config, policy="snapkv")
    with pytest.raises(RuntimeError, match=r"kvpatch\.enable"):
        greedy_logits(model, prompt(50), cache, 2)


def test_enable_twice_and_disable_unknown():
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv"), pytest.raises(ValueError, match="already enabled"):
        kvpatch.enable(model, "tova")
    with pytest.raises(ValueError, match="not enabled"):
        kvpatch.disable(model)


def test_unsupported_attention_implementation():
    model = make_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="sdpa, eager, flash_attention_2"):
        kvpatch.enable(model, "snapkv")
    assert not kvpatch.is_enabled(model)


def test_unsupported_models():
    config = T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    with pytest.raises(ValueError, match="decoder-only"):
        kvpatch.enable(T5ForConditionalGeneration(config), "snapkv")
    with pytest.raises(ValueError, match="causal LM"):
        kvpatch.enable(torch.nn.Linear(2, 2), "snapkv")


def test_bad_policy_is_rejected_before_patching():
    model = make_model("llama")
    with pytest.raises(ValueError, match="Did you mean 'snapkv'"):
        kvpatch.enable(model, "snapvk")
    assert not kvpatch.is_enabled(model)
