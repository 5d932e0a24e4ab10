"""What a :class:`~kvpatch.cache.CompressedLayer` asks of the attention function that reads the
keys its ``update`` returns: one typed request per kind of read.

transformers calls the cache's ``update`` and then the attention function with what it returned,
and nothing of kvpatch's runs between them. The layer posts its request here (:func:`post`),
tied to the very key tensor it returns; the attention function takes the request for the keys it
is given (:func:`take`): keys that were not posted (a stock cache's, a sliding layer's) have none,
and a request is read once. Posts are per thread (``kvpatch bench`` runs several ``generate``
calls side by side) and hold the keys weakly (a posted view is freed with its forward).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvpatch.cache.budget import DecodeBudget
    from kvpatch.cache.packed import PackedKV
    from kvpatch.cache.reconstruction_chunk import ReconstructionChunk
    from kvpatch.policies import LayerInputs, Plan, Policy


class RequestingLayer(Protocol):
    """What the attention function asks of the layer that posted a request (a
    :class:`~kvpatch.cache.CompressedLayer`)."""

    store: HeldStore | None

    def compress(
        self,
        policy: Policy | None,
        inputs: LayerInputs,
        decode_budget: DecodeBudget | None = None,
        plan: Plan | None = None,
    ) -> None: ...

    def defer(
        self, policy: Policy, inputs: LayerInputs, decode_budget: DecodeBudget | None = None
    ) -> None: ...

    def remember_queries(self, queries: torch.Tensor) -> None: ...

    def remember_hidden_states(self, hidden: torch.Tensor | None) -> None: ...

    def record_reconstruction_scores(self, attention: torch.Tensor) -> None: ...


class HeldStore(Protocol):
    """What the attention function reads of a store (a
    :class:`~kvpatch.cache.store.CompressedStore`, or a
    :class:`~kvpatch.cache.shared_context.SharedContextStore`)."""

    packed: PackedKV
    tail_start: int

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def padded_view(self, layer: RequestingLayer) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class PrefillRequest:
    """The keys of a layer's first forward: attend with the stock kernel, then compress.

    ``policy`` is the cache's own policy, which overrides the model's; ``sink_tokens`` and
    ``recent_tokens`` the cache's leading and trailing tokens to keep; ``prompt_tokens``, if
    set, how many of the forward's tokens are compressed (the others, assisted decoding's
    candidates, stay in the tail);
    ``keep_tokens``, if set, how many each head keeps instead of the policy's ratio.
    """

    layer: RequestingLayer
    policy: Policy | None = None
    decode_budget: DecodeBudget | None = None
    sink_tokens: int = 0
    recent_tokens: int = 0
    prompt_tokens: int | None = None
    keep_tokens: int | None = None


@dataclass
class ReconstructionRequest:
    """The keys of a layer during a reconstruction chunk: what it holds, then the chunk.

    The held columns from ``scored_from`` on are the tokens being scored; ``held_valid``
    ``[batch, 1 or kv_heads, held]`` marks the real ones.
    """

    layer: RequestingLayer
    chunk: ReconstructionChunk
    held_valid: torch.Tensor
    scored_from: int


@dataclass
class PaddedRequest:
    """A compressed layer laid out as a padded view: fake keys in the padding slots.

    Columns ``[0, packed_length)`` are the packed block: head ``(b, h)`` holds
    ``lengths[b, h]`` real tokens there, the rest are padding slots. Columns from
    ``packed_length`` on are the tail, whose first token has logical position ``tail_start``.
    """

    layer: RequestingLayer
    lengths: torch.Tensor
    packed_length: int
    tail_start: int
    #: ``[batch, kv_heads]``, at least the largest norm of a held key: asked for only where fake
    #: keys are written (measuring the keys reads their values, which a traced step avoids)
    key_norm_bound: Callable[[], torch.Tensor]
    #: ``(rows, heads, slots)`` of the padding slots, asked for only where fake keys are written
    #: (found from the lengths' values); None when every head is ``packed_length`` long
    padding_slots: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None


@dataclass
class PackedRequest:
    """The tail of a layer whose packed tokens stay in ``store``: the attention function reads
    them there (:mod:`kvpatch.attention.packed`) or asks the store for a padded view."""

    layer: RequestingLayer
    store: HeldStore


AttentionRequest = PrefillRequest | PaddedRequest | PackedRequest | ReconstructionRequest

_posted = threading.local()


def post(keys: torch.Tensor, request: AttentionRequest) -> torch.Tensor:
    """Tie ``request`` to ``keys`` (what the layer's ``update`` returns); returns ``keys``."""
    _posted.entry = (weakref.ref(keys), request)
    return keys


def peek(keys: torch.Tensor) -> AttentionRequest | None:
    """The request posted for ``keys`` in this thread, left in place; None if there is none."""
    entry = getattr(_posted, "entry", None)
    if entry is None or entry[0]() is not keys:
        return None
    return entry[1]


def take(keys: torch.Tensor) -> AttentionRequest | None:
    """The request posted for ``keys`` in this thread, which is then forgotten; None if none."""
    request = peek(keys)
    if request is not None:
        _posted.entry = None
    return request
