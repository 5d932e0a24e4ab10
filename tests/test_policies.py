"""Policy decisions checked against independent plain-torch references, and the policy grammar."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvpatch import parse_policy
from kvpatch.policies import (
    TOVA,
    AdaKV,
    Composed,
    ExpectedAttention,
    GlobalBudgets,
    Knorm,
    KVzip,
    LayerInputs,
    RandomScorer,
    SnapKV,
    StreamingLLM,
    ThinK,
)
from kvpatch.tools.testing import seeded

B, HQ, HKV, D = 2, 4, 2, 16
G = HQ // HKV
PAD = 20  # left padding of row 1 in the padded cases
SINKS = 4  # every token policy keeps the first 4 real tokens by default


def make_inputs(t: int, pad: int = 0, seed: int = 0) -> LayerInputs:
    """Random inputs; row 1 starts with ``pad`` padding tokens whose keys are tiny (low norm)."""
    gen = seeded(seed)
    q, k, v = (torch.randn(B, h, t, D, generator=gen) for h in (HQ, HKV, HKV))
    valid = torch.ones(B, t, dtype=torch.bool)
    valid[1, :pad] = False
    k[1, :, :pad] *= 0.01
    return LayerInputs(q, k, v, valid, scaling=D**-0.5)


def n_keep(n: int, ratio: float) -> int:
    return n - math.floor(n * ratio)


def top_mask(scores, count: int) -> torch.Tensor:
    """Mask of the ``count`` largest entries of a 1-D sequence, by a plain Python sort."""
    values = [float(s) for s in scores]
    order = sorted(range(len(values)), key=lambda j: -values[j])
    mask = torch.zeros(len(values), dtype=torch.bool)
    mask[order[:count]] = True
    return mask


def per_row(x: LayerInputs, row_fn) -> torch.Tensor:
    """Run ``row_fn(q [HQ,n,D], k [HKV,n,D]) -> keep [HKV,n]`` on each row's real tokens only."""
    keep = torch.zeros(x.keys.shape[:3], dtype=torch.bool)
    for b in range(B):
        real = x.valid[b].nonzero().flatten()
        keep[b][:, real] = row_fn(x.queries[b][:, real].double(), x.keys[b][:, real].double())
    return keep


def with_sinks(scores: torch.Tensor, n_sink: int = SINKS) -> torch.Tensor:
    """``scores`` ``[..., n]`` of one row's real tokens, its first ``n_sink`` always kept."""
    scores = torch.as_tensor(scores, dtype=torch.float64).clone()
    scores[..., :n_sink] = math.inf
    return scores


def knorm_row(ratio):
    def fn(q, k):
        norms = [[math.sqrt(sum(c * c for c in key.tolist())) for key in head] for head in k]
        return torch.stack(
            [top_mask(with_sinks([-s for s in head]), n_keep(k.shape[1], ratio)) for head in norms]
        )

    return fn


def streaming_row(ratio, n_sink=4):
    def fn(q, k):
        n = k.shape[1]
        keep = torch.zeros(HKV, n, dtype=torch.bool)
        keep[:, :n_sink] = True
        keep[:, n - (n_keep(n, ratio) - n_sink) :] = True
        return keep

    return fn


def snapkv_scores(q, k, window, scaling=D**-0.5, kernel=5):
    """Pooled attention of the last ``window`` queries, averaged over each GQA group; window inf."""
    n = k.shape[1]
    w = min(window, n)
    out = torch.zeros(HKV, n, dtype=torch.float64)
    for hq in range(HQ):
        attn = torch.zeros(n, dtype=torch.float64)
        for i in range(n - w, n):
            attn[: i + 1] += torch.softmax(k[hq // G, : i + 1] @ q[hq, i] * scaling, 0) / w
        half = kernel // 2
        pooled = [attn[max(j - half, 0) : j + half + 1].mean() for j in range(n)]
        out[hq // G] += torch.stack(pooled) / G
    out[:, n - w :] = math.inf
    return with_sinks(out)


def snapkv_row(ratio, window):
    def fn(q, k):
        scores = snapkv_scores(q, k, window)
        count = max(n_keep(k.shape[1], ratio), int(torch.isinf(scores[0]).sum()))
        return torch.stack([top_mask(head, count) for head in scores])

    return fn


def tova_row(ratio, scaling=D**-0.5):
    def fn(q, k):
        avg = sum(torch.softmax(k[hq // G] @ q[hq, -1] * scaling, 0) for hq in range(HQ)) / HQ
        avg[-1] = math.inf
        return top_mask(with_sinks(avg), n_keep(k.shape[1], ratio)).expand(HKV, -1)

    return fn


def case(spec, row_fn, pad):
    name = spec if isinstance(spec, str) else f"snapkv:{spec.ratio}-w{spec.window}"
    return pytest.param(spec, row_fn, pad, id=f"{name}-pad{pad}")


TOKEN_CASES = [
    case("knorm:0.5", knorm_row(0.5), 0),
    case("knorm:0.7", knorm_row(0.7), PAD),
    case("streamingllm:0.6", streaming_row(0.6), 0),
    case("streamingllm:0.6", streaming_row(0.6), PAD),  # sinks: the first 4 real tokens
    case("tova:0.5", tova_row(0.5), 0),
    case("tova:0.3", tova_row(0.3), PAD),
    case(SnapKV(ratio=0.5, window=16), snapkv_row(0.5, 16), 0),
    case(SnapKV(ratio=0.5, window=16), snapkv_row(0.5, 16), PAD),  # pooling skips padding
    case(SnapKV(ratio=0.7, window=16), snapkv_row(0.7, 16), 0),
    case(SnapKV(ratio=0.9, window=16), snapkv_row(0.9, 16), 0),  # window > budget: window only
]


@pytest.mark.parametrize(("spec", "row_fn", "pad"), TOKEN_CASES)
def test_token_policy_matches_reference(spec, row_fn, pad):
    """Keep masks equal the reference computed on each row's real tokens alone."""
    x = make_inputs(120, pad=pad, seed=2)
    plan = parse_policy(spec).plan(x)
    assert plan.channels is None
    assert torch.equal(plan.keep, per_row(x, row_fn))


def ada_row(score_fn, ratio, alpha=0.2):
    """Brute force: each head's own top floor(alpha*n_keep), then the best remaining scores."""

    def fn(q, k):
        scores = score_fn(q, k)
        budget = n_keep(k.shape[1], ratio)
        floor = math.floor(alpha * budget)
        keep = torch.stack([top_mask(head, floor) for head in scores])
        n = k.shape[1]
        rest = [(float(scores[h, j]), h, j) for h in range(HKV) for j in range(n) if not keep[h, j]]
        for _, h, j in sorted(rest, key=lambda e: -e[0])[: HKV * (budget - floor)]:
            keep[h, j] = True
        return keep

    return fn


def neg_norm(q, k):
    return with_sinks(-k.norm(dim=-1))


@pytest.mark.parametrize(
    ("spec", "score_fn", "pad", "head1_scale"),
    [
        ("ada-knorm:0.5", neg_norm, 0, 1.0),
        ("ada-knorm:0.5", neg_norm, 0, 3.0),  # head 1 only gets its safeguard
        ("ada-knorm:0.6", neg_norm, PAD, 1.0),
        (AdaKV(SnapKV(ratio=0.6, window=8)), lambda q, k: snapkv_scores(q, k, 8), 0, 1.0),
    ],
    ids=["ada-knorm", "ada-knorm-head1-large", "ada-knorm-pad", "ada-snapkv"],
)
def test_adakv_matches_brute_force(spec, score_fn, pad, head1_scale):
    """Head-wise budgets: same total as uniform, safeguard per head, different head lengths."""
    x = make_inputs(100, pad=pad)
    x.keys[:, 1] *= head1_scale
    policy = parse_policy(spec)
    keep = policy.plan(x).keep
    assert torch.equal(keep, per_row(x, ada_row(score_fn, policy.ratio)))
    for b in range(B):
        assert keep[b].sum() == HKV * n_keep(int(x.valid[b].sum()), policy.ratio)
    assert len(set(keep.sum(-1).flatten().tolist())) > 1


def think_channels(x: LayerInputs, ratio: float, window: int = 32) -> torch.Tensor:
    """Per (row, head): top channels of mean(q^2 over window and group) * mean(k^2 over real)."""
    t = x.keys.shape[2]
    out = torch.zeros(B, HKV, D - math.floor(D * ratio), dtype=torch.long)
    for b in range(B):
        real = x.valid[b]
        for h in range(HKV):
            q = x.queries[b, h * G : (h + 1) * G, t - window :].double()
            q_energy = (q**2).sum(dim=(0, 1)) / (G * window)
            k_energy = (x.keys[b, h][real].double() ** 2).mean(0)
            out[b, h] = top_mask(q_energy * k_energy, out.shape[-1]).nonzero().flatten()
    return out


@pytest.mark.parametrize("pad", [0, PAD])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_think_matches_reference(ratio, pad):
    """Channels by query*key energy, real tokens all kept, full width for the last 32 tokens."""
    x = make_inputs(100, pad=pad)
    x.keys[1, :, :pad] = 10 * x.values[1, :, :pad]  # would change the ranking if counted
    plan = ThinK(ratio=ratio).plan(x)
    assert torch.equal(plan.channels, think_channels(x, ratio))
    assert plan.full_width_from == 100 - 32
    assert torch.equal(plan.keep, x.valid[:, None, :].expand(B, HKV, 100))
    assert ThinK(ratio=0.0).plan(x).channels is None


@pytest.mark.parametrize(
    "spec",
    ["think+snapkv", "think:0.5+knorm:0.5", "streamingllm:0.8+think:0.25", "think+ada-knorm:0.7"],
)
def test_composition_keeps_think_window(spec):
    """Every head keeps ThinK's full-width window; channels are ThinK's alone."""
    x = make_inputs(100)
    policy = parse_policy(spec)
    plan = policy.plan(x)
    assert plan.keep[..., 100 - 32 :].all()
    assert torch.equal(plan.channels, ThinK(ratio=policy.channels.ratio).plan(x).channels)
    assert plan.full_width_from == 100 - 32


def test_composition_fills_rest_of_budget_by_score():
    """think+knorm keeps the window plus the smallest-norm older tokens, n_keep per head."""
    x = make_inputs(100)
    keep = (ThinK(ratio=0.5) + Knorm(ratio=0.5)).plan(x).keep
    for b in range(B):
        for h in range(HKV):
            scores = with_sinks(-x.keys[b, h, :68].norm(dim=-1))
            expected = top_mask(scores, n_keep(100, 0.5) - 32)
            assert torch.equal(keep[b, h], torch.cat([expected, torch.ones(32, dtype=torch.bool)]))


@pytest.mark.parametrize(
    "spec",
    [
        *("knorm", "streamingllm", "snapkv", "tova", "random"),
        *("ada-knorm", "ada-snapkv", "ada-tova", "think", "think+snapkv", "think+ada-streamingllm"),
    ],
)
def test_padding_never_kept_and_rows_independent(spec):
    """No padding is kept, budgets follow each row's real length, a padded row plans as alone."""
    x = make_inputs(200, pad=PAD)
    policy = parse_policy(spec)
    plan = policy.plan(x)
    keep = plan.keep
    assert not keep[1, :, :PAD].any()
    real = x.valid[1]
    q, k, v = (t[1:, :, real] for t in (x.queries, x.keys, x.values))
    alone = policy.plan(LayerInputs(q, k, v, real[None, real], x.scaling))
    assert torch.equal(keep[1:, :, PAD:], alone.keep)
    assert plan.channels is None or torch.equal(plan.channels[1:], alone.channels)
    for b, real in enumerate((200, 200 - PAD)):
        counts = keep[b].sum(-1)
        if isinstance(policy, ThinK):
            assert (counts == real).all()
        elif isinstance(policy, AdaKV) or isinstance(getattr(policy, "tokens", None), AdaKV):
            assert counts.sum() == HKV * n_keep(real, 0.5)
        else:
            assert (counts == n_keep(real, 0.5)).all()


def test_budget_uses_exact_floor():
    """n_keep = T - floor(T*ratio) with T=300, ratio=0.21 is 300 - 63 = 237."""
    keep = Knorm(ratio=0.21).plan(make_inputs(300)).keep
    assert (keep.sum(-1) == 237).all()


def test_random_is_reproducible_per_seed():
    x = make_inputs(100)
    first = RandomScorer(seed=1).plan(x).keep
    assert torch.equal(first, RandomScorer(seed=1).plan(x).keep)
    assert not torch.equal(first, RandomScorer(seed=2).plan(x).keep)
    assert (first.sum(-1) == 50).all()


def test_grammar_builds_policies():
    assert parse_policy("snapkv") == SnapKV(ratio=0.5)
    assert parse_policy(" TOVA : 0.3 ") == TOVA(ratio=0.3)
    ada = parse_policy("ada-snapkv:0.75")
    assert isinstance(ada, AdaKV) and ada.scorer == SnapKV(ratio=0.75)
    composed = parse_policy("think:0.25+ada-snapkv:0.75")
    assert isinstance(composed, Composed)
    assert composed.channels == ThinK(ratio=0.25) and composed.tokens == ada
    swapped = parse_policy("snapkv+think")
    assert swapped.channels == ThinK(ratio=0.5) and swapped.tokens == SnapKV(ratio=0.5)
    obj = Knorm(ratio=0.3)
    assert parse_policy(obj) is obj and parse_policy(None) is None


def test_grammar_settings_equal_the_constructors():
    """``NAME[:RATIO]/FIELD=VALUE,...`` sets fields of the policy or of the scorer it wraps."""
    assert parse_policy("snapkv:0.25/window=32,n_sink=0") == SnapKV(0.25, window=32, n_sink=0)
    assert parse_policy("ada-snapkv/alpha=0.5") == AdaKV(SnapKV(), alpha=0.5)
    assert parse_policy("ada-expected-attention:0.75/epsilon=0.01") == AdaKV(
        ExpectedAttention(0.75, epsilon=0.01)
    )
    composed = parse_policy("think:0.5/window=16+global-kvzip/normalise=context")
    assert composed.channels == ThinK(0.5, window=16)
    assert composed.tokens == GlobalBudgets(KVzip(normalise="context"))
    assert parse_policy("expected-attention/use_covariance=false").use_covariance is False


@pytest.mark.parametrize(
    ("spec", "part"),
    [
        ("snapkv/windw=3", "one of kernel_size, n_sink, window"),
        ("snapkv/window", "FIELD=VALUE"),
        ("snapkv/ratio=0.3", "the ratio goes after ':'"),
        ("snapkv/window=x", "expected int"),
        ("snapkv/window=0", "window >= 1"),
        ("kvzip/normalise=softly", "normalise must be one of"),
        ("knorm/n_sink=-1", "n_sink >= 0"),
    ],
)
def test_grammar_rejects_bad_settings(spec, part):
    with pytest.raises(ValueError, match=re.escape(part)):
        parse_policy(spec)


def test_grammar_unknown_name_suggests_and_lists():
    with pytest.raises(ValueError, match="snapvk") as err:
        parse_policy("snapvk:0.5")
    assert "Did you mean 'snapkv'" in str(err.value)
    for name in ("tova", "knorm", "streamingllm", "random", "ada-snapkv", "think"):
        assert name in str(err.value)


@pytest.mark.parametrize("ratio", ["-0.1", "1.0", "1.5", "abc", "nan", ""])
def test_grammar_rejects_bad_ratios(ratio):
    with pytest.raises(ValueError, match="ratio") as err:
        parse_policy(f"think+snapkv:{ratio}")
    assert "snapkv" in str(err.value) and ratio in str(err.value)


@pytest.mark.parametrize(
    ("spec", "part"),
    [
        ("snapkv+", "empty term"),
        ("+think", "empty term"),
        ("think+think-v+snapkv+tova", "4 terms"),
        ("snapkv+tova", "one token policy"),
        ("think+think", "one key-channel policy"),
        ("think-v+snapkv+think-v", "one value-channel policy"),
        ("ada-think", "ada-think"),
    ],
)
def test_grammar_rejects_bad_terms(spec, part):
    with pytest.raises(ValueError, match=part):
        parse_policy(spec)


@pytest.mark.parametrize("cls", [SnapKV, TOVA, Knorm, StreamingLLM, RandomScorer, ThinK])
@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, float("nan")])
def test_constructors_reject_bad_ratios(cls, ratio):
    with pytest.raises(ValueError, match="ratio"):
        cls(ratio=ratio)


@pytest.mark.parametrize("window", [1, 5, 64])
def test_mean_window_attention_in_chunks_equals_the_whole_matrix(window):
    x = make_inputs(53, pad=PAD)
    whole = x.window_attention(window).mean(dim=3)
    for chunk in (7, 20, 53):
        torch.testing.assert_close(x.mean_window_attention(window, chunk=chunk), whole)
    assert (whole[1, ..., :PAD] == 0).all()  # padding keys get no weight in either


def test_snapkv_scores_the_same_in_chunks(monkeypatch):
    from kvpatch.policies import contract

    x = make_inputs(53, pad=PAD)
    whole = SnapKV(ratio=0.5, window=16).score(x)
    monkeypatch.setattr(contract, "SCORE_CHUNK", 8)
    torch.testing.assert_close(SnapKV(ratio=0.5, window=16).score(x), whole)
