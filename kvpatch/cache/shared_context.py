"""One compressed context read by many batch rows: many questions answered in one batch.

:func:`share_context` turns the cache of a context of one batch row into a cache for ``rows``
rows that continue it. Each compressed layer's store (packed tokens and tail) stays where it is,
shared and never written; every row appends its own tokens (a question, then its answer) to a
tail of its own. :mod:`kvpatch.attention.packed` reads each KV head's context part once per step
for all the rows' queries; the padded view other backends read is a per-row copy.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch

from kvpatch.cache.buffer import GrowingBuffer
from kvpatch.cache.layer import CompressedLayer
from kvpatch.cache.packed import PackedKV, storage_nbytes
from kvpatch.cache.requests import PackedRequest, PaddedRequest, RequestingLayer, post
from kvpatch.cache.store import CompressedStore

if TYPE_CHECKING:
    from kvpatch.cache.dynamic import CompressedDynamicCache


def can_share(cache: CompressedDynamicCache) -> bool:
    """Whether :func:`share_context` serves ``cache``: a context of one batch row whose layers do
    not compress again while decoding (a decode budget rewrites what it holds)."""
    if cache.decode_budget is not None:
        return False
    for layer in cache.compressed_layers:
        if layer.setup is not None and layer.setup.decode_budget is not None:
            return False
        if layer.is_initialized and layer.full_width_keys().shape[0] != 1:
            return False
    return True


def share_context(cache: CompressedDynamicCache, rows: int) -> CompressedDynamicCache:
    """A cache for ``rows`` batch rows that all continue ``cache`` (one batch row, left as it
    is). Compressed layers read its stores in place; other layers (sliding windows, layers kept
    whole) are repeated per row."""
    if not can_share(cache):
        raise ValueError("only a cache of one batch row without a decode budget can be shared")
    shared = copy.copy(cache)
    shared.layers = [_shared_layer(layer, rows) for layer in cache.layers]
    return shared


def _shared_layer(layer, rows: int):
    shared = copy.copy(layer)
    if isinstance(layer, CompressedLayer) and layer.store is not None:
        shared.store = SharedContextStore(layer.store, rows)
        offset = layer.setup.position_offset.expand(rows).clone()
        shared.setup = dataclasses.replace(layer.setup, position_offset=offset)
        shared.recent_queries = shared.segment_queries = None
        shared.token_scores = None  # the rows' tails are never compressed: no scores needed
    elif getattr(layer, "is_initialized", False):
        shared.batch_repeat_interleave(rows)  # assigns new tensors: ``layer`` keeps its own
    return shared


class SharedContextStore:
    """A :class:`~kvpatch.cache.store.CompressedStore` of one batch row (``context``), read by
    ``rows`` batch rows, each with its own full-width tail after it.

    It answers what a layer and the attention function ask of a store; the context is never
    written (cropping and beam reordering act on the rows' tails).
    """

    quantization = None

    def __init__(self, context: CompressedStore, rows: int):
        self.context = context
        keys, values = context.keys.data, context.values.data
        self.keys = GrowingBuffer(keys.new_empty(rows, keys.shape[1], 0, keys.shape[-1]))
        self.values = GrowingBuffer(values.new_empty(rows, values.shape[1], 0, values.shape[-1]))
        self.tail_start = context.end
        self.tail_valid = context.tail_valid.new_ones(rows, 0)

    @property
    def packed(self) -> PackedKV:
        """The context's packed part (one batch row)."""
        return self.context.packed

    @property
    def rows(self) -> int:
        return self.tail_valid.shape[0]

    @property
    def tail_length(self) -> int:
        return self.tail_valid.shape[-1]

    @property
    def end(self) -> int:
        return self.tail_start + self.tail_length

    def physical_lengths(self) -> torch.Tensor:
        return self.context.physical_lengths().expand(self.rows, -1) + self.tail_length

    def held_per_head(self) -> float:
        return self.context.held_per_head() + self.tail_length

    def kept_mask(self) -> torch.Tensor:
        context = self.context.kept_mask().expand(self.rows, -1, -1)
        return torch.cat([context, context.new_ones(*context.shape[:2], self.tail_length)], -1)

    # -- changes: the rows' tails only ---------------------------------------------------------

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys.append(keys)
        self.values.append(values)
        valid = self.tail_valid.new_ones(keys.shape[0], keys.shape[-2])
        self.tail_valid = torch.cat([self.tail_valid, valid], dim=-1)

    def truncate_tail(self, remove: int) -> None:
        if remove > self.tail_length:
            raise ValueError(
                f"cannot crop {remove} tokens: only the {self.tail_length} tokens after the "
                "shared context can be removed"
            )
        for block in (self.keys, self.values):
            block.truncate(block.length - remove)
        self.tail_valid = self.tail_valid[:, : self.tail_length - remove]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys.select_rows(rows)
        self.values.select_rows(rows)
        self.tail_valid = self.tail_valid[rows]

    def to(self, device: torch.device | str) -> None:
        raise ValueError(
            "a cache whose rows share one compressed context cannot move between devices"
        )

    # -- reading -------------------------------------------------------------------------------

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.view(), self.values.view()

    def attention_view(self, layer: RequestingLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' tails, posted with a :class:`~kvpatch.cache.requests.PackedRequest`: the
        attention function reads the context in place, or asks for :meth:`padded_view`."""
        keys, values = self.tail()
        return post(keys, PackedRequest(layer, self)), values

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's padded view repeated for every row, then each row's tail: a copy."""
        context_keys, context_values = self.context.dense()
        keys, values = self.tail()
        expand = lambda t: t.expand(self.rows, -1, -1, -1)
        return (
            torch.cat([expand(context_keys), keys], dim=-2),
            torch.cat([expand(context_values), values], dim=-2),
        )

    def padded_view(self, layer: RequestingLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`dense` (a per-row copy of the context, for the stock kernels), posted with the
        :class:`~kvpatch.cache.requests.PaddedRequest` a compressed layer's padded view has."""
        keys, values = self.dense()
        packed = self.packed
        lengths = packed.lengths.expand(self.rows, -1)
        slots = torch.arange(packed.max_length, device=lengths.device)
        find_padding = lambda: (slots >= lengths[..., None]).nonzero(as_tuple=True)
        request = PaddedRequest(
            layer=layer,
            lengths=lengths,
            packed_length=packed.max_length,
            tail_start=self.context.tail_start,
            key_norm_bound=lambda: self.key_norm_bound,
            padding_slots=None if packed.is_uniform else find_padding,
        )
        return post(keys, request), values

    @property
    def key_norm_bound(self) -> torch.Tensor:
        bound = self.context.key_norm_bound.expand(self.rows, -1)
        if not self.tail_length:
            return bound
        return torch.maximum(bound, self.keys.view().float().norm(dim=-1).amax(dim=-1))

    def slot_valid(self) -> torch.Tensor:
        context = self.context.slot_valid().expand(self.rows, -1, -1)
        tail = self.tail_valid[:, None, :].expand(-1, context.shape[1], -1)
        return torch.cat([context, tail], dim=-1)

    def slot_positions(self) -> torch.Tensor:
        context = self.context.slot_positions().expand(self.rows, -1, -1)
        tail = torch.arange(self.tail_start, self.end, device=context.device)
        return torch.cat([context, tail.expand(*context.shape[:2], -1)], dim=-1)

    def nbytes(self) -> int:
        """The context's bytes once, and each row's tail."""
        return self.context.nbytes() + storage_nbytes(self.tail_valid) + self._tail_nbytes()

    def kv_nbytes(self) -> int:
        return self.context.kv_nbytes() + self._tail_nbytes()

    def _tail_nbytes(self) -> int:
        return storage_nbytes(self.keys.data, self.values.data)
