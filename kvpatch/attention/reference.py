"""The fallback math: attention computed in plain torch, for what no stock kernel can take (a
per-head padding mask under flash attention)."""

from __future__ import annotations

import torch


def reference_attention(module, query, key, value, additive_mask, scaling, kwargs):
    """Plain attention math with an additive mask; returns ``[batch, q_len, heads, dim]`` and
    the weights."""
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1).float()
    values = value.repeat_interleave(group, dim=1).float()
    scores = (query.float() @ keys.transpose(-1, -2)) * scaling
    softcap = kwargs.get("softcap")
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if additive_mask is not None:
        scores = scores + additive_mask.float()
    weights = scores.softmax(dim=-1)
    output = (weights @ values).to(query.dtype)
    return output.transpose(1, 2).contiguous(), weights.to(query.dtype)
