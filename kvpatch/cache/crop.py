"""Forgetting a compressed layer's last tokens (``crop``), wherever they are held.

Assisted decoding crops after every verification: the main model's rejected candidates are in
the tail, but a draft model's cache is cropped one token into what its prefill kept (transformers
feeds the draft its last accepted token again). Tokens of the tail are dropped in place; a crop
that reaches into the packed part keeps, of each head, the tokens it held before the new end.
"""

from __future__ import annotations

from kvpatch.cache.packed import PackedKV
from kvpatch.cache.store import CompressedStore


def crop(store: CompressedStore, remove: int) -> CompressedStore:
    """``store`` without its last ``remove`` logical tokens (at most every token it has seen):
    the same store, truncated, when they are all in the tail, else a new one."""
    if remove <= store.tail_length or not isinstance(store, CompressedStore):
        store.truncate_tail(remove)  # a shared context refuses a crop into the context
        return store
    if store.quantization is not None:  # its codes would be quantized a second time
        raise ValueError(
            f"cannot crop {remove} tokens from a quantized cache: only the {store.tail_length} "
            "tokens after its compressed part can be removed (use a cache without quantize)"
        )
    end = store.end - remove
    keys, values = store.dense()
    positions = store.slot_positions()
    keep = store.slot_valid() & (positions < end)
    packed = PackedKV.pack(
        keys,
        values,
        keep,
        store.packed.channels,
        positions,
        end,
        value_channels=store.packed.value_channels,
    )
    empty_keys, empty_values = keys[..., :0, :], values[..., :0, :]
    return CompressedStore(
        packed, empty_keys, empty_values, end, store.tail_valid[:, :0], store.keys.reserve
    )
