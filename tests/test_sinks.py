"""Attention sinks: every token policy keeps the first real tokens of each row (``n_sink``, 4 by
default; 0 gives a paper's own behaviour), and a context that starts with the chat template's
preamble (system prompt, user header) keeps all of it."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_model, prompt
from helpers import left_padded

import kvpatch
from kvpatch.feed.reconstruction import system_prefix_length
from kvpatch.policies import SnapKV
from kvpatch.tools.testing import byte_tokenizer, tiny_model

TOKEN_POLICIES = [
    "snapkv:0.5",
    "ada-snapkv:0.5",
    "global-snapkv:0.5",
    "pyramid-snapkv:0.5",
    "span-snapkv:0.5",
    "tova:0.5",
    "knorm:0.5",
    "keydiff:0.5",
    "random:0.5",
    "streamingllm:0.5",
    "expected-attention:0.5",
    "kvzip:0.5",
    "ada-kvzip:0.5",
    "global-kvzip:0.5",
    "kvzip-plus:0.5",
    "think:0.5+snapkv:0.5",
    "think-v:0.25+ada-knorm:0.7",
]


def kept(cache, row: int = 0, pad: int = 0) -> list[set[int]]:
    """Positions held, per (layer, head), of batch row ``row`` (counted from its first real
    token, after ``pad`` padding columns)."""
    return [
        {p - pad for p in layer.kept_positions(row, head).tolist()}
        for layer in cache.stats().layers
        for head in range(layer.held.shape[1])
    ]


@pytest.mark.parametrize("policy", TOKEN_POLICIES)
def test_every_policy_keeps_the_first_tokens_of_a_short_context(policy):
    """93 tokens at ratio 0.5: SnapKV's 64-token window would be the whole budget; the first 4
    tokens of each padded row are kept anyway, in every layer and head."""
    model = make_model("llama")
    ids, mask = left_padded([prompt(93, seed=1)[0], prompt(70, seed=2)[0]])
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        context = kvpatch.prefill(model, ids, mask)
    for row, pad in enumerate([0, 93 - 70]):
        for positions in kept(context.cache, row, pad):
            assert {0, 1, 2, 3} <= positions
            assert len(positions) < 93


def test_no_sinks_is_the_published_behaviour():
    """``n_sink=0``: SnapKV keeps its window alone, and the first token goes."""
    model = make_model("llama")
    ids = prompt(93)
    with kvpatch.enabled(model, SnapKV(ratio=0.5, n_sink=0)):
        context = kvpatch.prefill(model, ids)
    for positions in kept(context.cache):
        assert positions == set(range(93 - 64, 93))
    with kvpatch.enabled(model, SnapKV(ratio=0.5)):
        context = kvpatch.prefill(model, ids)
    for positions in kept(context.cache):
        assert positions == set(range(4)) | set(range(93 - 64, 93))


def test_sinks_survive_decoding_time_compression():
    """A bounded cache re-scores what it holds: the sinks it kept at prefill stay."""
    model = make_model("llama")
    with kvpatch.enabled(model, "tova:0.5"):
        cache = kvpatch.CompressedDynamicCache(
            config=model.config, decode_budget=40, decode_interval=8
        )
        argument = {kvpatch.compat.cache_argument(model): cache}
        model.generate(prompt(60), max_new_tokens=50, do_sample=False, pad_token_id=0, **argument)
    for positions in kept(cache):
        assert {0, 1, 2, 3} <= positions
        assert len(positions) <= 48


def test_system_prefix_is_found_in_rendered_contexts_only():
    tokenizer = byte_tokenizer()
    preamble = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
    expected = len(tokenizer(preamble, add_special_tokens=False)["input_ids"])
    template = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n" + kvpatch.tools.testing.CHAT_TEMPLATE
    )
    tokenizer.chat_template = template
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "The code is 4711."}], tokenize=False
    )
    ids = tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids
    mask = torch.ones_like(ids)
    assert system_prefix_length(tokenizer, ids, mask) == expected
    plain = tokenizer("The code is 4711.", return_tensors="pt").input_ids
    assert system_prefix_length(tokenizer, plain, torch.ones_like(plain)) == 0
    assert system_prefix_length(None, ids, mask) == 0


@pytest.mark.parametrize("policy", ["snapkv:0.9", "knorm:0.9", "global-kvzip:0.9"])
def test_prefill_keeps_the_template_preamble(policy):
    """A context rendered with the chat template keeps its whole preamble in every head, even at
    ratio 0.9; the same text without the template keeps only the policy's 4 sinks."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = (
        "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n"
        + kvpatch.tools.testing.CHAT_TEMPLATE
    )
    document = "Lease of 12 May: the tenant is Ada, the rent 930 a month. " * 4
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": document}], tokenize=False
    )
    ids = tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids
    preamble = system_prefix_length(tokenizer, ids, torch.ones_like(ids))
    assert preamble > 30
    model = tiny_model("llama", key_scale=4.0, vocab_size=len(tokenizer))
    most_of_the_budget = pytest.warns(kvpatch.ShortContextWarning, match="preamble")
    with kvpatch.enabled(model, policy, tokenizer=tokenizer), most_of_the_budget:
        context = kvpatch.prefill(model, ids, tokenizer=tokenizer)
    for positions in kept(context.cache):
        assert set(range(preamble)) <= positions


def rendered_document(tokenizer, document: str) -> torch.Tensor:
    tokenizer.chat_template = (
        "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n"
        + kvpatch.tools.testing.CHAT_TEMPLATE
    )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": document}], tokenize=False
    )
    return tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids


def test_a_short_document_warns_when_the_preamble_fills_the_budget():
    """A note barely longer than the template's preamble, compressed at 0.75: the preamble takes
    most of the budget, and the warning says so with the numbers and a ratio that keeps more."""
    tokenizer = byte_tokenizer()
    ids = rendered_document(tokenizer, "Dana meets Ada on Thursday at 3 pm in room 204.")
    preamble = system_prefix_length(tokenizer, ids, torch.ones_like(ids))
    n = ids.shape[1]
    kept_at = n - int(n * 0.75)
    assert 2 * preamble > kept_at  # the case the warning is for
    model = tiny_model("llama", key_scale=4.0, vocab_size=len(tokenizer))
    with kvpatch.enabled(model, "knorm:0.75", tokenizer=tokenizer):
        said = rf"preamble \({preamble} tokens.*{n}-token context"
        with pytest.warns(kvpatch.ShortContextWarning, match=said):
            kvpatch.prefill(model, ids, tokenizer=tokenizer)
        with pytest.warns(kvpatch.ShortContextWarning, match="preamble"):
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    safe = 1 - 2 * preamble / n
    lower = f"knorm:{safe - 0.01:.2f}"
    with kvpatch.enabled(model, lower, tokenizer=tokenizer), warnings.catch_warnings():
        warnings.simplefilter("error")
        kvpatch.prefill(model, ids, tokenizer=tokenizer)


def test_no_warning_where_the_question_window_keeps_the_whole_prompt():
    """KVzip keeps a prompt's last 64 tokens when generate continues it: a short prompt is kept
    whole (preamble and window), so there is nothing to warn about; the same tokens compressed
    as a context keep no window, and warn."""
    tokenizer = byte_tokenizer()
    ids = rendered_document(tokenizer, "Dana meets Ada on Thursday.")
    preamble = system_prefix_length(tokenizer, ids, torch.ones_like(ids))
    assert preamble + 64 >= ids.shape[1] - 1  # generate prefills all but the last token
    model = tiny_model("llama", key_scale=4.0, vocab_size=len(tokenizer))
    with kvpatch.enabled(model, "kvzip:0.75", tokenizer=tokenizer):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        with pytest.warns(kvpatch.ShortContextWarning, match="preamble"):
            kvpatch.prefill(model, ids, tokenizer=tokenizer)


@pytest.mark.parametrize(
    "policy", ["knorm:0.75", "knorm:0", "keydiff:0.75/window=512", "think:0.5"]
)
def test_no_warning_where_the_context_keeps_enough_of_itself(policy):
    """A long document at 0.75, any document at ratio 0, a window that keeps the whole prompt,
    channel pruning alone: nothing to warn about."""
    tokenizer = byte_tokenizer()
    long = policy == "knorm:0.75"
    text = "Lease of 12 May: the tenant is Ada, the rent 930 a month. " * (12 if long else 1)
    ids = rendered_document(tokenizer, text)
    model = tiny_model("llama", key_scale=4.0, vocab_size=len(tokenizer))
    with kvpatch.enabled(model, policy, tokenizer=tokenizer), warnings.catch_warnings():
        warnings.simplefilter("error")
        kvpatch.prefill(model, ids, tokenizer=tokenizer)


def test_no_warning_under_a_budget_in_tokens():
    """``max_kv_tokens`` keeps each turn whole (a chat's history): the ratio sets no budget, so
    a short turn is no short context."""
    tokenizer = byte_tokenizer()
    ids = rendered_document(tokenizer, "Dana meets Ada on Thursday at 3 pm in room 204.")
    model = tiny_model("llama", key_scale=4.0, vocab_size=len(tokenizer))
    with kvpatch.enabled(model, "knorm:0.75", tokenizer=tokenizer), warnings.catch_warnings():
        warnings.simplefilter("error")
        context = kvpatch.prefill(model, ids, tokenizer=tokenizer, max_kv_tokens=512)
    assert all(len(positions) == ids.shape[1] for positions in kept(context.cache))
