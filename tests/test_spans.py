"""Span-keeping scorers against a loop reference, and their budgets."""

from __future__ import annotations

import math

import pytest
import torch

import kvpatch
from kvpatch.policies import (
    TOVA,
    AdaKV,
    GlobalBudgets,
    KVzip,
    LayerInputs,
    SnapKV,
    Spans,
    SpanSnapKV,
    SpanTOVA,
)
from kvpatch.policies.contract import spread_scores
from kvpatch.tools.testing import seeded


def reference_spread(scores, valid, after, before):
    """Loops: a real token's score is the max over real, unprotected neighbours in
    [i - after, i + before]; protected (+inf) tokens stay +inf and do not spread."""
    out = scores.clone().float()
    *lead, t = scores.shape
    flat_s, flat_v, flat_o = scores.reshape(-1, t), valid.reshape(-1, t), out.reshape(-1, t)
    for row in range(flat_s.shape[0]):
        for i in range(t):
            if math.isinf(flat_s[row, i]) and flat_s[row, i] > 0:
                continue
            window = [
                float(flat_s[row, j])
                for j in range(max(0, i - after), min(t, i + before + 1))
                if flat_v[row, j] and not (math.isinf(flat_s[row, j]) and flat_s[row, j] > 0)
            ]
            if window:
                flat_o[row, i] = max(window)
    return flat_o.view(*lead, t)


def layer_inputs(batch=2, kv_heads=2, group=2, tokens=48, dim=16, seed=0, padding=0):
    generator = seeded(seed)
    keys = torch.randn(batch, kv_heads, tokens, dim, generator=generator) * 2
    queries = torch.randn(batch, kv_heads * group, tokens, dim, generator=generator)
    valid = torch.ones(batch, tokens, dtype=torch.bool)
    valid[0, :padding] = False
    return LayerInputs(
        queries=queries,
        keys=keys,
        values=torch.randn(batch, kv_heads, tokens, dim, generator=generator),
        valid=valid,
        scaling=dim**-0.5,
    )


@pytest.mark.parametrize(("after", "before"), [(0, 0), (1, 0), (8, 0), (3, 2), (0, 4), (60, 0)])
def test_spread_matches_the_reference(after, before):
    generator = seeded(after * 10 + before)
    scores = torch.rand(2, 3, 40, generator=generator)
    scores[..., -5:] = math.inf  # a protected window
    scores[1, 2, 7] = math.inf  # a protected token in the middle
    valid = torch.ones(2, 3, 40, dtype=torch.bool)
    valid[0, :, :6] = False  # left padding
    got = spread_scores(scores, valid, after=after, before=before)
    expected = reference_spread(scores, valid, after, before)
    real = valid
    torch.testing.assert_close(got[real], expected[real])
    assert torch.isposinf(got[scores == math.inf]).all()


def test_a_high_score_carries_to_the_tokens_after_it():
    scores = torch.zeros(1, 1, 20)
    scores[0, 0, 5] = 1.0
    got = spread_scores(scores, torch.ones(1, 1, 20, dtype=torch.bool), after=3)
    assert got[0, 0].nonzero().flatten().tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("padding", [0, 7])
def test_same_budget_as_the_wrapped_scorer(ratio, padding):
    inputs = layer_inputs(padding=padding)
    for plain, spans in [
        (SnapKV(ratio=ratio, window=8), SpanSnapKV(ratio=ratio, window=8, after=6)),
        (TOVA(ratio=ratio), SpanTOVA(ratio=ratio)),
        (SnapKV(ratio=ratio, window=8), Spans(SnapKV(ratio=ratio, window=8), after=4, before=1)),
        (AdaKV(SnapKV(ratio=ratio, window=8)), AdaKV(SpanSnapKV(ratio=ratio, window=8))),
    ]:
        a, b = plain.plan(inputs).keep, spans.plan(inputs).keep
        assert torch.equal(a.sum(-1).sum(-1), b.sum(-1).sum(-1))  # same total per row
        if not isinstance(plain, AdaKV):
            assert torch.equal(a.sum(-1), b.sum(-1))  # same per head
        assert not (b & ~inputs.head_valid).any()  # never padding
        window = torch.zeros_like(b)
        window[..., -8:] = True
        if isinstance(spans, (SpanSnapKV, Spans, AdaKV)):
            assert b[window].all()  # the observation window is kept


def test_plan_is_top_k_of_the_reference_scores():
    inputs = layer_inputs(seed=3)
    policy = SpanSnapKV(ratio=0.5, window=8, after=5, before=1)
    base = SnapKV.score(policy, inputs)
    expected_scores = reference_spread(base, inputs.head_valid, 5, 1)
    rank = inputs.head_valid.long().cumsum(-1)
    expected_scores[inputs.head_valid & (rank <= 4)] = math.inf  # the sinks, after spreading
    keep = policy.plan(inputs).keep
    budget = keep.sum(-1, keepdim=True)
    # every kept token scores at least as high as every evicted one
    kept_min = expected_scores.masked_fill(~keep, math.inf).amin(-1)
    evicted_max = expected_scores.masked_fill(keep, -math.inf).amax(-1)
    assert (kept_min >= evicted_max).all()
    assert (budget == 24).all()


def test_spans_keep_the_rest_of_a_retrieved_number():
    """The window's queries point at one token; SnapKV keeps it (and its pooling neighbours),
    the span keeps the next ``after`` tokens too."""
    t, dim = 64, 16
    inputs = layer_inputs(batch=1, kv_heads=1, group=1, tokens=t, dim=dim, seed=5)
    inputs.keys[0, 0, :] *= 0.01
    target = inputs.queries[0, 0, -1] / inputs.queries[0, 0, -1].norm() * 40
    inputs.keys[0, 0, 20] = target
    inputs.queries[0, 0, -8:] = target
    plain = SnapKV(ratio=0.8, window=4, kernel_size=1, n_sink=0).plan(inputs).keep[0, 0]
    spans = SpanSnapKV(ratio=0.8, window=4, kernel_size=1, after=6, n_sink=0)
    spans = spans.plan(inputs).keep[0, 0]
    assert plain[20] and spans[20]
    assert not plain[21:27].all()
    assert spans[20:27].all()


def test_policy_strings():
    assert isinstance(kvpatch.parse_policy("span-snapkv:0.75"), SpanSnapKV)
    ada = kvpatch.parse_policy("ada-span-snapkv")
    assert isinstance(ada, AdaKV) and isinstance(ada.scorer, SpanSnapKV)
    assert kvpatch.parse_policy("think:0.5+span-tova:0.5").name == "think+span-tova"
    assert Spans(SnapKV(ratio=0.3)).ratio == 0.3 and Spans(TOVA()).name == "span-tova"
    with pytest.raises(ValueError, match="span widths"):
        Spans(SnapKV(), after=-1)
    with pytest.raises(ValueError, match="token scorer"):
        Spans(kvpatch.ThinK())


def reconstructed(inputs: LayerInputs, scores: torch.Tensor) -> LayerInputs:
    """``inputs`` with the reconstruction scores a KVzip prefill would give them."""
    return LayerInputs(**{**vars(inputs), "reconstruction_scores": scores})


def test_kvzip_keeps_the_tokens_that_lead_to_a_high_score():
    """A number whose last digits the reconstruction attends and whose first it passes over (as
    on Gemma 3): KVzip keeps those last digits alone, with span_before the whole number, in the
    same budget."""
    inputs = layer_inputs(batch=1, kv_heads=1, tokens=64)
    scores = 0.1 + torch.rand(1, 1, 64, generator=seeded(7)) * 0.1
    number = slice(30, 36)
    scores[0, 0, 30:33] = 0.0  # the number's first three tokens, passed over
    scores[0, 0, 33:36] = 1.0  # and its last three
    inputs = reconstructed(inputs, scores)
    ratio = 1 - 10 / 64  # 4 sinks and 6 more
    plain = KVzip(ratio=ratio, span_before=0).plan(inputs).keep[0, 0]
    spread = KVzip(ratio=ratio, span_before=3).plan(inputs).keep[0, 0]
    assert plain[33:36].all() and not plain[30:33].any()
    assert spread[number].all()
    assert plain.sum() == spread.sum()


@pytest.mark.parametrize(("before", "after"), [(0, 0), (8, 0), (3, 2)])
def test_kvzip_spreads_as_the_reference(before, after):
    inputs = layer_inputs(padding=5)
    scores = torch.rand(2, 2, 48, generator=seeded(before + after))
    got = KVzip(span_before=before, span_after=after).score(reconstructed(inputs, scores))
    expected = reference_spread(scores, inputs.head_valid, after, before)
    torch.testing.assert_close(got[inputs.head_valid], expected[inputs.head_valid])


def test_kvzip_span_settings_are_its_own_in_policy_strings():
    """KVzip's spans are settings of the scorer, apart from those of a span- wrapper around it."""
    policy = kvpatch.parse_policy("global-kvzip:0.75/span_before=8")
    assert policy == GlobalBudgets(KVzip(ratio=0.75, span_before=8))
    wrapped = kvpatch.parse_policy("span-kvzip/before=2")
    assert wrapped == Spans(KVzip(), before=2)
    deep = kvpatch.parse_policy("global-span-kvzip/span_before=0,before=2")  # two wrappers down
    assert deep == GlobalBudgets(Spans(KVzip(span_before=0), before=2))
    with pytest.raises(ValueError, match="span_after=-1"):
        kvpatch.parse_policy("kvzip/span_after=-1")
