"""Which logical positions the packed tokens of a layer are.

A record takes the smaller of two forms: a bit mask over the compressed range, uint8 ``[batch,
kv_heads, ceil(length / 8)]`` (a bit a position seen), or the int32 ``[total_kept]`` position of
each packed token in packing order (4 bytes a token kept). A long generation with a decode budget
sees far more than it keeps, and takes the second.
"""

from __future__ import annotations

import torch


def _bits(device: torch.device) -> torch.Tensor:
    """The 8 bit values of a byte, made where they are used: a tensor built at import would be
    built on whatever default device is active then (a meta device inside ``from_pretrained``)."""
    return 2 ** torch.arange(8, dtype=torch.uint8, device=device)


def make(keep: torch.Tensor, positions: torch.Tensor, length: int, as_list: bool) -> torch.Tensor:
    """The record of the ``keep`` slots ``[batch, kv_heads, slots]`` at ``positions`` (all below
    ``length``): a list if ``as_list``, else in its smaller form."""
    b, h, _ = keep.shape
    kept = positions[keep]
    if as_list or 32 * kept.numel() < b * h * length:
        return kept.to(torch.int32)
    mask = torch.zeros(b * h, length, dtype=torch.bool, device=keep.device)
    heads = torch.arange(b * h, device=keep.device).view(b, h, 1).expand_as(keep)[keep]
    mask[heads, kept] = True
    return _pack_bits(mask.view(b, h, length))


def is_mask(record: torch.Tensor) -> bool:
    return record.dtype == torch.uint8


def positions(record: torch.Tensor) -> torch.Tensor:
    """Long ``[total_kept]``: the logical position of each packed token, in packing order."""
    if is_mask(record):
        return _unpack_bits(record).nonzero()[:, -1]  # row-major: in packing order
    return record.long()


def padded_positions(record: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Long ``[batch, kv_heads, width]``: the positions each head of a mask record holds, in
    order, 0 after its ``lengths`` tokens. A stable sort of the mask, not ``nonzero``, whose
    output shape would depend on the mask's values (which ``torch.compile`` cannot trace)."""
    held = _unpack_bits(record)
    order = torch.sort((~held).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    slots = torch.arange(width, device=record.device)
    return order.masked_fill(slots >= lengths[..., None], 0)


def kept_mask(record: torch.Tensor, lengths: torch.Tensor, length: int) -> torch.Tensor:
    """Bool ``[batch, kv_heads, length]``: which logical positions each head holds; ``lengths``
    ``[batch, kv_heads]`` are the tokens each head holds."""
    b, h = lengths.shape
    mask = torch.zeros(b * h, length, dtype=torch.bool, device=lengths.device)
    if is_mask(record):
        held = _unpack_bits(record)
        end = min(length, held.shape[-1])
        mask.view(b, h, length)[..., :end] = held[..., :end]
        return mask.view(b, h, length)
    heads = torch.repeat_interleave(torch.arange(b * h, device=lengths.device), lengths.flatten())
    mask[heads, record.long()] = True
    return mask.view(b, h, length)


def select(record: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The record of batch rows ``rows``, whose packed tokens are ``index``."""
    return record[rows] if is_mask(record) else record[index]


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., n]`` as uint8 ``[..., ceil(n / 8)]``; bit ``i`` of byte ``j`` is position
    ``8 j + i``."""
    padded = torch.nn.functional.pad(mask, (0, -mask.shape[-1] % 8)).to(torch.uint8)
    grouped = padded.view(*mask.shape[:-1], -1, 8)
    return (grouped * _bits(mask.device)).sum(-1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The bool ``[..., 8 * bytes]`` mask of :func:`_pack_bits` (trailing positions False)."""
    bits = packed[..., None] & _bits(packed.device)
    return (bits != 0).flatten(-2)
