"""PyramidKV layer budgets: shares falling with depth, the scorer's total, the oracle's logits."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import prompt
from oracle import evictions_of, greedy_logits, oracle_logits

import kvpatch
from kvpatch import CompressedDynamicCache
from kvpatch.policies.pyramid import pyramid_weights
from kvpatch.tools.testing import tiny_model


@pytest.mark.parametrize("layers, beta", [(2, 20.0), (4, 20.0), (7, 5.0), (32, 20.0)])
def test_weights_fall_linearly_to_one_over_beta_with_mean_one(layers, beta):
    weights = pyramid_weights(layers, beta)
    assert sum(weights) / layers == pytest.approx(1.0)
    assert weights[-1] == pytest.approx(1 / beta) and weights[0] == pytest.approx(2 - 1 / beta)
    steps = [a - b for a, b in itertools.pairwise(weights)]
    assert all(step == pytest.approx(steps[0]) and step > 0 for step in steps)


def four_layers():
    return tiny_model(num_hidden_layers=4, key_scale=4.0)


def held_per_layer(policy: str, length: int = 600) -> tuple[list[int], CompressedDynamicCache]:
    model = four_layers()
    with kvpatch.enabled(model, policy):
        cache = kvpatch.prefill(model, prompt(length)).cache
    return [int(n.sum()) for n in cache.physical_lengths()], cache


def test_lower_layers_keep_more_and_the_total_is_the_scorers():
    pyramid, _ = held_per_layer("pyramid-snapkv:0.75")
    uniform, _ = held_per_layer("snapkv:0.75")
    assert all(a > b for a, b in itertools.pairwise(pyramid)), pyramid
    heads = 2
    window = 64 * heads  # SnapKV's window, kept in every layer
    assert min(pyramid) >= window
    assert abs(sum(pyramid) - sum(uniform)) <= len(pyramid) * heads  # rounding, a token a head


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5])
def test_low_ratios_fill_lower_layers_and_pass_the_rest_up(ratio):
    """Where the pyramid would give a low layer more than its tokens, the rest goes up: the total
    stays the scorer's (everything at ratio 0)."""
    pyramid, _ = held_per_layer(f"pyramid-snapkv:{ratio}")
    uniform, _ = held_per_layer(f"snapkv:{ratio}")
    assert abs(sum(pyramid) - sum(uniform)) <= len(pyramid) * 2
    assert max(pyramid) <= 600 * 2 and pyramid == sorted(pyramid, reverse=True)


def test_bytes_are_the_ratios_share():
    model = four_layers()
    ids = prompt(1024)
    full = kvpatch.cache_nbytes(_dense(model, ids))
    with kvpatch.enabled(model, "pyramid-snapkv:0.75"):
        held = kvpatch.prefill(model, ids).cache.nbytes()
    assert abs(held / full - 0.25) <= 0.02


def _dense(model, ids):
    from transformers import DynamicCache

    from kvpatch import compat

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{compat.cache_argument(model): cache})
    return cache


@pytest.mark.parametrize("policy", ["pyramid-snapkv:0.75", "think:0.5+pyramid-tova:0.5"])
def test_pyramid_matches_the_oracle(policy):
    model = four_layers()
    ids = prompt(400)
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = greedy_logits(model, ids, cache, 8)
    lengths = [int(n.sum()) for n in cache.physical_lengths()]
    assert lengths[0] > lengths[-1]
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
