"""Decode steps that read packed storage in place (CPU, sdpa) compute what the padded view
computes, and what the oracle's masked full attention computes."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from helpers import generate, left_padded, run_oracle_generate
from oracle import evictions_of, greedy_logits, oracle_logits

import kvpatch
from kvpatch import CompressedDynamicCache
from kvpatch.attention import packed as packed_attention

PACKED_POLICIES = [
    "ada-snapkv:0.6",  # variable-length heads
    "think:0.5+snapkv:0.5",  # uniform heads, pruned key channels
    "think-v:0.5+ada-knorm:0.5",  # variable-length heads, pruned value channels
    "think:0.25+think-v:0.25+ada-snapkv:0.75",
]


def padded_only(monkeypatch) -> None:
    """Make every decode step use the padded view (fake keys), as on an accelerator."""
    monkeypatch.setattr(packed_attention, "DEVICES", ())


@pytest.mark.parametrize("policy", PACKED_POLICIES)
def test_packed_reading_matches_oracle(policy, attend_calls):
    model = make_model("llama")
    ids = prompt(400)
    cache = CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, policy):
        logits, tokens = greedy_logits(model, ids, cache, 10)
    # a layer whose heads all kept as many tokens is stored dense and read by the stock kernel
    packed = [layer for layer in cache.compressed_layers if layer.store.packed.keys is not None]
    assert packed
    assert len(attend_calls) == 10 * len(packed)
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_dense_storage_keeps_the_stock_kernel(attend_calls):
    """Uniform heads at full width are stored dense: the stock kernel reads them, no copy."""
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.5"):
        greedy_logits(model, prompt(200), CompressedDynamicCache(config=model.config), 4)
    assert attend_calls == []


@pytest.mark.parametrize("policy", ["ada-snapkv:0.6", "think-v:0.5+think:0.5+ada-knorm:0.5"])
def test_padded_batch_with_beams_equals_padded_view(policy, attend_calls, monkeypatch):
    """Left padding (a row shorter than the window, so the tail holds padding) and beams."""
    model = make_model("llama")
    ids, mask = left_padded([prompt(n, seed=i)[0] for i, n in enumerate([300, 160, 24])])
    with kvpatch.enabled(model, policy):
        tokens, logits, cache = generate(model, ids, mask, num_beams=3, do_sample=False)
        assert attend_calls
        padded_only(monkeypatch)
        padded_tokens, padded_logits, _ = generate(model, ids, mask, num_beams=3, do_sample=False)
    assert torch.equal(tokens, padded_tokens)
    torch.testing.assert_close(logits, padded_logits, atol=1e-4, rtol=0)
    expected, _, _ = run_oracle_generate(model, ids, cache, mask=mask, num_beams=3, do_sample=False)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("policy", PACKED_POLICIES)
def test_question_chunk_after_compressed_context(policy, attend_calls):
    """A multi-token question over a compressed context: causal among its own tokens."""
    model = make_model("llama")
    context, question = prompt(300), prompt(8, seed=4)
    with kvpatch.enabled(model, policy):
        cache = kvpatch.prefill(model, context).copy_cache()
        logits, tokens = greedy_logits(model, question, cache, 5)
    assert attend_calls
    expected = oracle_logits(model, context, evictions_of(cache), torch.cat([question, tokens], 1))
    torch.testing.assert_close(logits, expected[question.shape[1] :], atol=1e-4, rtol=0)


def test_bfloat16_is_as_close_as_the_padded_view(monkeypatch):
    """In bf16, packed reading (eager's numerics) stays as close to fp32 as the padded view."""
    policy, ids = "think:0.5+ada-snapkv:0.6", prompt(300)
    model = make_model("llama")
    with kvpatch.enabled(model, policy):
        reference, tokens = greedy_logits(
            model, ids, CompressedDynamicCache(config=model.config), 6
        )
    model = model.to(torch.bfloat16)
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config)
        packed, _ = greedy_logits(model, ids, cache, 6, tokens=tokens)
        padded_only(monkeypatch)
        cache = CompressedDynamicCache(config=model.config)
        padded, _ = greedy_logits(model, ids, cache, 6, tokens=tokens)
    packed_error = (packed.float() - reference).abs().max()
    padded_error = (padded.float() - reference).abs().max()
    assert packed_error <= 1.5 * padded_error + 1e-2


def test_what_packed_reading_leaves_to_the_padded_view():
    model = make_model("llama")
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        cache = kvpatch.prefill(model, prompt(200)).copy_cache()
    store = cache.layers[0].store
    query = torch.zeros(1, 4, 1, 32)
    assert packed_attention.serves(store, query, {"dropout": 0.0, "scaling": 0.1})
    for kwargs in ({"softcap": 30.0}, {"dropout": 0.1}, {"s_aux": torch.zeros(4)}):
        assert not packed_attention.serves(store, query, kwargs)
    assert not packed_attention.serves(store, query.to("meta"), {})
