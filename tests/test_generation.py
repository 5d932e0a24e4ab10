"""All of generate() on a compressed cache: padded batches, sampling, beams, assisted decoding,
compress-once-ask-many, multi-turn reuse and decoding-time compression."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from helpers import (
    GENERATION_MODES,
    decode_against_schedule,
    generate,
    held_per_head,
    left_padded,
    run_oracle_generate,
)
from oracle import ORACLE, evictions_of, greedy_logits, oracle_logits
from transformers import DynamicCache

import kvpatch
from kvpatch import CompressedDynamicCache, compat

POLICIES = [
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
    "think:0.5+ada-knorm:0.6",
]
LENGTHS = [300, 220, 160, 90]


@pytest.mark.parametrize("policy", POLICIES)
def test_padded_batch_equals_each_prompt_alone(policy):
    attn = "eager" if policy in ("ada-snapkv", "think+snapkv") else "sdpa"
    model = make_model("llama", attn)
    prompts = [prompt(n, seed=i)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(prompts)
    with kvpatch.enabled(model, policy):
        tokens, logits, cache = generate(model, ids, mask, do_sample=False)
        lengths = cache.physical_lengths()[0]
        for row, p in enumerate(prompts):
            alone_tokens, alone_logits, alone = generate(model, p[None], do_sample=False)
            assert torch.equal(tokens[row], alone_tokens[0])
            # a GPU's kernels depend on the batch's shape: same tokens, logits close
            tolerance = 1e-4 if ids.device.type == "cpu" else 5e-3
            torch.testing.assert_close(logits[row], alone_logits[0], atol=tolerance, rtol=0)
            # each row keeps a budget of its own real length, padding never kept
            assert torch.equal(lengths[row], alone.physical_lengths()[0][0])


@GENERATION_MODES
def test_generation_modes_match_oracle(settings):
    model = make_model("llama")
    ids = prompt(300)
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.6"):
        torch.manual_seed(7)
        tokens, _, cache = generate(model, ids, **settings)
    assert isinstance(cache, CompressedDynamicCache)
    assert any(len(set(n.flatten().tolist())) > 1 for n in cache.physical_lengths())
    torch.manual_seed(7)
    expected, _, _ = run_oracle_generate(model, ids, cache, **settings)
    assert torch.equal(tokens, expected)


def test_sampling_is_reproducible():
    model = make_model("llama")
    ids = prompt(200)
    with kvpatch.enabled(model, "ada-snapkv"):
        runs = []
        for _ in range(2):
            torch.manual_seed(3)
            runs.append(generate(model, ids, do_sample=True, new_tokens=12)[0])
    assert torch.equal(runs[0], runs[1])


def test_assisted_decoding_equals_greedy():
    """Assisted decoding verifies chunks and crops rejected tokens; greedy output is unchanged."""
    model = make_model("llama")
    assistant = make_model("llama", seed=5)
    ids = prompt(250)
    with kvpatch.enabled(model, "think+ada-knorm"):
        greedy, _, _ = generate(model, ids, do_sample=False, new_tokens=12)
        assisted = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=assistant,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )[:, ids.shape[1] :]
    assert torch.equal(assisted, greedy)


def test_chunk_after_compression_is_causal():
    """A chunk of tokens appended at once gives the logits of appending them one by one."""
    model = make_model("llama")
    ids, chunk = prompt(300), prompt(7, seed=9)
    name = compat.cache_argument(model)
    with kvpatch.enabled(model, "ada-snapkv:0.6"), torch.no_grad():
        one_by_one = CompressedDynamicCache(config=model.config)
        model(ids, **{name: one_by_one})
        steps = [model(chunk[:, i : i + 1], **{name: one_by_one}).logits for i in range(7)]
        at_once = CompressedDynamicCache(config=model.config)
        model(ids, **{name: at_once})
        logits = model(chunk, **{name: at_once}).logits
    torch.testing.assert_close(logits, torch.cat(steps, 1), atol=1e-4, rtol=0)


def count_context_forwards(model, context_length):
    calls = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(
            (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]
        ),
        with_kwargs=True,
    )
    return calls, hook


def test_compress_once_ask_many():
    model = make_model("llama")
    context = prompt(400)
    questions = [prompt(n, seed=20 + n) for n in (5, 9, 6)]
    with kvpatch.enabled(model, "think+ada-snapkv:0.75"):
        calls, hook = count_context_forwards(model, 400)
        shared = kvpatch.prefill(model, context)
        answers = [shared.generate(q, max_new_tokens=6, do_sample=False) for q in questions]
        hook.remove()
        assert sum(n >= 400 for n in calls) == 1, "the context is prefilled once"
        for question, answer in zip(questions, answers, strict=True):
            fresh = kvpatch.prefill(model, context)  # the same compression, from scratch
            assert torch.equal(answer, fresh.generate(question, max_new_tokens=6, do_sample=False))
    # asking did not touch the shared cache
    assert shared.cache.get_seq_length() == 400


def test_compress_once_ask_many_matches_oracle():
    model = make_model("llama")
    context, question = prompt(300), prompt(8, seed=4)
    with kvpatch.enabled(model, "knorm:0.6"):
        shared = kvpatch.prefill(model, context)
        cache = shared.copy_cache()
        logits, tokens = greedy_logits(model, question, cache, 5)
    # the oracle prefills the context alone, then reads the question token by token
    fed = torch.cat([question, tokens], 1)
    expected = oracle_logits(model, context, evictions_of(cache), fed)
    torch.testing.assert_close(logits, expected[question.shape[1] :], atol=1e-4, rtol=0)


def test_multi_turn_cache_reuse_matches_oracle():
    model = make_model("llama")
    first = prompt(300)
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        cache = CompressedDynamicCache(config=model.config)
        turn1, _, _ = generate(model, first, cache=cache, do_sample=False)
        user = prompt(6, seed=11)
        second = torch.cat([first, turn1, user], 1)
        turn2, logits2, _ = generate(model, second, cache=cache, do_sample=False)
    # the oracle prefills the first prompt, then reads everything after it token by token
    fed = torch.cat([turn1, user, turn2], 1)
    expected = oracle_logits(model, first, evictions_of(cache), fed)
    start = turn1.shape[1] + user.shape[1]
    torch.testing.assert_close(logits2[0], expected[start : start + 8, 0], atol=1e-4, rtol=0)
    assert torch.equal(turn2[0], expected[start : start + 8, 0].argmax(-1))


def test_prefill_requires_enable():
    with pytest.raises(ValueError, match="enable"):
        kvpatch.prefill(make_model("llama"), prompt(10))


@pytest.mark.parametrize("policy", ["ada-snapkv:0.5", "think:0.5+knorm:0.5", "streamingllm"])
def test_decoding_time_compression_matches_oracle(policy):
    """Evictions change while decoding; every step matches the oracle with that step's evictions."""
    model = make_model("llama")
    ids = prompt(200)
    budget, interval = 80, 16
    logits, fed, schedule, _, most = decode_against_schedule(
        model, ids, policy, budget, interval, steps=60
    )
    assert most <= budget + interval
    expected = oracle_logits(model, ids, {}, fed, schedule=schedule)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_tova_as_published_evicts_one_token_a_step_at_constant_memory():
    """TOVA with a fixed budget: from the first decoding step on, each step drops the token the
    newest query (averaged over heads) attends to least. Every step matches the oracle with that
    step's evictions, over 200 steps, and the bytes allocated stop growing at the budget."""
    model = make_model("llama", "eager")
    ids = prompt(150)
    budget = 128
    logits, fed, schedule, held_bytes, most = decode_against_schedule(
        model, ids, "tova:0", budget, interval=1, steps=200
    )
    assert most <= budget + 1
    expected = oracle_logits(model, ids, {}, fed, schedule=schedule)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert max(held_bytes[100:]) == max(held_bytes[1:100])
    config = model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    assert max(held_bytes) <= 1.05 * (budget + 1) * per_token  # keys, values and bookkeeping


def test_decoding_time_compression_bounds_a_long_generation():
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.5"):
        cache = CompressedDynamicCache(config=model.config, decode_budget=96, decode_interval=32)
        tokens, _, cache = generate(
            model, prompt(200), cache=cache, new_tokens=2000, do_sample=False
        )
    assert tokens.shape[1] == 2000 and cache.get_seq_length() == 200 + 1999
    assert max(held_per_head(cache)) <= 96 + 32


@GENERATION_MODES
def test_a_compressed_context_answers_with_beams_and_returned_sequences(settings):
    """The context's cache is repeated as generate repeats the question; the oracle, prefilled
    with the context and repeated alike, picks the same tokens."""
    from oracle import _evictions

    model = make_model("llama")
    context_ids, question = prompt(200), prompt(6, seed=5)
    common = dict(max_new_tokens=6, pad_token_id=0, **settings)
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.6"):
        context = kvpatch.prefill(model, context_ids)
        torch.manual_seed(7)
        tokens = context.generate(question, **common)
    expand = max(settings.get("num_beams", 1), settings.get("num_return_sequences", 1))
    name = compat.cache_argument(model)
    implementation = compat.attention_implementation(model)
    _evictions.update(evictions_of(context.cache))
    model.set_attn_implementation(ORACLE)
    try:
        oracle_cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(context_ids, use_cache=True, **{name: oracle_cache})
        oracle_cache.batch_repeat_interleave(expand)
        torch.manual_seed(7)
        ids = torch.cat([context_ids, question], dim=-1)
        expected = model.generate(ids, **common, **{name: oracle_cache})[:, ids.shape[1] :]
    finally:
        model.set_attn_implementation(implementation)
        _evictions.clear()
    assert torch.equal(tokens, expected)


def test_decode_budget_needs_a_token_policy():
    model = make_model("llama")
    with kvpatch.enabled(model, "think"), pytest.raises(ValueError, match="token policy"):
        cache = CompressedDynamicCache(config=model.config, decode_budget=32)
        greedy_logits(model, prompt(100), cache, 1)
    with kvpatch.enabled(model, "snapkv"), pytest.raises(ValueError, match="always keeps"):
        cache = CompressedDynamicCache(config=model.config, decode_budget=32)
        greedy_logits(model, prompt(100), cache, 1)
    with pytest.raises(ValueError, match="positive integer"):
        CompressedDynamicCache(decode_budget=0)


def test_batch_repeat_interleave_and_select_on_a_compressed_cache():
    """One compressed context repeated for two continuations equals two copies of it."""
    model = make_model("llama")
    name = compat.cache_argument(model)
    nxt = prompt(2, seed=3).T  # two different next tokens, one per row
    with kvpatch.enabled(model, "think+ada-knorm:0.6"), torch.no_grad():
        shared = kvpatch.prefill(model, prompt(200))
        both = shared.copy_cache()
        both.batch_repeat_interleave(2)
        logits = model(nxt, **{name: both}).logits
        alone = [model(nxt[i : i + 1], **{name: shared.copy_cache()}).logits for i in range(2)]
        torch.testing.assert_close(logits, torch.cat(alone), atol=1e-5, rtol=0)
        both.batch_select_indices(torch.tensor([1]))
        again = model(nxt[1:], **{name: both}).logits
    assert both.layers[0].physical_lengths().shape[0] == 1
    assert again.shape == (1, 1, logits.shape[-1])
