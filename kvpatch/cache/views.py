"""What a :class:`~kvpatch.cache.CompressedLayer` tells the attention function about the keys it
returns.

A layer's ``update`` returns keys; the attention function registered by kvpatch needs to know
what they are (a prefill to compress after attending, a packed layout with padding slots, a
reconstruction chunk). The description travels as an attribute of the returned key tensor, so
that transformers' code between the two needs no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpatch.cache.decode import DecodeBudget
    from kvpatch.cache.layer import CompressedLayer
    from kvpatch.cache.replay_chunk import ReplayChunk
    from kvpatch.cache.store import CompressedStore
    from kvpatch.policies import Policy

_VIEW_ATTRIBUTE = "_kvpatch_view"


@dataclass
class PrefillView:
    """Marks the keys of a layer's first forward: compress after attending.

    ``policy`` is the cache's own policy, which overrides the model's; ``sink_tokens`` the
    cache's leading tokens to keep; ``prompt_tokens``, if set, how many of the forward's tokens
    are compressed (the others, assisted decoding's candidates, stay in the tail);
    ``keep_tokens``, if set, how many each head keeps instead of the policy's ratio.
    """

    layer: CompressedLayer
    policy: Policy | None = None
    decode_budget: DecodeBudget | None = None
    sink_tokens: int = 0
    prompt_tokens: int | None = None
    keep_tokens: int | None = None


@dataclass
class ReplayView:
    """Marks the keys of a layer during a reconstruction chunk: what it holds, then the chunk.

    The held columns from ``scored_from`` on are the tokens being scored; ``held_valid``
    ``[batch, 1 or kv_heads, held]`` marks the real ones.
    """

    layer: CompressedLayer
    chunk: ReplayChunk
    held_valid: torch.Tensor
    scored_from: int


@dataclass
class CompressedView:
    """Describes the dense view returned for a compressed layer.

    Columns ``[0, packed_length)`` are the packed block: head ``(b, h)`` holds
    ``lengths[b, h]`` real tokens there, the rest are padding slots. Columns from
    ``packed_length`` on are the tail, whose first token has logical position ``tail_start``.
    """

    layer: CompressedLayer
    lengths: torch.Tensor
    packed_length: int
    tail_start: int
    key_norm_bound: torch.Tensor  # [batch, kv_heads], largest norm of a held key
    #: ``(rows, heads, slots)`` of the padding slots; None when every head is ``packed_length`` long
    padding_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


@dataclass
class PackedView:
    """Marks the tail of a layer whose packed tokens stay in ``store``: the attention function
    reads them there (:mod:`kvpatch.packed_attention`) or asks the store for its padded view."""

    layer: CompressedLayer
    store: CompressedStore


View = PrefillView | CompressedView | PackedView | ReplayView


def mark(keys: torch.Tensor, view: View) -> torch.Tensor:
    setattr(keys, _VIEW_ATTRIBUTE, view)
    return keys


def view_of(keys: torch.Tensor) -> View | None:
    """The kvpatch description attached to keys returned by a :class:`CompressedLayer`, if any."""
    return getattr(keys, _VIEW_ATTRIBUTE, None)
