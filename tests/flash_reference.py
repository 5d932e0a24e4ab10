"""flash-attn's two entry points in plain torch, so that the flash_attention_2 path runs on a CPU.

``flash_attn_func`` and ``flash_attn_varlen_func`` follow the semantics flash-attn 2 documents
(https://github.com/Dao-AILab/flash-attention, ``flash_attn_interface.py``):

- tensors are ``[batch, tokens, heads, dim]`` (``[total_tokens, heads, dim]`` for varlen, the
  sequences concatenated and delimited by ``cu_seqlens``, int32 offsets starting at 0);
- grouped-query attention: query head ``h`` reads key/value head ``h // (q_heads / kv_heads)``;
- with ``causal=True`` the mask is aligned to the bottom right corner: when a sequence has ``sq``
  queries and ``sk`` keys, query ``i`` sees key ``j`` iff ``j <= i + sk - sq``; a query that sees
  no key (``sq > sk``) outputs zeros;
- ``window_size=(left, right)``: query ``i`` sees keys in
  ``[i + sk - sq - left, i + sk - sq + right]``, ``-1`` meaning unbounded;
- ``softcap > 0`` caps the scaled logits as ``softcap * tanh(logit / softcap)``.

Inside :func:`installed`, transformers' flash_attention_2 implementation calls these instead of
the CUDA kernels, and models may be switched to ``flash_attention_2`` without flash-attn; tests use
it to run kvpatch's whole flash branch (fake keys, the 2-D padding mask, unpadding to varlen)
against the masking oracle. It computes in float32 and is meant for correctness, not speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

import torch

from kvpatch import compat


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention over ``q [b, sq, h, d]``, ``k, v [b, sk, h_kv, d]``; returns ``[b, sq, h, d_v]``
    (with the log-sum-exp ``[b, h, sq]`` and None when ``return_attn_probs``)."""
    _check_supported(dropout_p, alibi_slopes)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"flash_attn_func takes [batch, tokens, heads, dim] tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    rows = [
        _attend(q[row], k[row], v[row], softmax_scale, causal, window_size, softcap)
        for row in range(q.shape[0])
    ]
    out = torch.stack([out for out, _ in rows])
    return (out, torch.stack([lse for _, lse in rows]), None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
):
    """Attention over concatenated sequences ``q [total_q, h, d]``, ``k, v [total_k, h_kv, d]``,
    sequence ``i`` being rows ``cu_seqlens[i]:cu_seqlens[i + 1]``; returns ``[total_q, h, d_v]``
    (with the log-sum-exp ``[h, total_q]`` and None when ``return_attn_probs``)."""
    _check_supported(dropout_p, alibi_slopes)
    if block_table is not None:
        raise ValueError("the flash reference has no paged KV cache (block_table must be None)")
    starts_q = _sequence_bounds(cu_seqlens_q, q.shape[0], max_seqlen_q, "q")
    starts_k = _sequence_bounds(cu_seqlens_k, k.shape[0], max_seqlen_k, "k")
    if len(starts_q) != len(starts_k):
        raise ValueError(
            f"cu_seqlens_q delimits {len(starts_q) - 1} sequences, cu_seqlens_k {len(starts_k) - 1}"
        )
    outputs, lses = [], []
    for (q0, q1), (k0, k1) in zip(pairwise(starts_q), pairwise(starts_k), strict=True):
        out, lse = _attend(
            q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, causal, window_size, softcap
        )
        outputs.append(out)
        lses.append(lse)
    out = torch.cat(outputs)
    return (out, torch.cat(lses, dim=-1), None) if return_attn_probs else out


def _check_supported(dropout_p: float, alibi_slopes: torch.Tensor | None) -> None:
    if dropout_p != 0.0:
        raise ValueError(
            f"the flash reference is for inference: dropout_p must be 0, got {dropout_p}"
        )
    if alibi_slopes is not None:
        raise ValueError("the flash reference has no ALiBi (alibi_slopes must be None)")


def _sequence_bounds(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, name: str) -> list:
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in pairwise(bounds)]
    if cu_seqlens.dtype != torch.int32 or not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"cu_seqlens_{name} must be int32 offsets from 0 to the {total} {name} tokens, got "
            f"{cu_seqlens.dtype} {bounds}"
        )
    if any(n < 0 for n in lengths) or max(lengths, default=0) > max_seqlen:
        raise ValueError(
            f"cu_seqlens_{name} must not decrease, and no sequence may exceed "
            f"max_seqlen_{name}={max_seqlen}: lengths {lengths}"
        )
    return bounds


def _attend(q, k, v, softmax_scale, causal, window_size, softcap):
    """One sequence: ``q [sq, h, d]``, ``k, v [sk, h_kv, d]`` -> output ``[sq, h, d_v]`` and
    log-sum-exp ``[h, sq]``."""
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} key/value heads evenly")
    group = q_heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [h, sk, d]
    values = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    logits = q.float().transpose(0, 1) @ keys.transpose(-1, -2) * scale  # [h, sq, sk]
    if softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    visible = _visible(q.shape[0], k.shape[0], causal, window_size, q.device)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf for a query that sees nothing
    weights = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = (weights @ values).transpose(0, 1).to(q.dtype)
    return out, lse


def _visible(sq: int, sk: int, causal: bool, window_size, device) -> torch.Tensor:
    """``[sq, sk]``: which keys each query sees, aligned to the bottom right corner."""
    left, right = window_size
    if causal:
        right = 0
    offset = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
    offset -= sk - sq  # key j relative to query i's own position
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


@contextmanager
def installed() -> Iterator[None]:
    """Run transformers' flash_attention_2 on these functions while inside the block.

    Models can be switched to ``flash_attention_2`` inside it with
    :func:`kvpatch.compat.set_attention_implementation` although flash-attn is not installed.
    """
    with compat.flash_functions(flash_attn_func, flash_attn_varlen_func):
        yield
