"""transformers' ``keys``/``values`` attributes on a layer that may be compressed.

transformers' code and users read ``layer.keys`` as ``[batch, kv_heads, tokens, head_dim]``
(e.g. to check a cache's shapes, or ``to_legacy_cache``). A compressed layer has no such tensor:
it is built from the store when read, holding what the store holds. kvpatch reads the store
itself, never these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpatch.cache.store import CompressedStore


class HeldTensors:
    """``keys``/``values``: the layer's dense tensors until it is compressed, then what its store
    holds in order, pruned channels as zeros: the packed tokens (a shorter head's followed by
    rows of zeros up to the longest), then the full-width tail. A view when every head is
    stored dense, else a copy made when read."""

    store: CompressedStore | None
    _keys: torch.Tensor | None
    _values: torch.Tensor | None

    @property
    def keys(self) -> torch.Tensor | None:
        store = getattr(self, "store", None)  # None while transformers' __init__ runs
        return self._keys if store is None else store.dense()[0]

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        self._keys = keys  # the dense tensor; a compressed layer's tokens are its store's

    @property
    def values(self) -> torch.Tensor | None:
        store = getattr(self, "store", None)
        return self._values if store is None else store.dense()[1]

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        self._values = values

    def full_width_keys(self) -> torch.Tensor:
        """The keys held at full width, without a copy: all of them while dense, the store's
        tail once compressed (their batch rows, heads, dtype and device are the layer's)."""
        return self._keys if self.store is None else self.store.tail()[0]
