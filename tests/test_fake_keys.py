"""Fake keys get exactly zero softmax weight, stay finite, and report when they cannot."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpatch.attention.fake_keys import fake_keys
from kvpatch.tools.testing import seeded


def random_case(n: int, dim: int = 64, batch: int = 2, heads: int = 3, seed: int = 0):
    generator = seeded(seed)
    queries = torch.randn(batch, heads, n, dim, generator=generator) * 3
    keys = torch.randn(batch, heads, 40, dim, generator=generator) * 2
    return queries, keys


@pytest.mark.parametrize("n", [1, 4, 8, 48])
def test_fake_key_weight_is_exactly_zero_in_fp32(n):
    queries, keys = random_case(n)
    scaling = 64**-0.5
    fake, ok = fake_keys(queries, keys.norm(dim=-1).amax(-1), scaling, torch.float32)
    assert ok.all()
    with_fake = torch.cat([keys, fake[:, :, None, :]], dim=2)
    weights = (queries @ with_fake.transpose(-1, -2) * scaling).softmax(-1)
    assert (weights[..., -1] == 0).all()
    real_only = (queries @ keys.transpose(-1, -2) * scaling).softmax(-1)
    torch.testing.assert_close(weights[..., :-1], real_only, atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_keys_are_finite_and_silent_in_half_precision(dtype):
    queries, keys = random_case(4)
    queries, keys = queries.to(dtype), keys.to(dtype)
    scaling = 64**-0.5
    fake, ok = fake_keys(queries, keys.float().norm(dim=-1).amax(-1), scaling, dtype)
    assert ok.all() and fake.dtype == dtype and torch.isfinite(fake).all()
    with_fake = torch.cat([keys, fake[:, :, None, :]], dim=2)
    values = torch.cat([torch.randn_like(keys), torch.zeros_like(fake[:, :, None, :])], dim=2)
    scores = queries.float() @ with_fake.float().transpose(-1, -2) * scaling
    assert torch.isfinite(scores.to(dtype)).all(), "scores must not overflow the dtype"
    assert (scores.softmax(-1)[..., -1] == 0).all()
    out = F.scaled_dot_product_attention(queries, with_fake, values, scale=scaling)
    expected = F.scaled_dot_product_attention(queries, keys, values[:, :, :-1], scale=scaling)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)


def test_unseparable_queries_are_reported():
    """Queries q and -q admit no key scoring low for both: the head must be flagged."""
    queries, keys = random_case(2)
    queries[:, :, 1] = -queries[:, :, 0]
    _, ok = fake_keys(queries, keys.norm(dim=-1).amax(-1), 0.125, torch.float32)
    assert not ok.any()


def test_zero_query_is_reported():
    queries, keys = random_case(3)
    queries[0, 1, 2] = 0
    _, ok = fake_keys(queries, keys.norm(dim=-1).amax(-1), 0.125, torch.float32)
    assert not ok[0, 1] and ok.sum() == ok.numel() - 1


def test_fp16_overflow_is_reported():
    """A key bound so large that the fake score leaves fp16's range is refused, not returned."""
    queries, _ = random_case(4)
    bound = torch.full(queries.shape[:2], 1e5)
    _, ok = fake_keys(queries.half(), bound, 1.0, torch.float16)
    assert not ok.any()


@pytest.mark.parametrize("n", [100, 300])
def test_more_queries_than_dimensions_are_zero_wherever_ok(n):
    """With more queries than dimensions a separating key may not exist: the report is honest."""
    queries, keys = random_case(n, seed=n)
    queries = queries + 2.0  # shared offset: a separating direction exists
    scaling = 64**-0.5
    fake, ok = fake_keys(queries, keys.norm(dim=-1).amax(-1), scaling, torch.float32)
    with_fake = torch.cat([keys, fake[:, :, None, :]], dim=2)
    weights = (queries @ with_fake.transpose(-1, -2) * scaling).softmax(-1)[..., -1]
    assert ok.any()
    assert (weights[ok] == 0).all()


def test_nearly_opposite_queries_still_get_a_fake_key():
    """Queries 170 degrees apart defeat the mean-direction shortcut; the exact solve succeeds."""
    angle = torch.tensor(170.0).deg2rad()
    q = torch.zeros(1, 1, 2, 64)
    q[0, 0, 0, 0] = 4.0
    q[0, 0, 1, 0], q[0, 0, 1, 1] = 4.0 * angle.cos(), 4.0 * angle.sin()
    keys = torch.randn(1, 1, 10, 64)
    fake, ok = fake_keys(q, keys.norm(dim=-1).amax(-1), 0.125, torch.float32)
    assert ok.all()
    with_fake = torch.cat([keys, fake[:, :, None, :]], dim=2)
    assert ((q @ with_fake.transpose(-1, -2) * 0.125).softmax(-1)[..., -1] == 0).all()
