"""A compressed layer's phases (kvpatch.cache.lifecycle): the phases real prefills, reconstructions,
appended turns, saved contexts and resets pass through, and the moves the lifecycle refuses."""

from __future__ import annotations

import pytest
import torch

import kvpatch
from kvpatch import CompressedDynamicCache, CompressedLayer, compat
from kvpatch.cache.lifecycle import MOVES, Lifecycle, LifecycleError, Phase
from kvpatch.tools.testing import byte_tokenizer, random_prompt, tiny_model

#: one token per byte, no chat template
BYTES = byte_tokenizer(chat_template=False)


@pytest.fixture(scope="module")
def model():
    return tiny_model(key_scale=4.0)


@pytest.fixture
def phases_seen(monkeypatch):
    """Every phase a layer is in when the model hands it keys (its ``update``), in order, once
    per run of equal phases."""
    seen: list[Phase] = []
    original = CompressedLayer.update

    def update(self, *args, **kwargs):
        if not seen or seen[-1] is not self.phase:
            seen.append(self.phase)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CompressedLayer, "update", update)
    return seen


def phases_of(cache) -> set[Phase]:
    return {layer.phase for layer in cache.compressed_layers}


def forward(model, ids, cache):
    with torch.no_grad():
        model(ids, use_cache=True, **{compat.cache_argument(model): cache})


def test_a_prefill_is_compressed_right_after_its_attention(model, phases_seen):
    cache = CompressedDynamicCache(config=model.config)
    assert phases_of(cache) == {Phase.EMPTY}
    with kvpatch.enabled(model, "snapkv:0.5"):
        forward(model, random_prompt(40), cache)
        assert phases_of(cache) == {Phase.COMPRESSED}
        forward(model, random_prompt(1, seed=2), cache)  # a decode step joins the tail
    assert phases_seen == [Phase.EMPTY, Phase.COMPRESSED]
    assert phases_of(cache) == {Phase.COMPRESSED}


def test_a_layer_without_a_policy_stays_dense(model):
    cache = CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model):  # no policy: the cache has none either
        forward(model, random_prompt(40), cache)
        forward(model, random_prompt(1, seed=2), cache)
    assert phases_of(cache) == {Phase.DENSE}
    assert all(layer.store is None for layer in cache.compressed_layers)


def test_shared_budgets_wait_for_every_layer_then_compress_on_the_next_step(model):
    cache = CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, "global-snapkv:0.5"):
        forward(model, random_prompt(40), cache)
        assert phases_of(cache) == {Phase.WAITING}
        forward(model, random_prompt(1, seed=2), cache)
    assert phases_of(cache) == {Phase.COMPRESSED}


def test_a_reconstruction_starts_from_waiting_and_returns_there(model, phases_seen):
    with kvpatch.enabled(model, "kvzip:0.5", tokenizer=BYTES):
        context = kvpatch.prefill(model, random_prompt(40))
    # the prefill, then the reconstruction's chunks (every layer), then compressed
    assert phases_seen == [Phase.EMPTY, Phase.RECONSTRUCTING]
    assert phases_of(context.cache) == {Phase.COMPRESSED}


def test_an_appended_turn_is_appended_then_reconstructed_then_compressed(model, phases_seen):
    with kvpatch.enabled(model, "kvzip:0.5", tokenizer=BYTES):
        context = kvpatch.prefill(model, random_prompt(40))
        phases_seen.clear()
        longer = context.extend(random_prompt(12, seed=3), tokenizer=BYTES)
    assert phases_seen == [Phase.APPENDING, Phase.RECONSTRUCTING]
    assert phases_of(longer.cache) == {Phase.COMPRESSED}
    assert phases_of(context.cache) == {Phase.COMPRESSED}  # the context itself is unchanged


def test_a_saved_context_is_loaded_compressed(model, tmp_path):
    with kvpatch.enabled(model, "snapkv:0.5"):
        kvpatch.prefill(model, random_prompt(40)).save(tmp_path / "context")
        loaded = kvpatch.load_context(model, tmp_path / "context")
    assert phases_of(loaded.cache) == {Phase.COMPRESSED}


def test_reset_returns_to_empty(model):
    cache = CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, "snapkv:0.5"):
        forward(model, random_prompt(40), cache)
    cache.reset()
    assert phases_of(cache) == {Phase.EMPTY}


def test_a_prefill_no_attention_compressed_is_refused_on_the_next_update(model):
    """A compressed cache run on a model kvpatch was not enabled on stays PREFILLED, and says so
    instead of decoding from a cache nobody compressed."""
    cache = CompressedDynamicCache(config=model.config, policy="snapkv:0.5")
    forward(model, random_prompt(40), cache)
    assert phases_of(cache) == {Phase.PREFILLED}
    with pytest.raises(RuntimeError, match=r"Call kvpatch\.enable"):
        forward(model, random_prompt(1, seed=2), cache)


def test_a_layer_cannot_append_or_end_a_reconstruction_before_it_is_compressed():
    layer = CompressedLayer()
    refused = pytest.raises(LifecycleError, match="'empty' cannot move to 'appending'")
    with refused, layer.appending():
        pass
    with pytest.raises(LifecycleError, match="'empty' is not reconstructing"):
        layer.end_reconstruction()
    assert layer.phase is Phase.EMPTY


@pytest.mark.parametrize("start", list(Phase))
def test_every_refused_move_names_the_phase_and_its_moves(start):
    for target in Phase:
        lifecycle = Lifecycle()
        lifecycle.phase = start
        if target is start or target in MOVES[start]:
            lifecycle.move(target)
            assert lifecycle.phase is target
            continue
        with pytest.raises(LifecycleError) as refused:
            lifecycle.move(target)
        assert f"{start.value!r} cannot move to {target.value!r}" in str(refused.value)
        assert all(allowed.value in str(refused.value) for allowed in MOVES[start])
        assert lifecycle.phase is start


def test_a_dense_layer_and_a_finished_turn_lead_nowhere_else():
    """The moves the docs draw: nothing leaves DENSE; APPENDING only returns to COMPRESSED; a
    reconstruction is left only by ending it, to where it began."""
    assert MOVES[Phase.DENSE] == MOVES[Phase.RECONSTRUCTING] == frozenset()
    assert MOVES[Phase.APPENDING] == frozenset({Phase.COMPRESSED})
    for origin in (Phase.WAITING, Phase.COMPRESSED):
        lifecycle = Lifecycle()
        lifecycle.phase = origin
        lifecycle.move(Phase.RECONSTRUCTING)
        lifecycle.end_reconstruction()
        assert lifecycle.phase is origin
