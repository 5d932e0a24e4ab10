"""The compressed cache holds less: bytes of its tensors' storages against DynamicCache's."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from helpers import PROMPT, SLACK, held_bytes, prefill
from transformers import DynamicCache

import kvpatch
from kvpatch import CompressedDynamicCache, compat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "policy, kept",
    [
        ("snapkv:0.75", 0.25),
        ("ada-snapkv:0.75", 0.25),
        ("think:0.5", 0.75),
        ("think:0.5+snapkv:0.5", 0.375),
        ("think:0.5+ada-snapkv:0.5", 0.375),
        ("think-v:0.5", 0.75),
    ],
)
def test_bytes_after_prefill(policy, kept, dtype):
    model = make_model("llama", "sdpa").to(dtype)
    full = held_bytes(prefill(model, DynamicCache(config=model.config)).layers)
    with kvpatch.enabled(model, policy):
        cache = prefill(model, CompressedDynamicCache(config=model.config))
    held = held_bytes(cache.layers)
    assert cache.nbytes() == held, "nbytes() must count every tensor the cache holds"
    assert held / full <= kept + SLACK, f"{policy}: {held / full:.4f} of the full cache"
    assert held / full >= kept - SLACK, "the policy removed more than its ratio"


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_bytes_counted_after_decode_steps(attention):
    """What a decode step adds beside the keys and values (recent queries, the padding slots a
    padded view writes fake keys into) is counted too."""
    model = make_model("llama", attention)
    with kvpatch.enabled(model, "ada-snapkv:0.75"):
        cache = prefill(model, CompressedDynamicCache(config=model.config))
        with torch.no_grad():
            for token in prompt(4)[0]:
                model(token.view(1, 1), use_cache=True, **{compat.cache_argument(model): cache})
    assert cache.nbytes() == held_bytes(cache.layers)


def test_storage_not_views_is_counted():
    """A slice that keeps the whole prefill alive would be caught by counting storages."""
    model = make_model("llama", "sdpa")
    with kvpatch.enabled(model, "snapkv:0.75"):
        cache = prefill(model, CompressedDynamicCache(config=model.config))
    layer = cache.layers[0]
    before = layer.nbytes()
    big = torch.zeros(1, 2, PROMPT, 32)
    layer.store.keys.data = big[..., -layer.store.keys.length :, :]  # a small view of it
    assert layer.nbytes() >= before + big.nbytes - layer.store.keys.view().nbytes


def test_logical_and_physical_lengths():
    model = make_model("llama", "sdpa")
    with kvpatch.enabled(model, "ada-knorm:0.75"):
        cache = prefill(model, CompressedDynamicCache(config=model.config))
    assert cache.get_seq_length() == PROMPT
    for lengths in cache.physical_lengths():
        assert lengths.sum() == 2 * (PROMPT - PROMPT * 3 // 4)
        assert len(set(lengths.flatten().tolist())) > 1


@pytest.mark.parametrize(
    "policy", ["global-snapkv:0.5", "pyramid-expected-attention:0.5", "think:0.5+global-tova:0.5"]
)
def test_layers_waiting_for_shared_budgets_hold_scores_not_queries(policy):
    """Until every layer's scores are known, a layer keeps its scorer's scores and the last 64
    queries (a channel policy's window, a decode budget), not every query of the prefill; the
    kept tokens are those the layer's full inputs give (the oracle tests check the same)."""
    model = make_model("llama")
    ids = prompt(300)
    config = model.config
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=config)
        with torch.no_grad():
            model(ids, use_cache=True, **{compat.cache_argument(model): cache})
        layers = cache.deferred_layers
        assert len(layers) == config.num_hidden_layers
        for layer in layers:
            inputs = layer.deferred.inputs
            assert inputs.queries.shape[2] == 64
            assert inputs.scores.shape == (1, config.num_key_value_heads, 300)


def test_sliding_layers_hold_only_their_window_after_the_prefill():
    """Stock sliding-window layers keep a view of the whole prefill until the first decode step;
    a compressed cache's copy their window out, so the prefill's storage is freed at once."""
    from transformers import DynamicCache

    from kvpatch.cache.stats import layer_stats
    from kvpatch.tools.testing import random_prompt, tiny_model

    model, ids = tiny_model("gemma3"), random_prompt(400)
    window = model.config.sliding_window
    caches = {"stock": DynamicCache(config=model.config)}
    caches["kvpatch"] = kvpatch.CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, "snapkv:0.5"):
        for cache in caches.values():
            model(ids, **{kvpatch.compat.cache_argument(model): cache})
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    for index in sliding:
        held = layer_stats(caches["kvpatch"].layers[index]).nbytes
        stock = layer_stats(caches["stock"].layers[index]).nbytes
        assert held <= window * per_token < stock
