"""How a compressed layer holds its tokens: a packed part and a dense, full-width tail.

The packed part (:class:`~kvpatch.cache.packed.PackedKV`) is what a policy kept of the tokens
before ``tail_start``: variable-length heads, channel-pruned keys and values. The tail is every
token from ``tail_start`` on at full width: a channel policy's recent window, then each token
appended since. Tail tokens live in a :class:`~kvpatch.cache.buffer.GrowingBuffer`, so that
appending a decoded token copies that token only.
"""

from __future__ import annotations

import dataclasses

import torch

from kvpatch.cache.buffer import GrowingBuffer
from kvpatch.cache.packed import PackedKV, storage_nbytes
from kvpatch.cache.quantized import Quantization
from kvpatch.cache.requests import PackedRequest, PaddedRequest, RequestingLayer, post
from kvpatch.policies import Plan


class CompressedStore:
    """The tokens one compressed layer holds.

    Heads of equal length without pruned channels need no packing: their tokens go, dense, at
    the front of the tail's buffer, so that the attention view costs no copy.

    Parameters
    ----------
    packed : what the policy kept of the tokens before ``tail_start``.
    tail_keys, tail_values : ``[batch, kv_heads, tail, dim]``, the tokens from ``tail_start`` on.
    tail_start : logical position of the first tail token.
    tail_valid : bool ``[batch, tail]``, False for padding.
    reserve : room for this many appended tokens in the tail's buffer, which then grows by as
        many at a time (a decode budget's interval); None: spare room as the buffer grows.
    quantization : store the packed tokens as integer codes (the tail stays full precision: the
        residual window of the newest tokens); None: in the model's dtype.
    """

    def __init__(
        self,
        packed: PackedKV,
        tail_keys: torch.Tensor,
        tail_values: torch.Tensor,
        tail_start: int,
        tail_valid: torch.Tensor,
        reserve: int | None = None,
        quantization: Quantization | None = None,
    ):
        b, h = packed.lengths.shape
        self.quantization = quantization
        if quantization is not None:
            packed = packed.quantized(quantization)
        elif packed.is_uniform and packed.channels is None and packed.value_channels is None:
            length = packed.max_length
            dense_keys = packed.keys.view(b, h, length, packed.keys.shape[-1])
            dense_values = packed.values.view(b, h, length, packed.values.shape[-1])
            tail_keys = torch.cat([dense_keys, tail_keys], dim=-2)
            tail_values = torch.cat([dense_values, tail_values], dim=-2)
            packed = packed.without_data()
        self.packed = packed
        self.tail_start = tail_start
        self.tail_valid = tail_valid.clone()
        room = max(self._capacity_limit(0) - tail_keys.shape[-2], 0)  # spare room that is saved
        self.keys = GrowingBuffer.copy_of(tail_keys, reserve, room)
        self.values = GrowingBuffer.copy_of(tail_values, reserve, room)
        # the largest key norm of each head, for fake keys: computed when first asked for, then
        # kept up to date with the buffer's first ``_bounded`` positions
        self._norm_bound: torch.Tensor | None = None
        self._bounded = 0

    @classmethod
    def from_plan(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        plan: Plan,
        valid: torch.Tensor,
        reserve: int | None = None,
        quantization: Quantization | None = None,
    ) -> CompressedStore:
        """What ``plan`` keeps of a prefill's ``keys``/``values``; ``valid`` ``[batch, kv_heads,
        tokens]`` marks its real tokens."""
        if quantization is not None:
            plan = _with_residual(plan, quantization.residual)
        start = plan.full_width_from
        packed = PackedKV.from_plan(keys, values, plan)
        tail_keys, tail_values = keys[..., start:, :], values[..., start:, :]
        tail_valid = valid[:, 0, start:]
        return cls(packed, tail_keys, tail_values, start, tail_valid, reserve, quantization)

    # -- lengths -------------------------------------------------------------------------------

    @property
    def tail_length(self) -> int:
        return self.tail_valid.shape[-1]

    @property
    def end(self) -> int:
        """Logical length: every token seen, kept or not."""
        return self.tail_start + self.tail_length

    def physical_lengths(self) -> torch.Tensor:
        """Tokens held per (batch row, KV head)."""
        return self.packed.lengths + self.tail_length

    def held_per_head(self) -> float:
        """Tokens a head holds on average, in the batch row holding most."""
        return self.packed.mean_length + self.tail_length

    def kept_mask(self) -> torch.Tensor:
        """Bool ``[batch, kv_heads, end]``: which logical positions each head holds."""
        mask = self.packed.kept_mask(self.end)
        mask[..., self.tail_start :] = True
        return mask

    # -- changes -------------------------------------------------------------------------------

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        limit = lambda: self._capacity_limit(keys.shape[-2])  # read only when a buffer grows
        self.keys.append(keys, limit)
        self.values.append(values, limit)
        valid = self.tail_valid.new_ones(keys.shape[0], keys.shape[-2])
        self.tail_valid = torch.cat([self.tail_valid, valid], dim=-1)

    def _capacity_limit(self, appended: int) -> int:
        """The most positions the tail's buffer may hold after appending ``appended`` tokens: as
        many as a ``DynamicCache`` holds (every token seen) less the packed tokens of a head on
        average, so that spare room never outweighs what compression saved."""
        logical = self.end + appended
        if self.packed.keys is None:  # the packed tokens are in the buffer
            return logical
        kept = -(-self.packed.total_length // max(self.packed.lengths.numel(), 1))
        return logical - kept

    def truncate_tail(self, remove: int) -> None:
        """Forget the last ``remove`` tail tokens."""
        if remove > self.tail_length:
            raise ValueError(
                f"cannot crop {remove} tokens: only the {self.tail_length} tokens after the "
                "compressed part of the cache can be removed"
            )
        for block in (self.keys, self.values):
            block.truncate(block.length - remove)
        self._bounded = min(self._bounded, self.keys.length)  # the bound stays an upper bound
        self.tail_valid = self.tail_valid[:, : self.tail_length - remove]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (reordered, repeated or a subset), e.g. for beam search."""
        self.keys.select_rows(rows)
        self.values.select_rows(rows)
        self.packed = self.packed.select_rows(rows)
        if self._norm_bound is not None:
            self._norm_bound = self._norm_bound[rows]
        self.tail_valid = self.tail_valid[rows]

    def to(self, device: torch.device | str) -> None:
        self.keys.to(device)
        self.values.to(device)
        self.packed = self.packed.to(device)
        self.tail_valid = self.tail_valid.to(device)
        if self._norm_bound is not None:
            self._norm_bound = self._norm_bound.to(device)

    def repacked(
        self,
        keep: torch.Tensor,
        full_width: int,
        dense: tuple[torch.Tensor, torch.Tensor] | None = None,
        reserve: int | None = None,
    ) -> CompressedStore:
        """A new store holding the ``keep`` slots ``[batch, kv_heads, slots]`` of :meth:`dense`
        (pass it if already built); the last ``full_width`` tokens (a channel policy's window)
        become the tail."""
        keys, values = dense if dense is not None else self.dense()
        slots = keys.shape[2]
        cut = slots - full_width
        keep = keep[..., :cut]
        tail_start = self.end - full_width
        packed = PackedKV.pack(
            keys[..., :cut, :],
            values[..., :cut, :],
            keep,
            self.packed.channels,
            self.slot_positions()[..., :cut],
            tail_start,
            as_list=reserve is not None,  # a bounded cache: a record that does not grow
            value_channels=self.packed.value_channels,
        )
        tail_valid = self.tail_valid[:, self.tail_length - full_width :]
        tail_keys, tail_values = keys[..., cut:, :], values[..., cut:, :]
        return CompressedStore(
            packed, tail_keys, tail_values, tail_start, tail_valid, reserve, self.quantization
        )

    @property
    def key_norm_bound(self) -> torch.Tensor:
        """``[batch, kv_heads]``: at least the largest norm of a key each head holds."""
        if self._norm_bound is None:
            self._norm_bound = self.packed.max_key_norms()
        held = self.keys.length
        if held > self._bounded:
            norms = self.keys.view()[:, :, self._bounded :].float().norm(dim=-1).amax(dim=-1)
            self._norm_bound = torch.maximum(self._norm_bound, norms)
            self._bounded = held
        return self._norm_bound

    # -- reading -------------------------------------------------------------------------------

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tail's keys and values, views of the buffers."""
        keys, values = self.keys.view(), self.values.view()
        start = keys.shape[-2] - self.tail_length
        return keys[..., start:, :], values[..., start:, :]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed tokens (padded per head, pruned channels as zeros) followed by the tail; a view,
        not a copy, when the packed tokens are stored dense."""
        if self.packed.keys is None:
            return self.keys.view(), self.values.view()
        tail_keys, tail_values = self.tail()
        b, h = self.packed.lengths.shape
        length, tail = self.packed.max_length, self.tail_length
        keys = tail_keys.new_empty(b, h, length + tail, self.packed.head_dim)
        values = tail_values.new_empty(b, h, length + tail, tail_values.shape[-1])
        self.packed.write_into(keys, values)
        keys[:, :, length:] = tail_keys
        values[:, :, length:] = tail_values
        return keys, values

    def attention_view(self, layer: RequestingLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer's ``update`` returns: the padded view when it costs no copy (every token
        stored dense), else the tail posted with a :class:`~kvpatch.cache.requests.PackedRequest`:
        the attention function reads the packed tokens in place or asks for :meth:`padded_view`."""
        if self.packed.keys is None:
            return self.padded_view(layer)
        keys, values = self.tail()
        return post(keys, PackedRequest(layer, self)), values

    def padded_view(self, layer: RequestingLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`dense`, posted with the :class:`~kvpatch.cache.requests.PaddedRequest` that the
        attention function reads."""
        keys, values = self.dense()
        packed = self.packed
        request = PaddedRequest(
            layer=layer,
            lengths=packed.lengths,
            packed_length=packed.max_length,
            tail_start=self.tail_start,
            key_norm_bound=lambda: self.key_norm_bound,
            padding_slots=None if packed.is_uniform else lambda: packed.padding_slots,
        )
        return post(keys, request), values

    def slot_valid(self) -> torch.Tensor:
        """Bool ``[batch, kv_heads, slots]``: which slots of :meth:`dense` are real tokens."""
        b, h = self.packed.lengths.shape
        packed_slots = torch.arange(self.packed.max_length, device=self.tail_valid.device)
        tail_valid = self.tail_valid[:, None, :].expand(b, h, -1)
        return torch.cat([packed_slots < self.packed.lengths[..., None], tail_valid], dim=-1)

    def slot_positions(self) -> torch.Tensor:
        """Logical position of each slot of :meth:`dense`, ``[batch, kv_heads, slots]``."""
        b, h = self.packed.lengths.shape
        tail = torch.arange(self.tail_start, self.end, device=self.tail_valid.device)
        return torch.cat([self.packed.slot_positions(), tail.expand(b, h, -1)], -1)

    def nbytes(self) -> int:
        """Bytes of every tensor held (storages, spare capacity included)."""
        index = storage_nbytes(self._norm_bound, self.tail_valid)
        return index + self.packed.nbytes() + storage_nbytes(self.keys.data, self.values.data)

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values alone (the buffers' spare room included)."""
        return self.packed.kv_nbytes() + storage_nbytes(self.keys.data, self.values.data)


def _with_residual(plan: Plan, residual: int) -> Plan:
    """``plan`` with up to ``residual`` more of its newest tokens at full width (and so at full
    precision, in the tail): those every head keeps, when no channel is pruned."""
    if plan.channels is not None or plan.value_channels is not None:
        return plan  # a channel policy's full-width window is the residual
    start = plan.full_width_from
    kept_by_all = plan.keep[..., :start].flatten(0, 1).all(dim=0)
    lost = (~kept_by_all).nonzero()
    first_of_suffix = int(lost[-1]) + 1 if lost.numel() else 0
    return dataclasses.replace(plan, full_width_from=max(first_of_suffix, start - residual))
