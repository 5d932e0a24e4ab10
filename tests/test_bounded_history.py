"""A history at constant memory (``max_kv_tokens``): each turn is kept whole, the older history
compressed back to the budget with the policy's scorer, so that a long chat holds constant
bytes with its newest turn intact."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from helpers import generate

import kvpatch
from kvpatch.tools.testing import random_prompt, save_tiny_checkpoint

BUDGET = 100


def turn(index: int) -> torch.Tensor:
    return prompt(6 + index % 5, seed=index)  # turns of 6 to 10 tokens


@pytest.mark.slow
def test_a_thousand_turns_hold_constant_bytes_with_the_newest_turn_whole():
    model = make_model("llama")
    held_bytes = []
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        context = kvpatch.prefill(model, prompt(20), max_kv_tokens=BUDGET)
        for index in range(1000):
            new = turn(index)
            context = context.extend(new)
            stats = context.cache.stats()
            for layer in stats.layers:
                assert float(layer.held.float().mean(-1).max()) <= BUDGET
                assert layer.kept[..., -new.shape[1] :].all()  # every head holds the new turn
            held_bytes.append((stats.kv_nbytes, stats.index_nbytes, stats.layers[0].seen))
    kv_bytes = [kv for kv, _, _ in held_bytes[100:]]  # once the budget is reached
    assert max(kv_bytes) == min(kv_bytes)
    first, last = held_bytes[100], held_bytes[-1]
    # the index grows by at most a bit per KV head for each token ever seen (the positions mask)
    heads = model.config.num_key_value_heads * model.config.num_hidden_layers
    assert last[1] - first[1] <= heads * (last[2] - first[2]) / 8 + 64


def test_under_the_budget_nothing_is_removed():
    """A conversation shorter than the budget answers exactly as the unpatched model given the
    whole conversation at once, though the policy's ratio is 0.5."""
    model = make_model("llama")
    turns = [prompt(30), turn(1), turn(2), turn(3)]
    whole = torch.cat(turns, dim=-1)
    expected = model(whole).logits[:, -1]
    with kvpatch.enabled(model, "keydiff:0.5"):
        context = kvpatch.prefill(model, turns[0], max_kv_tokens=BUDGET)
        for ids in turns[1:]:
            context = context.extend(ids)
    assert context.cache.stats().ratio == 0
    torch.testing.assert_close(context.logits[:, -1], expected, atol=1e-5, rtol=0)


def test_a_long_first_turn_is_cut_to_the_budget_and_decoding_continues():
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.5"):
        context = kvpatch.prefill(model, prompt(400), max_kv_tokens=BUDGET)
        held = context.cache.physical_lengths()
        assert all(int(h.max()) == BUDGET for h in held)  # not the ratio's 200
        tokens = context.generate(turn(0), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert tokens.shape == (1, 5)


def test_a_chat_session_within_a_budget(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = save_tiny_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    session = kvpatch.ChatSession(
        model, tokenizer, "keydiff:0.5", max_kv_tokens=60, max_new_tokens=3
    )
    for index in range(25):
        session.ask(f"turn {index} " + "x" * (index % 7))
        held = session.stats().layers[0].held
        assert float(held.float().mean(-1).max()) <= 60
    assert session.context.cache.max_kv_tokens == 60


@pytest.mark.parametrize(
    "policy, says",
    [("kvzip:0.5", "reconstructing"), ("think:0.5", "only prunes channels")],
)
def test_policies_that_cannot_bound_a_history_are_refused(policy, says):
    model = make_model("llama")
    with pytest.raises(ValueError, match=says):
        kvpatch.CompressedDynamicCache(config=model.config, policy=policy, max_kv_tokens=10)
    with pytest.raises(ValueError, match="integer >= 1"):
        kvpatch.CompressedDynamicCache(config=model.config, policy="snapkv", max_kv_tokens=0)


def test_the_budget_survives_saving(tmp_path):
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.5"):
        kvpatch.prefill(model, prompt(50), max_kv_tokens=BUDGET).save(tmp_path / "chat.kvz")
        loaded = kvpatch.load_context(model, tmp_path / "chat.kvz")
        for index in range(20):
            loaded = loaded.extend(turn(index))
    assert loaded.cache.max_kv_tokens == BUDGET
    assert all(float(h.float().mean(-1).max()) <= BUDGET for h in loaded.cache.physical_lengths())


def test_generate_with_a_bounded_cache_matches_a_plain_one_under_the_budget():
    model, ids = make_model("llama"), random_prompt(40)
    reference_tokens, reference_logits, _ = generate(model, ids, None, 6)
    cache = kvpatch.CompressedDynamicCache(config=model.config, max_kv_tokens=BUDGET)
    with kvpatch.enabled(model, "snapkv:0.5"):
        tokens, logits, _ = generate(model, ids, None, 6, cache=cache, do_sample=False)
    assert torch.equal(tokens, reference_tokens)
    torch.testing.assert_close(logits, reference_logits, atol=1e-5, rtol=0)
