"""Quantized storage: KIVI-style integer codes of the kept tokens, composing with every policy."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, prompt
from helpers import generate, left_padded
from helpers import prefill as prefill_memory_prompt
from oracle import greedy_logits

import kvpatch
from kvpatch import CompressedDynamicCache
from kvpatch.cache.quantized import quantize_per_channel, quantize_per_token
from kvpatch.tools.testing import seeded


def reference_decode(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric min-max quantization of all of ``x`` (one range), decoded."""
    low, high = x.min(), x.max()
    scale = max(float(high - low) / (2**bits - 1), torch.finfo(torch.float32).tiny)
    return ((x - low) / scale).round().clamp(0, 2**bits - 1) * scale + low


def outlying(shape, seed=0) -> torch.Tensor:
    """Random rows with a few outlier channels and tokens, as keys and values have."""
    x = torch.randn(*shape, generator=seeded(seed))
    x[:, 3] *= 20
    x[::7] *= 5
    return x


@pytest.mark.parametrize("bits", [8, 4])
def test_values_are_quantized_per_token(bits):
    rows = outlying((40, 23))
    decoded = quantize_per_token(rows, bits).dequantize(torch.tensor([[40]]))
    expected = torch.stack([reference_decode(row, bits) for row in rows])
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_are_quantized_per_channel_in_groups_of_each_head(bits):
    lengths = torch.tensor([[5, 70], [0, 33]])
    rows = outlying((int(lengths.sum()), 23))
    decoded = quantize_per_channel(rows, lengths, bits, group=32).dequantize(lengths)
    expected, start = torch.empty_like(rows), 0
    for count in lengths.flatten().tolist():
        for first in range(start, start + count, 32):
            last = min(first + 32, start + count)
            for channel in range(rows.shape[1]):
                expected[first:last, channel] = reference_decode(rows[first:last, channel], bits)
        start += count
    # a GPU's fused multiply-adds round the reference's scale arithmetic differently
    tolerance = 1e-5 if rows.device.type == "cpu" else 3e-5
    torch.testing.assert_close(decoded, expected, atol=tolerance, rtol=tolerance)


def test_four_bit_codes_share_a_byte():
    rows = outlying((10, 23))
    assert quantize_per_token(rows, 4).codes.shape == (10, 12)
    assert quantize_per_token(rows, 8).codes.shape == (10, 23)


QUANTIZED_POLICIES = ["snapkv:0", "ada-snapkv:0.5", "think:0.5+snapkv:0.5", "think-v:0.5+knorm:0.5"]


@pytest.mark.parametrize("policy", QUANTIZED_POLICIES)
def test_quantized_cache_decodes_close_to_the_unquantized_one(policy):
    """At 8 bits the greedy tokens are the unquantized cache's and the logits within 2e-2 (their
    spread is about 1); at 4 bits, fed the same tokens, within 0.2."""
    model = make_model("llama")
    ids = prompt(400)
    with kvpatch.enabled(model, policy):
        full, tokens = greedy_logits(model, ids, CompressedDynamicCache(config=model.config), 10)
        int8 = CompressedDynamicCache(config=model.config, quantize="int8")
        logits, int8_tokens = greedy_logits(model, ids, int8, 10)
        int4 = CompressedDynamicCache(config=model.config, quantize="int4")
        int4_logits, _ = greedy_logits(model, ids, int4, 10, tokens=tokens)
    assert all(
        layer.packed.is_quantized for layer in int8.compressed_layers + int4.compressed_layers
    )
    assert torch.equal(int8_tokens, tokens)
    assert (logits - full).abs().max() < 2e-2
    assert (int4_logits - full).abs().max() < 0.2


def test_ratio_zero_int8_is_close_to_the_unpatched_model():
    from transformers import DynamicCache

    model = make_model("llama")
    ids = prompt(300)
    reference, tokens = greedy_logits(model, ids, DynamicCache(config=model.config), 10)
    with kvpatch.enabled(model, "snapkv:0"):
        cache = CompressedDynamicCache(config=model.config, quantize="int8")
        logits, quantized_tokens = greedy_logits(model, ids, cache, 10)
    assert torch.equal(quantized_tokens, tokens)
    assert (logits - reference).abs().max() < 2e-2


def expected_bytes(model, policy_ratio, channel_ratio, bits, dtype_bytes, residual):
    """The quantization formula: kept tokens at ``bits`` per channel, their scales and offsets
    in the model's dtype, and the residual window at full precision, for every layer."""
    group = kvpatch.Quantization(bits).key_group
    config = model.config
    n, heads, dim = 1024, config.num_key_value_heads, config.head_dim
    kept = n - math.floor(n * policy_ratio)
    quantized = kept - residual
    key_channels = dim - math.floor(dim * channel_ratio)
    codes = quantized * (key_channels + dim) * bits / 8
    key_scales = 2 * math.ceil(quantized / group) * key_channels * dtype_bytes
    value_scales = 2 * quantized * dtype_bytes
    full_precision = residual * 2 * dim * dtype_bytes
    per_head = codes + key_scales + value_scales + full_precision
    return per_head * heads * config.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "policy, ratios, residual",
    [("snapkv:0.5", (0.5, 0), None), ("think:0.5+snapkv:0.5", (0.5, 0.5), 32)],
)
def test_bytes_follow_the_formula(policy, ratios, residual, bits, dtype):
    """After a 1,024-token prefill, within 3% of (1 - r) x full x bits / (8 x dtype bytes) +
    scales, the residual window at full precision (SnapKV's newest tokens, which every head
    keeps, up to the quantization's residual; ThinK's 32-token window)."""
    model = make_model("llama").to(dtype)
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config, quantize=f"int{bits}")
        cache = prefill_memory_prompt(model, cache)
    tails = {layer.store.tail_length for layer in cache.compressed_layers}
    if residual is None:  # SnapKV's window, and any newer tokens every head keeps
        residual, most = min(tails), kvpatch.Quantization(bits).residual
        assert min(64, most) <= residual <= most and len(tails) == 1
    assert tails == {residual}
    dtype_bytes = torch.finfo(dtype).bits // 8
    expected = expected_bytes(model, *ratios, bits, dtype_bytes, residual)
    assert cache.nbytes() == pytest.approx(expected, rel=0.03)


def test_padded_batch_with_beams_matches_unquantized_tokens():
    """Beam search reorders quantized rows (codes and per-head scales) with their batch rows."""
    model = make_model("llama")
    ids, mask = left_padded([prompt(n, seed=i)[0] for i, n in enumerate([300, 160, 24])])
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        expected, _, _ = generate(model, ids, mask, num_beams=2, do_sample=False)
        cache = CompressedDynamicCache(config=model.config, quantize="int8")
        tokens, _, _ = generate(model, ids, mask, cache=cache, num_beams=2, do_sample=False)
    assert torch.equal(tokens, expected)


def test_a_decode_budget_quantizes_what_leaves_the_tail():
    model = make_model("llama")
    budget, interval = 80, 16
    with kvpatch.enabled(model, "knorm:0.5"):
        cache = CompressedDynamicCache(
            config=model.config, decode_budget=budget, decode_interval=interval, quantize="int4"
        )
        generate(model, prompt(200), new_tokens=60, cache=cache, do_sample=False)
    for layer in cache.compressed_layers:
        assert layer.packed.is_quantized
        assert int(layer.physical_lengths().max()) <= budget + interval
        assert layer.store.tail_length <= interval + cache.quantization.residual


def test_compress_once_ask_many_keeps_the_context_quantized():
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.5"):
        context = kvpatch.prefill(model, prompt(300), quantize="int8")
        unquantized = kvpatch.prefill(model, prompt(300))
        question = prompt(8, seed=4)
        logits, _ = greedy_logits(model, question, context.copy_cache(), 5)
        expected, _ = greedy_logits(model, question, unquantized.copy_cache(), 5)
    assert context.cache.nbytes() < 0.5 * unquantized.cache.nbytes()
    assert (logits - expected).abs().max() < 2e-2


BASE_POLICIES = [n for n in kvpatch.policy_names() if "-" not in n or n == "expected-attention"]


@pytest.mark.parametrize(
    "policy",
    [f"{n}:0.5" for n in BASE_POLICIES] + ["ada-kvzip:0.5", "global-knorm:0.5", "pyramid-tova:0.5"],
)
def test_every_policy_composes_with_int4(policy):
    """Each policy, uniform, head-wise, global or pyramid, compresses into int4 storage, holds
    less than its unquantized cache, and answers a question close to it."""
    from kvpatch.tools.testing import byte_tokenizer

    model = make_model("llama")
    context, question = prompt(1000), prompt(6, seed=4)  # 500 kept: 128 of them the residual
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        quantized = kvpatch.prefill(model, context, quantize="int4")
        plain = kvpatch.prefill(model, context)
        expected, fed = greedy_logits(model, question, plain.copy_cache(), 3)
        # the same tokens fed to both: a near tie broken the other way cannot fork the paths
        logits, _ = greedy_logits(model, question, quantized.copy_cache(), 3, tokens=fed)
    assert all(layer.packed.is_quantized for layer in quantized.cache.compressed_layers)
    assert quantized.cache.nbytes() < 0.6 * plain.cache.nbytes()
    assert (logits - expected).abs().max() < 0.3


@pytest.mark.parametrize("length", [2, 20, 130])
def test_prompts_within_the_residual_leave_nothing_to_quantize(length):
    """A prompt the residual covers (or nearly) quantizes no token, or a few; decoding with beams
    still gives the unquantized cache's tokens."""
    model = make_model("llama")
    ids = prompt(length, batch=2)
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        expected, _, _ = generate(model, ids, num_beams=2, do_sample=False)
        cache = CompressedDynamicCache(config=model.config, quantize="int4")
        tokens, _, _ = generate(model, ids, cache=cache, num_beams=2, do_sample=False)
    assert torch.equal(tokens, expected)
