"""ThinK's value-channel pruning (``think-v``): its scores against a loop reference, the
three-term grammar, the oracle with pruned value channels, and the bytes it frees."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, prompt
from helpers import (
    PROMPT,
    SLACK,
    compressed_run,
    decode_against_schedule,
    generate,
    left_padded,
    run_oracle_generate,
)
from helpers import prefill as prefill_memory_prompt
from oracle import evictions_of, greedy_logits, oracle_logits
from transformers import DynamicCache

import kvpatch
from kvpatch import CompressedDynamicCache
from kvpatch.policies import AdaKV, Composed, LayerInputs, SnapKV, ThinK, ThinKValues
from kvpatch.tools.testing import seeded

B, HQ, HKV, D, DV = 2, 4, 2, 16, 12
G = HQ // HKV
PAD = 20
THREE_TERMS = "think:0.5+think-v:0.25+ada-snapkv:0.5"


def make_inputs(t: int, pad: int = 0, seed: int = 0) -> LayerInputs:
    """Random inputs with values narrower than keys; row 1 starts with ``pad`` padding tokens
    whose values are huge (they would dominate any score that counted them)."""
    gen = seeded(seed)
    q, k = (torch.randn(B, h, t, D, generator=gen) for h in (HQ, HKV))
    v = torch.randn(B, HKV, t, DV, generator=gen) * torch.linspace(0.2, 3, DV)
    valid = torch.ones(B, t, dtype=torch.bool)
    valid[1, :pad] = False
    v[1, :, :pad] *= 100
    return LayerInputs(q, k, v, valid, scaling=D**-0.5)


def reference_value_channels(x: LayerInputs, ratio: float, window: int = 32) -> torch.Tensor:
    """Per (row, KV head): the top channels of || softmax(Q_obs K^T / sqrt(D)) V[:, j] ||, the
    window's queries of every head of the group, each attending causally to the real tokens."""
    t = x.keys.shape[2]
    kept = DV - math.floor(DV * ratio)
    out = torch.zeros(B, HKV, kept, dtype=torch.long)
    for b in range(B):
        real = x.valid[b].nonzero().flatten().tolist()
        for h in range(HKV):
            energy = torch.zeros(DV, dtype=torch.float64)
            for head in range(h * G, (h + 1) * G):
                for i in range(t - window, t):
                    seen = [j for j in real if j <= i]
                    if not seen:
                        continue
                    logits = x.keys[b, h, seen].double() @ x.queries[b, head, i].double()
                    weights = (logits * x.scaling).softmax(0)
                    energy += (weights @ x.values[b, h, seen].double()) ** 2
            out[b, h] = energy.topk(kept).indices.sort().values
    return out


@pytest.mark.parametrize("pad", [0, PAD, 90])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_think_values_match_reference(ratio, pad):
    """Value channels by attention-output energy; every real token kept; key channels all kept;
    the last 32 tokens at full width. ``pad=90`` leaves row 1 with padding queries in its window."""
    x = make_inputs(100, pad=pad)
    plan = ThinKValues(ratio=ratio).plan(x)
    assert torch.equal(plan.value_channels, reference_value_channels(x, ratio))
    assert plan.channels is None
    assert plan.full_width_from == 100 - 32
    assert torch.equal(plan.keep, x.valid[:, None, :].expand(B, HKV, 100))
    assert ThinKValues(ratio=0.0).plan(x).value_channels is None


def test_three_terms_compose():
    policy = kvpatch.parse_policy(THREE_TERMS)
    assert policy == Composed(
        channels=ThinK(ratio=0.5),
        tokens=AdaKV(SnapKV(ratio=0.5)),
        value_channels=ThinKValues(ratio=0.25),
    )
    assert policy.name == THREE_TERMS.replace(":0.5", "").replace(":0.25", "")
    assert policy.ratio == pytest.approx(1 - 0.5 * (0.5 + 0.75) / 2)
    # any order, and by adding objects
    assert kvpatch.parse_policy("ada-snapkv:0.5+think-v:0.25+think:0.5") == policy
    assert ThinK(ratio=0.5) + ThinKValues(ratio=0.25) + AdaKV(SnapKV(ratio=0.5)) == policy
    assert kvpatch.parse_policy("think-v+snapkv").channels is None


def test_three_term_plan_has_each_parts_choice():
    """Key channels are ThinK's, value channels ThinK-V's, tokens the scorer's, and the longer
    full-width window of the two selectors is kept whole by every head."""
    x = make_inputs(200)
    policy = Composed(
        channels=ThinK(ratio=0.5, window=16),
        tokens=SnapKV(ratio=0.6),
        value_channels=ThinKValues(ratio=0.5, window=48),
    )
    plan = policy.plan(x)
    assert torch.equal(plan.channels, ThinK(ratio=0.5, window=16).plan(x).channels)
    assert torch.equal(
        plan.value_channels, ThinKValues(ratio=0.5, window=48).plan(x).value_channels
    )
    assert plan.full_width_from == 200 - 48
    assert plan.keep[..., 200 - 48 :].all()
    assert (plan.keep.sum(-1) == 200 - math.floor(200 * 0.6)).all()


ORACLE_POLICIES = ["think-v:0.5", "think-v:0.25+snapkv:0.5", "think+think-v", THREE_TERMS]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", ORACLE_POLICIES)
def test_value_pruning_matches_oracle(policy, attn):
    model = make_model("llama", attn)
    ids = prompt(400)
    logits, tokens, cache = compressed_run(model, policy, ids)
    evictions = evictions_of(cache)
    assert all(e.value_channel_keep is not None for e in evictions.values())
    expected = oracle_logits(model, ids, evictions, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    # the pruned channels matter: the full cache answers otherwise
    full = oracle_logits(model, ids, {}, tokens)
    assert (logits[1:] - full[1:]).abs().max() > 1e-3


def test_ratio_zero_is_exact():
    model = make_model("llama")
    ids = prompt(100)
    reference, ref_tokens = greedy_logits(model, ids, DynamicCache(config=model.config), 10)
    logits, tokens, _ = compressed_run(model, "think:0+think-v:0+ada-snapkv:0", ids)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_padded_batch_with_beams_matches_oracle():
    """Left padding (a row shorter than the window) and beam search, whose reordering moves the
    value channels with the rows."""
    model = make_model("llama")
    ids, mask = left_padded([prompt(n, seed=i)[0] for i, n in enumerate([300, 160, 24])])
    with kvpatch.enabled(model, THREE_TERMS):
        tokens, _, cache = generate(model, ids, mask, num_beams=3, do_sample=False)
    expected, _, _ = run_oracle_generate(model, ids, cache, mask=mask, num_beams=3, do_sample=False)
    assert torch.equal(tokens, expected)


def test_decode_budget_keeps_value_channels_while_decoding():
    """Tokens moved out of the full-width window while decoding lose the pruned value channels,
    as the oracle with each step's evictions says; the layer stays within its budget."""
    model = make_model("llama")
    logits, fed, schedule, _, most = decode_against_schedule(
        model, prompt(200), "think-v:0.5+knorm:0.5", budget=80, interval=16, steps=60
    )
    assert most <= 80 + 16
    expected = oracle_logits(model, prompt(200), {}, fed, schedule=schedule)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_compress_once_ask_many_matches_oracle():
    model = make_model("llama")
    context, question = prompt(300), prompt(8, seed=4)
    with kvpatch.enabled(model, THREE_TERMS):
        cache = kvpatch.prefill(model, context).copy_cache()
        logits, tokens = greedy_logits(model, question, cache, 5)
    expected = oracle_logits(model, context, evictions_of(cache), torch.cat([question, tokens], 1))
    torch.testing.assert_close(logits, expected[question.shape[1] :], atol=1e-4, rtol=0)


def packed_bytes(cache) -> tuple[int, int]:
    """Bytes of the keys and of the values the compressed layers hold (packed and tail)."""
    keys = values = 0
    for layer in cache.layers:
        store = layer.store
        tail_keys, tail_values = store.tail()
        packed = store.packed
        keys += tail_keys.nbytes + (packed.keys.nbytes if packed.keys is not None else 0)
        values += tail_values.nbytes + (packed.values.nbytes if packed.values is not None else 0)
    return keys, values


def expected_share(token_ratio: float, channel_ratio: float, window: int, width: int) -> float:
    """Share of a full cache's keys (or values) held: the kept tokens, those before the
    full-width window at ``1 - channel_ratio`` of the channels."""
    kept = PROMPT - math.floor(PROMPT * token_ratio)
    channels = (width - math.floor(width * channel_ratio)) / width
    return ((kept - window) * channels + window) / PROMPT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "policy, ratios",
    [
        ("think-v:0.5", (0, 0, 0.5)),
        ("think-v:0.25+snapkv:0.5", (0.5, 0, 0.25)),
        (THREE_TERMS, (0.5, 0.5, 0.25)),
    ],
)
def test_bytes_of_keys_and_values(policy, ratios, dtype):
    """After a 1,024-token prefill, keys at ``(1 - r_keys)`` and values at ``(1 - r_values)``
    of their channels, times the kept tokens (ThinK's window at full width), within 2% of a full
    cache's; every byte held (indices and records too) within 2% of their mean."""
    token_ratio, key_ratio, value_ratio = ratios
    model = make_model("llama").to(dtype)
    full = prefill_memory_prompt(model, DynamicCache(config=model.config))
    full_keys = sum(layer.keys.nbytes for layer in full.layers)
    with kvpatch.enabled(model, policy):
        cache = prefill_memory_prompt(model, CompressedDynamicCache(config=model.config))
    keys, values = packed_bytes(cache)
    d = model.config.head_dim
    key_share = expected_share(token_ratio, key_ratio, 32, d)  # every term here has a window
    value_share = expected_share(token_ratio, value_ratio, 32, d)
    assert keys / full_keys == pytest.approx(key_share, abs=SLACK)
    assert values / full_keys == pytest.approx(value_share, abs=SLACK)
    held = cache.nbytes() / (2 * full_keys)
    assert held == pytest.approx((key_share + value_share) / 2, abs=SLACK)
    assert cache.get_seq_length() == PROMPT
