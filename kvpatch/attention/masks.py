"""Mask translation: the logical attention mask transformers builds (over positions seen) laid
out over a padded view's columns (packed block, then tail)."""

from __future__ import annotations

import torch

from kvpatch.attention.packed import tail_visibility
from kvpatch.cache import PaddedRequest


def physical_mask(
    logical: torch.Tensor | None,
    request: PaddedRequest,
    query: torch.Tensor,
    key: torch.Tensor,
    head_padding: torch.Tensor | None,
    additive: bool,
) -> torch.Tensor | None:
    """Translate a logical 4-D mask (or None) to the view's columns.

    Packed columns are visible (kept tokens are real and precede every query) except the padding
    slots in ``head_padding``; tail columns take the logical mask's last columns.
    """
    if logical is None and head_padding is None:
        return None
    batch, q_heads, q_len, _ = query.shape
    end = request.tail_start + key.shape[-2] - request.packed_length  # logical length
    tail = tail_visibility(logical, request.tail_start, end, query)
    if tail is None:  # every tail token visible
        width = end - request.tail_start
        tail = torch.ones(1, 1, q_len, width, dtype=torch.bool, device=key.device)
    tail = tail.expand(batch, -1, q_len, -1)
    if head_padding is None:
        packed = tail.new_ones(batch, 1, q_len, request.packed_length)
    else:
        group = q_heads // head_padding.shape[1]
        packed = (~head_padding).repeat_interleave(group, dim=1)[:, :, None, :]
        packed = packed.expand(-1, -1, q_len, -1)
        tail = tail.expand(-1, q_heads, -1, -1)
    visible = torch.cat([packed, tail], dim=-1)
    if not additive:
        return visible
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(visible, zero, torch.finfo(query.dtype).min)


def physical_padding_mask(
    logical: torch.Tensor | None, request: PaddedRequest
) -> torch.Tensor | None:
    """Flash attention's 2-D padding mask for the view (None when nothing is padding)."""
    if logical is None:
        return None
    tail = logical[:, request.tail_start :].bool()
    if bool(tail.all()):
        return None
    packed = tail.new_ones(tail.shape[0], request.packed_length)
    return torch.cat([packed, tail], dim=-1)
