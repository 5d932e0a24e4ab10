"""Packed storage of the compressed part of one layer's cache.

Every (batch row, KV head) keeps its own number of tokens. Their keys and values are stored
back to back in row-major (row, head, position) order, with no padding; keys and values hold
only the kept channels of their head.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from kvpatch.cache import record
from kvpatch.cache.quantized import (
    Quantization,
    QuantizedRows,
    quantize_per_channel,
    quantize_per_token,
)
from kvpatch.policies.contract import Plan

#: on CPU, up to this many (batch row, KV head) pairs, the padded layout is written with one slice
#: copy per head (memory-copy speed); beyond, and on accelerators (where each copy is a kernel
#: launch), with one indexed copy
SLICE_COPY_HEADS = 64


def storage_nbytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class computed_once:  # lower case: used like functools.cached_property
    """``functools.cached_property`` without its lock (Python < 3.12 takes an ``RLock`` on first
    access, which ``torch.compile`` cannot trace: a graph break in every decode step). The value
    is stored in the instance's ``__dict__``, which later reads find first."""

    def __init__(self, compute):
        self.compute, self.name = compute, compute.__name__
        self.__doc__ = compute.__doc__

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = self.compute(instance)
        instance.__dict__[self.name] = value
        return value


@dataclass
class PackedKV:
    """Variable-length, channel-pruned keys and values of one layer.

    Attributes
    ----------
    keys : ``[total_kept, kept_channels]``, or None when the layer keeps them elsewhere (uniform
        full-width heads are stored as one dense block with the tail); integer codes
        (:class:`~kvpatch.cache.quantized.QuantizedRows`) in a quantized cache
    values : ``[total_kept, kept_value_channels]``, or None likewise
    lengths : long ``[batch, kv_heads]``, tokens held by each head
    channels : long ``[batch, kv_heads, kept_channels]`` or None when every key channel is kept
    record : which logical positions the packed tokens are (:mod:`kvpatch.cache.record`)
    head_dim, value_dim : full key and value widths, to re-insert pruned channels
    value_channels : long ``[batch, kv_heads, kept_value_channels]`` or None when every value
        channel is kept
    """

    keys: torch.Tensor | QuantizedRows | None
    values: torch.Tensor | QuantizedRows | None
    lengths: torch.Tensor
    channels: torch.Tensor | None
    record: torch.Tensor
    head_dim: int
    value_dim: int
    value_channels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # What every decode step reads of the packed part's shape, measured here, where the
        # cache compresses, from one read of the lengths (one sync on an accelerator): a step
        # that measured it would read tensor values, which torch.compile cannot trace (it would
        # break the graph, or run the step eagerly).
        rows = self.lengths.tolist()
        counts = [count for row in rows for count in row]
        #: tokens held by every head together
        self.total_length: int = sum(counts)
        #: tokens held by the longest head (the padded layout's width)
        self.max_length: int = max(counts, default=0)
        #: tokens a head holds on average, in the batch row holding most
        self.mean_length: float = max((sum(row) / len(row) for row in rows if row), default=0.0)
        #: whether every head holds the same number of tokens (then packing is a plain reshape)
        self.is_uniform: bool = len(set(counts)) <= 1
        #: ``(first packed row, tokens)`` of each (batch row, KV head), in row-major order
        self.segments: list[tuple[int, int]] = list(
            zip(itertools.accumulate([0, *counts[:-1]]), counts, strict=True)
        )

    def destinations(self, width: int) -> torch.Tensor:
        """Flat index of each packed row in a padded ``[batch * kv_heads * width]`` grid."""
        counts = self.lengths.flatten()
        heads = torch.arange(counts.numel(), device=counts.device)
        row_start = heads * width - (counts.cumsum(0) - counts)
        rows = torch.repeat_interleave(row_start, counts, output_size=self.keys.shape[0])
        return rows + torch.arange(self.keys.shape[0], device=counts.device)

    @classmethod
    def pack(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        keep: torch.Tensor,
        channels: torch.Tensor | None,
        positions: torch.Tensor,
        length: int,
        as_list: bool = False,
        value_channels: torch.Tensor | None = None,
    ) -> PackedKV:
        """Pack the ``keep`` slots of full-width ``[batch, kv_heads, slots, dim]`` keys/values,
        the ``channels`` and ``value_channels`` of each head only; ``positions`` ``[batch,
        kv_heads, slots]`` are the slots' logical positions, all below ``length``. ``as_list``:
        record them as a list whatever its size (a bounded cache, whose record then stays the
        same size however long it decodes)."""
        return cls(
            keys=gather_channels(keys, channels)[keep],
            values=gather_channels(values, value_channels)[keep],
            lengths=keep.sum(-1),
            channels=channels,
            record=record.make(keep, positions, length, as_list),
            head_dim=keys.shape[-1],
            value_dim=values.shape[-1],
            value_channels=value_channels,
        )

    @classmethod
    def from_plan(cls, keys: torch.Tensor, values: torch.Tensor, plan: Plan) -> PackedKV:
        """Pack the prefill tokens before ``plan.full_width_from`` that ``plan.keep`` keeps."""
        end = plan.full_width_from
        keep = plan.keep[..., :end]
        positions = torch.arange(end, device=keep.device).expand_as(keep)
        keys, values = keys[..., :end, :], values[..., :end, :]
        return cls.pack(
            keys, values, keep, plan.channels, positions, end, value_channels=plan.value_channels
        )

    def quantized(self, quantization: Quantization) -> PackedKV:
        """The same tokens with keys quantized per channel and values per token."""
        bits = quantization.bits
        keys = quantize_per_channel(self.keys, self.lengths, bits, quantization.key_group)
        return replace(self, keys=keys, values=quantize_per_token(self.values, bits))

    @property
    def is_quantized(self) -> bool:
        return isinstance(self.keys, QuantizedRows)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[total_kept, channels]`` in the model's dtype (decoded from their
        integer codes, a transient copy, in a quantized cache)."""
        if not self.is_quantized:
            return self.keys, self.values
        return self.keys.dequantize(self.lengths), self.values.dequantize(self.lengths)

    def segment_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(keys, values)`` of each (batch row, KV head) in row-major order: views of the packed
        tensors (kept from one step to the next), or of their transient decoding if quantized."""
        if not self.is_quantized:
            return self._segment_views
        return self._views_of(*self.rows())

    @computed_once
    def _segment_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._views_of(self.keys, self.values)

    def _views_of(self, keys, values) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(keys[i : i + n], values[i : i + n]) for i, n in self.segments]

    @computed_once
    def padding_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, heads, slots)`` of the padding slots of the padded layout (the slots from
        each head's length up to ``max_length``)."""
        slots = torch.arange(self.max_length, device=self.lengths.device)
        return (slots >= self.lengths[..., None]).nonzero(as_tuple=True)

    def _lay_out(self, flat: torch.Tensor, target: torch.Tensor) -> None:
        """Write ``flat`` rows into ``target`` ``[batch * kv_heads, width, dim]``: each head's rows
        first, zeros up to ``max_length``; the rest of ``width`` is left alone."""
        length = self.max_length
        if self.is_uniform:
            target[:, :length] = flat.view(target.shape[0], length, flat.shape[-1])
        elif flat.device.type == "cpu" and self.lengths.numel() <= SLICE_COPY_HEADS:
            for head, (start, count) in enumerate(self.segments):
                target[head, :count] = flat[start : start + count]
                target[head, count:length] = 0
        else:
            target[:, :length] = 0
            rows = target.view(-1, target.shape[-1])  # contiguous: raises otherwise
            rows.index_copy_(0, self.destinations(target.shape[1]), flat)

    def padded_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept keys and values (kept channels only) laid out ``[batch, kv_heads,
        max_length, channels]``, zeros after each head's tokens: one copy, no loop over heads
        off the CPU."""
        keys, values = self.rows()
        return self._padded(keys), self._padded(values)

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """Lay ``flat`` rows out as ``[batch, kv_heads, max_length, dim]``, zero after each head."""
        b, h = self.lengths.shape
        if self.is_uniform:
            return flat.view(b, h, self.max_length, flat.shape[-1])
        grid = flat.new_empty(b * h, self.max_length, flat.shape[-1])
        self._lay_out(flat, grid)
        return grid.view(b, h, self.max_length, flat.shape[-1])

    def write_into(self, keys: torch.Tensor, values: torch.Tensor, rows=None) -> None:
        """Write the padded, full-width layout into the first ``max_length`` positions of
        contiguous ``keys`` ``[batch, kv_heads, width, head_dim]`` and ``values``; ``rows``:
        :meth:`rows`, if already at hand."""
        packed_keys, packed_values = rows or self.rows()
        self._write(packed_keys, self.channels, keys)
        self._write(packed_values, self.value_channels, values)

    def _write(self, flat: torch.Tensor, channels: torch.Tensor | None, target: torch.Tensor):
        """One of :meth:`write_into`'s tensors, pruned channels re-inserted as zeros."""
        b, h, width, dim = target.shape  # explicit dims: a view of no elements infers none
        if channels is None:
            self._lay_out(flat, target.view(b * h, width, dim))
            return
        packed = self._padded(flat)
        block = target[:, :, : self.max_length]
        block.zero_()
        block.scatter_(-1, channels[:, :, None, :].expand_as(packed), packed)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at full width (pruned channels as zeros), padded per head with
        zeros."""
        b, h = self.lengths.shape
        rows = self.rows()  # decoded once in a quantized cache
        keys = rows[0].new_empty(b, h, self.max_length, self.head_dim)
        values = rows[1].new_empty(b, h, self.max_length, self.value_dim)
        self.write_into(keys, values, rows)
        return keys, values

    def max_key_norms(self) -> torch.Tensor:
        """Largest key norm held by each head, ``[batch, kv_heads]`` (0 for an empty head, or
        when the keys are stored elsewhere)."""
        b, h = self.lengths.shape
        if self.keys is None:
            return torch.zeros(b, h, device=self.lengths.device)
        norms = self.rows()[0].float().norm(dim=-1)
        head = torch.repeat_interleave(
            torch.arange(b * h, device=norms.device), self.lengths.flatten()
        )
        bound = norms.new_zeros(b * h).scatter_reduce_(0, head, norms, "amax")
        return bound.view(b, h)

    def without_data(self) -> PackedKV:
        """The same bookkeeping with the keys and values kept elsewhere."""
        return replace(self, keys=None, values=None)

    def slot_positions(self) -> torch.Tensor:
        """Logical position of every slot of :meth:`dense`, ``[batch, kv_heads, max_length]``
        (0 in padding slots)."""
        if record.is_mask(self.record):  # read in place: no shape that depends on the values
            return record.padded_positions(self.record, self.lengths, self.max_length)
        return self._padded(record.positions(self.record)[:, None]).squeeze(-1)

    def kept_mask(self, length: int) -> torch.Tensor:
        """Bool ``[batch, kv_heads, length]``: which logical positions each head holds here."""
        return record.kept_mask(self.record, self.lengths, length)

    def select_rows(self, rows: torch.Tensor) -> PackedKV:
        """The same storage for batch rows ``rows`` (reordered, repeated or a subset)."""
        rows = rows.to(self.lengths.device)
        per_row = self.lengths.sum(-1)
        starts = per_row.cumsum(0) - per_row
        counts = per_row[rows]
        offset = torch.repeat_interleave(starts[rows] - (counts.cumsum(0) - counts), counts)
        index = torch.arange(int(counts.sum()), device=rows.device) + offset

        def per_token(t):
            if isinstance(t, QuantizedRows):
                return t.select(index, rows)  # codes by token, per-channel scales by row
            return None if t is None else t[index]

        per_head = lambda t: None if t is None else t[rows]
        return replace(
            self,
            keys=per_token(self.keys),
            values=per_token(self.values),
            lengths=self.lengths[rows],
            channels=per_head(self.channels),
            record=record.select(self.record, rows, index),
            value_channels=per_head(self.value_channels),
        )

    def nbytes(self) -> int:
        """Bytes of every tensor held: the keys and values, their index, and the padding slots
        once a padded view has asked for them."""
        slots = self.__dict__.get("padding_slots", ())
        index = storage_nbytes(self.lengths, self.channels, self.value_channels, self.record)
        return index + storage_nbytes(*slots) + self.kv_nbytes()

    def kv_nbytes(self) -> int:
        """Bytes of the packed keys and values alone (codes and scales if quantized)."""
        rows = [
            r.tensors() if isinstance(r, QuantizedRows) else [r] for r in (self.keys, self.values)
        ]
        return storage_nbytes(*rows[0], *rows[1])

    def to(self, device: torch.device | str) -> PackedKV:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return replace(self, **{name: move(getattr(self, name)) for name in _TENSOR_FIELDS})


_TENSOR_FIELDS = ("keys", "values", "lengths", "channels", "record", "value_channels")


def gather_channels(x: torch.Tensor, channels: torch.Tensor | None) -> torch.Tensor:
    """The ``channels`` ``[batch, kv_heads, kept]`` of ``x`` ``[batch, kv_heads, slots, dim]``."""
    if channels is None:
        return x
    b, h, slots, _ = x.shape
    return x.gather(-1, channels[:, :, None, :].expand(b, h, slots, channels.shape[-1]))
