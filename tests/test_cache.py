"""Packed storage: what goes in comes out, per head, in order, with pruned channels as zeros."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from oracle import greedy_logits

import kvpatch
from kvpatch import CompressedDynamicCache
from kvpatch.cache.packed import PackedKV
from kvpatch.policies import Plan
from kvpatch.tools.testing import seeded


def random_plan(batch=3, heads=2, tokens=20, dim=8, kept_channels=None, full_width_from=None):
    generator = seeded(0)
    keys = torch.randn(batch, heads, tokens, dim, generator=generator)
    values = torch.randn(batch, heads, tokens, dim + 2, generator=generator)
    keep = torch.rand(batch, heads, tokens, generator=generator) < 0.5
    channels = None
    if kept_channels is not None:
        channels = torch.stack(
            [
                torch.randperm(dim, generator=generator)[:kept_channels].sort().values
                for _ in range(batch * heads)
            ]
        ).view(batch, heads, kept_channels)
    start = tokens if full_width_from is None else full_width_from
    return keys, values, Plan(keep=keep, channels=channels, full_width_from=start)


def expected_head(keys, values, plan, b, h):
    """One head's kept keys (pruned channels zeroed) and values, by plain indexing."""
    start = plan.full_width_from
    positions = [t for t in range(start) if plan.keep[b, h, t]]
    k = keys[b, h, positions].clone()
    if plan.channels is not None:
        pruned = [c for c in range(keys.shape[-1]) if c not in plan.channels[b, h].tolist()]
        k[:, pruned] = 0
    return k, values[b, h, positions]


# the padded layout is written with one slice copy per head, or one indexed copy for many heads
LAYOUTS = [pytest.param(64, id="slice-copies"), pytest.param(0, id="indexed-copy")]


@pytest.mark.parametrize("slice_copy_heads", LAYOUTS)
@pytest.mark.parametrize("kept_channels", [None, 5])
def test_dense_view_holds_each_heads_tokens_in_order(kept_channels, slice_copy_heads, monkeypatch):
    monkeypatch.setattr("kvpatch.cache.packed.SLICE_COPY_HEADS", slice_copy_heads)
    keys, values, plan = random_plan(kept_channels=kept_channels, full_width_from=15)
    packed = PackedKV.from_plan(keys, values, plan)
    # written into a wider, dirty buffer, as the cache does before appending its tail
    b, h, length = *packed.lengths.shape, packed.max_length
    dense_k = torch.full((b, h, length + 3, keys.shape[-1]), float("nan"))
    dense_v = torch.full((b, h, length + 3, values.shape[-1]), float("nan"))
    packed.write_into(dense_k, dense_v)
    assert dense_k[:, :, length:].isnan().all() and dense_v[:, :, length:].isnan().all()
    expected_padding = []
    for b in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            k, v = expected_head(keys, values, plan, b, h)
            n = len(k)
            assert packed.lengths[b, h] == n
            assert torch.equal(dense_k[b, h, :n], k) and torch.equal(dense_v[b, h, :n], v)
            assert (dense_k[b, h, n:length] == 0).all() and (dense_v[b, h, n:length] == 0).all()
            expected_padding += [[b, h, slot] for slot in range(n, length)]
    assert torch.stack(packed.padding_slots, dim=-1).tolist() == expected_padding


@pytest.mark.parametrize("kept_channels", [None, 5])
def test_heads_that_keep_nothing_give_an_empty_view(kept_channels):
    keys, values, plan = random_plan(kept_channels=kept_channels)
    plan.keep[:] = False
    dense_k, dense_v = PackedKV.from_plan(keys, values, plan).dense()
    assert dense_k.shape == (*keys.shape[:2], 0, keys.shape[-1])
    assert dense_v.shape == (*values.shape[:2], 0, values.shape[-1])


def test_storage_is_packed_without_padding():
    keys, values, plan = random_plan(kept_channels=5)
    packed = PackedKV.from_plan(keys, values, plan)
    kept = int(plan.keep.sum())
    assert packed.keys.shape == (kept, 5) and packed.values.shape == (kept, keys.shape[-1] + 2)


def test_select_rows_reorders_repeats_and_subsets():
    keys, values, plan = random_plan(kept_channels=5)
    packed = PackedKV.from_plan(keys, values, plan)
    rows = torch.tensor([2, 0, 0, 1])
    selected = packed.select_rows(rows).dense()
    rebuilt = PackedKV.from_plan(
        keys[rows], values[rows], Plan(plan.keep[rows], plan.channels[rows], plan.full_width_from)
    ).dense()
    width = selected[0].shape[2]
    assert torch.equal(selected[0], rebuilt[0][:, :, :width])
    assert torch.equal(selected[1], rebuilt[1][:, :, :width])


def compressed_cache(policy="think+ada-snapkv:0.6", length=300, steps=3, quantize=None):
    model = make_model("llama")
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config, quantize=quantize)
        greedy_logits(model, prompt(length), cache, steps)
    return cache


def test_lengths_logical_and_physical():
    cache = compressed_cache(length=300, steps=3)
    assert cache.get_seq_length() == 303
    layer = cache.layers[0]
    assert layer.get_mask_sizes(1) == (304, 0)
    physical = layer.physical_lengths()
    assert (physical < 303).all()
    for b, h in [(0, 0), (0, 1)]:
        positions = cache.stats().layers[0].kept_positions(b, h)
        assert len(positions) == physical[b, h]
        assert (positions.diff() > 0).all() and positions[-1] == 302


def test_crop_inside_the_tail_in_place_and_deeper_by_position():
    """A crop within the tail truncates it in place; a deeper one (a draft model's cache, fed its
    last accepted token again) keeps, of each head, what it held before the new end."""
    cache = compressed_cache(steps=3)
    layer = cache.layers[0]
    store, tail = layer.store, layer.store.tail_length
    cache.crop(-2)
    assert cache.get_seq_length() == 301 and layer.store is store
    assert layer.store.tail_length == tail - 2
    before = [cache.stats().layers[0].kept_positions(0, h) for h in range(2)]
    cache.crop(-(tail + 5))
    end = 301 - tail - 5
    assert cache.get_seq_length() == end and layer.store.tail_length == 0
    for head, kept in enumerate(before):
        assert torch.equal(cache.stats().layers[0].kept_positions(0, head), kept[kept < end])


def test_a_crop_into_a_quantized_caches_compressed_part_is_refused():
    cache = compressed_cache(policy="snapkv:0.6", quantize="int8")
    tail = cache.layers[0].store.tail_length
    with pytest.raises(ValueError, match=r"cannot crop .* quantized"):
        cache.crop(-(tail + 1))


def test_plan_that_keeps_everything_at_full_width():
    """A plan whose full-width window covers the whole prefill packs nothing and still works."""
    from kvpatch.policies import LayerInputs, TokenScorer

    class KeepAllFullWidth(TokenScorer):
        ratio = 0.0
        name = "all-full-width"
        keeps_everything = False  # its plan, which packs nothing, is what is tested

        def score(self, inputs: LayerInputs) -> torch.Tensor:
            return torch.zeros(inputs.keys.shape[:3])

        def plan(self, inputs, must_keep=None):
            plan = super().plan(inputs, must_keep)
            return Plan(plan.keep, None, full_width_from=0)

    model = make_model("llama")
    with kvpatch.enabled(model, KeepAllFullWidth()):
        cache = CompressedDynamicCache(config=model.config)
        logits, _ = greedy_logits(model, prompt(50), cache, 3)
    from transformers import DynamicCache

    reference, _ = greedy_logits(model, prompt(50), DynamicCache(config=model.config), 3)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    assert cache.layers[0].store.tail_start == 0 and cache.get_seq_length() == 53
