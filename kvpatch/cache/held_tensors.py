"""transformers' ``keys``/``values`` attributes on a layer that may be compressed.

transformers' code and users read ``layer.keys`` as ``[batch, kv_heads, tokens, head_dim]``,
token ``i`` at index ``i`` (e.g. to check a cache's shapes, or ``to_legacy_cache``). A
compressed layer holds no such tensor: it is built from the store when read, each held token at
its logical position, rows of zeros for the positions a head does not hold (evicted, or padding)
and for pruned channels. kvpatch reads the store itself, never these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpatch.cache.store import CompressedStore


class HeldTensors:
    """``keys``/``values``: the layer's dense tensors until it is compressed, then what its store
    holds laid out by logical position (see the module's docstring): a view when every position
    is held at full width, else a copy made when read."""

    store: CompressedStore | None
    _keys: torch.Tensor | None
    _values: torch.Tensor | None

    @property
    def keys(self) -> torch.Tensor | None:
        store = getattr(self, "store", None)  # None while transformers' __init__ runs
        return self._keys if store is None else by_position(store, store.dense()[0])

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        self._keys = keys  # the dense tensor; a compressed layer's tokens are its store's

    @property
    def values(self) -> torch.Tensor | None:
        store = getattr(self, "store", None)
        return self._values if store is None else by_position(store, store.dense()[1])

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        self._values = values

    def full_width_keys(self) -> torch.Tensor:
        """The keys held at full width, without a copy: all of them while dense, the store's
        tail once compressed (their batch rows, heads, dtype and device are the layer's)."""
        return self._keys if self.store is None else self.store.tail()[0]


def by_position(store: CompressedStore, slots: torch.Tensor) -> torch.Tensor:
    """``slots`` (the store's :meth:`~CompressedStore.dense` layout) moved to their logical
    positions ``[batch, kv_heads, end, dim]``, zeros where a head holds no token."""
    valid, end = store.slot_valid(), store.end
    if slots.shape[-2] == end and bool(valid.all()):
        return slots  # every position held, in order
    # slots that hold no token go to one position past the end, cut off after
    index = store.slot_positions().masked_fill(~valid, end)
    b, h, _, dim = slots.shape
    out = slots.new_zeros(b, h, end + 1, dim)
    out.scatter_(2, index[..., None].expand(-1, -1, -1, dim), slots)
    return out[:, :, :end]
