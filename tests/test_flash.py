"""flash_attention_2 on a compressed cache, against the masking oracle.

Every test runs twice: on the CPU with :mod:`flash_reference` standing in for flash-attn
(always), and with the real kernels on a CUDA GPU where flash-attn is installed (skipped
otherwise). Either way, transformers' own flash_attention_2 code runs: the 2-D padding mask, the
unpadding to varlen, bottom-right causal alignment, and kvpatch's fake keys in short heads.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import flash_reference
import pytest
import torch
from conftest import make_model, prompt
from helpers import generate, left_padded, run_oracle_generate
from oracle import evictions_of, greedy_logits, oracle_logits
from transformers import DynamicCache

import kvpatch
from kvpatch import CompressedDynamicCache, compat

HAS_FLASH_GPU = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@dataclass
class Flash:
    """Where the flash kernels run: the device, dtype and logit tolerance of the tests."""

    device: str
    dtype: torch.dtype
    atol: float

    def model(self, name: str = "llama") -> torch.nn.Module:
        model = make_model(name, "sdpa").to(self.device, self.dtype)
        compat.set_attention_implementation(model, "flash_attention_2")
        return model


@pytest.fixture(
    params=[
        "reference",
        pytest.param(
            "flash-attn",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not HAS_FLASH_GPU, reason="needs a CUDA GPU and flash-attn"),
            ],
        ),
    ]
)
def flash(request):
    if request.param == "flash-attn":
        yield Flash("cuda", torch.float16, 3e-2)
        return
    with flash_reference.installed():
        yield Flash("cpu", torch.float32, 1e-4)


def ids_on(flash: Flash, ids: torch.Tensor) -> torch.Tensor:
    return ids.to(flash.device)


@pytest.mark.parametrize(
    "policy",
    [
        "snapkv:0.5",
        "ada-snapkv:0.6",
        "think:0.5+ada-knorm:0.5",
        "think:0.5+think-v:0.25+ada-snapkv:0.5",
    ],
)
def test_flash_attention_matches_oracle(flash, policy):
    model = flash.model()
    ids = ids_on(flash, prompt(400))
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = greedy_logits(model, ids, cache, 10)
    if policy.startswith("ada-") or "+ada-" in policy:  # short heads: fake keys were written
        assert any(len(set(n.flatten().tolist())) > 1 for n in cache.physical_lengths())
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=flash.atol, rtol=0)


def test_flash_attention_ratio_zero_matches_unpatched(flash):
    model = flash.model()
    ids = ids_on(flash, prompt(300))
    reference, ref_tokens = greedy_logits(model, ids, DynamicCache(config=model.config), 10)
    with kvpatch.enabled(model, "think:0+ada-snapkv:0"):
        logits, tokens = greedy_logits(model, ids, CompressedDynamicCache(config=model.config), 10)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, reference, atol=flash.atol / 10, rtol=0)


@pytest.mark.parametrize("policy", ["snapkv:0.5", "ada-snapkv:0.6", "think:0.5+ada-knorm:0.5"])
def test_flash_padded_batch_matches_oracle(flash, policy):
    """Left padding: the prefill goes through varlen with each row's own length, and so does
    decoding while a row's full-width tail holds padding (the 24-token row under ThinK)."""
    model = flash.model()
    prompts = [prompt(n, seed=i)[0] for i, n in enumerate([300, 160, 24])]
    ids, mask = (ids_on(flash, t) for t in left_padded(prompts))
    with kvpatch.enabled(model, policy):
        tokens, logits, cache = generate(model, ids, mask, do_sample=False)
        for row, alone in enumerate(prompts):
            alone_tokens, _, _ = generate(model, ids_on(flash, alone[None]), do_sample=False)
            assert torch.equal(tokens[row], alone_tokens[0])
    expected, expected_logits, _ = run_oracle_generate(model, ids, cache, mask=mask)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, atol=flash.atol, rtol=0)


def test_flash_question_chunk_is_causal_from_the_bottom_right(flash):
    """A question read at once after a compressed context (fewer keys than positions): each of
    its queries sees the kept context and the question up to itself, as the oracle says."""
    model = flash.model()
    context, question = ids_on(flash, prompt(300)), ids_on(flash, prompt(8, seed=4))
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.6"):
        cache = kvpatch.prefill(model, context).copy_cache()
        logits, tokens = greedy_logits(model, question, cache, 5)
    fed = torch.cat([question, tokens], 1)
    expected = oracle_logits(model, context, evictions_of(cache), fed)
    torch.testing.assert_close(logits, expected[question.shape[1] :], atol=flash.atol, rtol=0)


@pytest.mark.parametrize("policy", ["kvzip:0.5", "think:0.5+global-kvzip:0.6", "keydiff:0.5"])
def test_flash_attention_question_agnostic_matches_oracle(flash, policy):
    """KVzip's reconstruction computes its own attention, so it runs under flash too."""
    from helpers import prefill_and_decode

    from kvpatch.tools.testing import byte_tokenizer

    model = flash.model()
    ids = ids_on(flash, prompt(400))
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = prefill_and_decode(model, ids, cache, steps=10)
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=flash.atol, rtol=0)


def test_flash_explicit_mask_fallback_matches_oracle(flash, monkeypatch):
    """Where no fake key can be guaranteed, flash (which takes no per-head mask) falls back to
    exact attention with the padding slots masked."""
    from kvpatch.attention import padded

    real = padded.fake_keys
    monkeypatch.setattr(
        padded, "fake_keys", lambda *a, **k: (real(*a, **k)[0], torch.zeros(1, dtype=bool))
    )
    model = flash.model()
    ids = ids_on(flash, prompt(300))
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = greedy_logits(model, ids, cache, 5)
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=flash.atol, rtol=0)


def test_the_flash_branch_calls_the_flash_functions():
    """The compressed path reaches the flash kernels (no silent fallback), as transformers
    dispatches them: a padded prefill unpads to varlen; decoding after it runs the dense kernel
    once compression has dropped the padding, and varlen while a full-width tail still holds some
    (ThinK's window is longer than the short row)."""
    calls = []

    def counted(name, function):
        @functools.wraps(function)  # transformers reads the signature for the kwargs it passes
        def wrapper(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)

        return wrapper

    flash = counted("dense", flash_reference.flash_attn_func)
    varlen = counted("varlen", flash_reference.flash_attn_varlen_func)
    seen = {}
    with compat.flash_functions(flash, varlen):
        model = make_model("llama", "sdpa")
        compat.set_attention_implementation(model, "flash_attention_2")
        ids, mask = left_padded([prompt(n, seed=n)[0] for n in (200, 12)])
        for policy in ("ada-snapkv:0.6", "think:0.5+snapkv:0.5"):
            with kvpatch.enabled(model, policy):
                calls.clear()
                generate(model, prompt(200), new_tokens=3, do_sample=False)
                seen[policy, "unpadded"] = list(calls)
                calls.clear()
                generate(model, ids, mask, new_tokens=3, do_sample=False)
                seen[policy, "padded"] = list(calls)
    per_layer = model.config.num_hidden_layers
    for policy in ("ada-snapkv:0.6", "think:0.5+snapkv:0.5"):
        assert seen[policy, "unpadded"] == ["dense"] * per_layer * 3  # prefill, two steps
    assert seen["ada-snapkv:0.6", "padded"] == ["varlen"] * per_layer + ["dense"] * per_layer * 2
    assert seen["think:0.5+snapkv:0.5", "padded"] == ["varlen"] * per_layer * 3


def test_flash_functions_are_restored():
    import transformers.modeling_flash_attention_utils as flash_utils

    before = flash_utils._flash_fn
    with flash_reference.installed():
        assert flash_utils._flash_fn is flash_reference.flash_attn_func
        with pytest.raises(RuntimeError, match="already installed"), flash_reference.installed():
            pass
    assert flash_utils._flash_fn is before
