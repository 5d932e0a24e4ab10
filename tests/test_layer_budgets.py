"""Budgets shared across layers (``global-``): one ranking over every layer, and the floor that
keeps a layer whose scores live on a smaller scale from losing all its tokens to the others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpatch.policies import GlobalBudgets, LayerInputs, SnapKV, parse_policy
from kvpatch.tools.eval.config import with_ratio
from kvpatch.tools.testing import seeded

TOKENS, HEADS, RATIO = 100, 2, 0.75
#: what each layer keeps with uniform budgets: (1 - ratio) of its tokens in each head
UNIFORM = HEADS * (TOKENS - int(TOKENS * RATIO))


def layer_with(scores: torch.Tensor) -> LayerInputs:
    """A layer whose token scorer's scores are ``scores`` ``[1, heads, tokens]``."""
    keys = torch.randn(1, HEADS, TOKENS, 8, generator=seeded(1))
    queries = torch.randn(1, 2 * HEADS, TOKENS, 8, generator=seeded(2))
    valid = torch.ones(1, TOKENS, dtype=torch.bool)
    return LayerInputs(queries, keys, keys.clone(), valid, scaling=1.0, scores=scores)


@pytest.fixture
def two_scales():
    """One layer scoring in [1, 2), one a thousand times lower (as Gemma 3's deepest
    full-attention layer scores under KVzip), and their scores."""
    loud = torch.rand(1, HEADS, TOKENS, generator=seeded(3)) + 1.0
    quiet = torch.rand(1, HEADS, TOKENS, generator=seeded(4)) * 1e-3
    return [layer_with(loud), layer_with(quiet)], quiet


def kept_per_layer(policy: GlobalBudgets, inputs: list[LayerInputs]) -> list[int]:
    return [int(plan.keep.sum()) for plan in policy.plan_layers(inputs)]


def test_one_ranking_starves_the_layer_on_the_smaller_scale(two_scales):
    inputs, _ = two_scales
    scorer = SnapKV(ratio=RATIO, n_sink=0)
    assert kept_per_layer(GlobalBudgets(scorer, layer_floor=0.0), inputs) == [2 * UNIFORM, 0]


def test_by_default_each_layer_keeps_a_quarter_of_its_uniform_budget(two_scales):
    inputs, _ = two_scales
    kept = kept_per_layer(GlobalBudgets(SnapKV(ratio=RATIO, n_sink=0)), inputs)
    assert kept == [2 * UNIFORM - UNIFORM // 4, UNIFORM // 4]


def test_a_floor_keeps_each_layers_best_tokens_and_the_total(two_scales):
    inputs, quiet = two_scales
    scorer = SnapKV(ratio=RATIO, n_sink=0)
    policy = GlobalBudgets(scorer, layer_floor=0.5)
    plans = policy.plan_layers(inputs)
    # the quiet layer keeps exactly its floor (its scores win nothing of the rest), the loud one
    # the rest: the bytes of uniform budgets
    assert [int(p.keep.sum()) for p in plans] == [2 * UNIFORM - UNIFORM // 2, UNIFORM // 2]
    best = quiet.flatten().topk(UNIFORM // 2).indices  # its best tokens over both heads
    assert plans[1].keep.flatten()[best].all()


def test_the_floor_is_counted_beyond_the_prompts_window(two_scales):
    """The last tokens of a prompt (its question) are kept in every layer; a floor counting them
    would be used up by them at high ratios, and the quiet layer would keep none of its own."""
    inputs, quiet = two_scales
    window = UNIFORM // 4  # per head: twice the floor over both heads
    inputs = [dataclasses.replace(x, recent_tokens=window) for x in inputs]
    plans = GlobalBudgets(SnapKV(ratio=RATIO, n_sink=0)).plan_layers(inputs)
    floor, in_window = UNIFORM // 4, HEADS * window
    assert [int(p.keep.sum()) for p in plans] == [
        2 * UNIFORM - floor - in_window,
        floor + in_window,
    ]
    kept = plans[1].keep[0]
    assert kept[:, -window:].all()
    outside = quiet[0, :, :-window].flatten()
    best = outside.topk(floor).indices
    assert kept[:, :-window].flatten()[best].all()


def test_a_floor_and_a_window_never_take_more_than_the_layers_budget(two_scales):
    inputs, _ = two_scales
    window = TOKENS - int(TOKENS * RATIO)  # the window is the whole budget
    inputs = [dataclasses.replace(x, recent_tokens=window) for x in inputs]
    policy = GlobalBudgets(SnapKV(ratio=RATIO, n_sink=0))
    assert [p.keep[0, :, -window:].all() for p in policy.plan_layers(inputs)] == [True, True]
    assert kept_per_layer(policy, inputs) == [UNIFORM, UNIFORM]


def test_a_whole_floor_is_uniform_layer_budgets(two_scales):
    inputs, _ = two_scales
    policy = GlobalBudgets(SnapKV(ratio=RATIO, n_sink=0), layer_floor=1.0)
    assert kept_per_layer(policy, inputs) == [UNIFORM, UNIFORM]


def per_head_budget(ratio: float) -> int:
    return TOKENS - int(TOKENS * ratio)


@pytest.mark.parametrize("ratio", [0.5, RATIO])
def test_up_to_its_ratio_the_floor_cap_changes_nothing(two_scales, ratio):
    inputs, _ = two_scales
    scorer = SnapKV(ratio=ratio, n_sink=0)
    capped = GlobalBudgets(scorer, floor_max_ratio=RATIO).plan_layers(inputs)
    shrinking = GlobalBudgets(scorer, floor_max_ratio=1.0).plan_layers(inputs)
    assert all(torch.equal(a.keep, b.keep) for a, b in zip(capped, shrinking, strict=True))


def test_past_its_ratio_the_floor_stops_shrinking(two_scales):
    """At r = 0.9 the quiet layer keeps a quarter of what it would keep at r = 0.75 (its own
    best tokens), not a quarter of its budget at 0.9; the total stays uniform budgets' bytes."""
    inputs, quiet = two_scales
    scorer = SnapKV(ratio=0.9, n_sink=0)
    budget = HEADS * per_head_budget(0.9)
    floor = HEADS * per_head_budget(RATIO) // 4
    assert kept_per_layer(GlobalBudgets(scorer, floor_max_ratio=1.0), inputs) == [
        2 * budget - budget // 4,
        budget // 4,
    ]
    plans = GlobalBudgets(scorer, floor_max_ratio=RATIO).plan_layers(inputs)
    assert [int(p.keep.sum()) for p in plans] == [2 * budget - floor, floor]
    best = quiet.flatten().topk(floor).indices
    assert plans[1].keep.flatten()[best].all()


def test_a_capped_floor_never_takes_more_than_the_layers_budget(two_scales):
    inputs, _ = two_scales
    policy = GlobalBudgets(SnapKV(ratio=0.9, n_sink=0), layer_floor=1.0, floor_max_ratio=RATIO)
    budget = HEADS * per_head_budget(0.9)
    assert kept_per_layer(policy, inputs) == [budget, budget]


@pytest.mark.parametrize(
    "term, cap",
    [
        ("global-kvzip", 0.75),
        ("global-kvzip-plus", 0.75),
        ("global-span-kvzip", 0.75),
        ("global-kvzap", 1.0),
        ("global-span-kvzap", 1.0),
        ("global-snapkv", 1.0),
        ("global-kvzap/floor_max_ratio=0.75", 0.75),
        ("global-kvzip/floor_max_ratio=1", 1.0),
    ],
)
def test_the_floor_cap_is_the_scorers_unless_given(term, cap):
    """KVzip's layers score on scales far apart and ask for the floor kept past r = 0.75; the
    other scorers let it shrink, and a setting overrides either."""
    assert parse_policy(with_ratio(term, 0.9)).floor_max_ratio == cap


def test_the_floor_is_a_setting_of_the_policy_string():
    policy = parse_policy("global-snapkv:0.75/layer_floor=0.25")
    assert isinstance(policy, GlobalBudgets) and policy.layer_floor == 0.25
    with pytest.raises(ValueError, match=r"layer_floor in \[0, 1\]"):
        parse_policy("global-snapkv:0.75/layer_floor=2")
    assert parse_policy("global-snapkv:0.9/floor_max_ratio=1").floor_max_ratio == 1.0
    with pytest.raises(ValueError, match=r"floor_max_ratio in \[0, 1\]"):
        parse_policy("global-snapkv:0.9/floor_max_ratio=-0.5")


def test_stats_give_each_layers_kept_share():
    """A cache's stats say how a shared budget split between layers: the share of the tokens
    seen each layer's heads hold, counted from the kept positions themselves."""
    import kvpatch
    from kvpatch import CompressedDynamicCache, compat
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model(key_scale=4.0, num_hidden_layers=3)
    cache = CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, "global-snapkv:0.75/window=8"), torch.no_grad():
        model(random_prompt(200), use_cache=True, **{compat.cache_argument(model): cache})
        model(random_prompt(1), use_cache=True, **{compat.cache_argument(model): cache})
    stats = cache.stats()
    by_positions = [
        float(layer.kept.double().sum(-1).mean()) / layer.seen for layer in stats.layers
    ]
    assert stats.kept_shares == pytest.approx(by_positions)
    assert len(set(round(share, 3) for share in stats.kept_shares)) > 1  # budgets were shared
    # the same bytes as uniform budgets: 50 of 200 prefill tokens a head, plus the decoded one
    assert sum(stats.kept_shares) * 201 == pytest.approx(3 * (50 + 1))
