"""flash_reference keeps flash-attn's documented semantics, checked against torch's sdpa
with masks written out independently, and against flash-attn itself where a GPU has it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from flash_reference import flash_attn_func, flash_attn_varlen_func

from kvpatch.tools.testing import seeded


def qkv(batch=2, sq=5, sk=9, heads=4, kv_heads=2, dim=16, seed=0, dtype=torch.float32):
    generator = seeded(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    return (
        draw(batch, sq, heads, dim),
        draw(batch, sk, kv_heads, dim),
        draw(batch, sk, kv_heads, dim),
    )


def sdpa(q, k, v, mask=None, scale=None):
    """torch's attention in flash layout, GQA by repeating each KV head over its group."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


def test_plain_attention_is_sdpa_with_groups():
    q, k, v = qkv()
    torch.testing.assert_close(flash_attn_func(q, k, v), sdpa(q, k, v))
    torch.testing.assert_close(
        flash_attn_func(q, k, v, softmax_scale=0.3), sdpa(q, k, v, scale=0.3)
    )


def test_causal_with_equal_lengths_is_the_usual_causal_mask():
    q, k, v = qkv(sq=7, sk=7)
    expected = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))),
        is_causal=True,
    ).transpose(1, 2)
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True), expected)


def test_causal_is_aligned_to_the_bottom_right():
    """Five queries after four earlier keys: the last query sees all nine keys, the first five."""
    q, k, v = qkv(sq=5, sk=9)
    bottom_right = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=9 - 5)
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True), sdpa(q, k, v, bottom_right))
    # one query (a decoding step) sees every key
    q1 = q[:, -1:]
    torch.testing.assert_close(flash_attn_func(q1, k, v, causal=True), sdpa(q1, k, v))


def test_a_query_that_sees_no_key_outputs_zeros():
    q, k, v = qkv(sq=6, sk=4)
    out = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))  # rows 0-1 precede every key
    visible = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.testing.assert_close(out[:, 2:], sdpa(q[:, 2:], k, v, visible))


def window(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """flash-attn's docstring: query i sees keys [i + sk - sq - left, i + sk - sq + right]."""
    visible = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            visible[i, j] = i + sk - sq - left <= j <= i + sk - sq + right
    return visible


def test_sliding_window_bounds():
    q, k, v = qkv(sq=5, sk=9)
    got = flash_attn_func(q, k, v, window_size=(2, 1))
    torch.testing.assert_close(got, sdpa(q, k, v, window(5, 9, 2, 1)))
    causal = flash_attn_func(q, k, v, causal=True, window_size=(2, -1))
    torch.testing.assert_close(causal, sdpa(q, k, v, window(5, 9, 2, 0)))


def test_softcap_caps_the_scaled_logits():
    q, k, v = qkv(heads=2, kv_heads=2)
    q = q * 4
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    weights = (torch.tanh(logits / 5.0) * 5.0).softmax(-1)
    expected = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    torch.testing.assert_close(flash_attn_func(q, k, v, softmax_scale=0.25, softcap=5.0), expected)


def test_log_sum_exp_is_returned_on_request():
    q, k, v = qkv(heads=2, kv_heads=2)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    torch.testing.assert_close(out, flash_attn_func(q, k, v))


def test_varlen_is_each_sequence_on_its_own():
    lengths_q, lengths_k = [3, 1, 4], [7, 5, 4]
    pieces = [
        qkv(1, sq, sk, seed=i) for i, (sq, sk) in enumerate(zip(lengths_q, lengths_k, strict=True))
    ]
    q, k, v = (torch.cat([p[n][0] for p in pieces]) for n in range(3))

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    out = flash_attn_varlen_func(
        q, k, v, offsets(lengths_q), offsets(lengths_k), max(lengths_q), max(lengths_k), causal=True
    )
    expected = torch.cat([flash_attn_func(*p, causal=True)[0] for p in pieces])
    torch.testing.assert_close(out, expected)


def test_half_precision_in_half_out():
    q, k, v = qkv(dtype=torch.float16)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.float16
    torch.testing.assert_close(
        out.float(),
        flash_attn_func(q.float(), k.float(), v.float(), causal=True),
        atol=2e-3,
        rtol=0,
    )


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.1), "dropout_p must be 0"),
        (lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=torch.ones(4)), "no ALiBi"),
        (lambda q, k, v: flash_attn_func(q[0], k[0], v[0]), r"\[batch, tokens, heads, dim\]"),
        (lambda q, k, v: flash_attn_func(q, k[:, :, :1].expand(-1, -1, 3, -1), v), "evenly"),
        (
            lambda q, k, v: flash_attn_varlen_func(
                q[0], k[0], v[0], torch.tensor([0, 5]), torch.tensor([0, 9]), 5, 9
            ),
            "int32 offsets",
        ),
        (
            lambda q, k, v: flash_attn_varlen_func(
                q[0],
                k[0],
                v[0],
                torch.tensor([0, 5], dtype=torch.int32),
                torch.tensor([0, 9], dtype=torch.int32),
                4,
                9,
            ),
            "exceed max_seqlen_q=4",
        ),
        (
            lambda q, k, v: flash_attn_varlen_func(
                q[0],
                k[0],
                v[0],
                torch.tensor([0, 2, 5], dtype=torch.int32),
                torch.tensor([0, 9], dtype=torch.int32),
                5,
                9,
            ),
            "delimits 2 sequences",
        ),
    ],
    ids=["dropout", "alibi", "3-d", "uneven-groups", "int64-offsets", "max-seqlen", "mismatch"],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(*qkv())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="needs a CUDA GPU and flash-attn",
)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_flash_attn(causal):
    import flash_attn

    q, k, v = (t.cuda() for t in qkv(sq=5, sk=9, dtype=torch.float16))
    expected = flash_attn.flash_attn_func(q, k, v, causal=causal)
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=causal), expected, atol=2e-3, rtol=0)
    cu_q = torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 9, 18], dtype=torch.int32, device="cuda")
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    expected = flash_attn.flash_attn_varlen_func(*flat, cu_q, cu_k, 5, 9, causal=causal)
    got = flash_attn_varlen_func(*flat, cu_q, cu_k, 5, 9, causal=causal)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)
