"""What a cache holds, in numbers: :meth:`CompressedDynamicCache.stats`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch import compat
from kvpatch.cache.layer import CompressedLayer
from kvpatch.cache.packed import storage_nbytes


@dataclass
class LayerStats:
    """One layer.

    Attributes
    ----------
    compressed : whether a policy's choice is in force (False for sliding-window layers, layers
        not prefilled yet, and layers with nothing to compress).
    seen : tokens the layer has seen (its logical length).
    held : long ``[batch, kv_heads]``, tokens each head holds; None before the first update.
    kept : bool ``[batch, kv_heads, seen]``, which of the seen positions each head holds; None
        for layers kvpatch does not manage (a sliding window holds the last tokens).
    nbytes : bytes of every tensor the layer holds (storages, spare capacity included).
    full_nbytes : bytes a ``DynamicCache`` layer would hold for the same tokens.
    kv_nbytes : the part of ``nbytes`` that is keys and values (spare capacity included); never
        more than ``full_nbytes``. The rest is the index: which positions are held, pruned
        channels, padding, and a decode budget's last queries.
    sliding : whether the layer is a sliding window (Gemma's, Mistral's): it holds its last
        window, uncompressed, so it saves nothing on ``full_nbytes``.
    """

    compressed: bool
    seen: int
    held: torch.Tensor | None
    kept: torch.Tensor | None
    nbytes: int
    full_nbytes: int
    kv_nbytes: int = 0
    sliding: bool = False

    @property
    def kept_share(self) -> float | None:
        """The share of the tokens seen that a head of this layer holds, on average over its
        heads and rows; None before the first update."""
        if self.held is None or not self.seen:
            return None
        return float(self.held.double().mean()) / self.seen

    def kept_positions(self, row: int, head: int) -> torch.Tensor:
        """Logical positions held by one (batch row, KV head), in order."""
        return self.kept[row, head].nonzero().flatten()


@dataclass
class CacheStats:
    """Every layer of a cache, and the totals."""

    layers: list[LayerStats]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def full_nbytes(self) -> int:
        return sum(layer.full_nbytes for layer in self.layers)

    @property
    def kv_nbytes(self) -> int:
        return sum(layer.kv_nbytes for layer in self.layers)

    @property
    def index_nbytes(self) -> int:
        """Bytes held besides keys and values (positions, channel indices, padding, queries)."""
        return self.nbytes - self.kv_nbytes

    @property
    def ratio(self) -> float:
        """Fraction of the uncompressed keys' and values' bytes saved (0 at ratio 0, never
        negative); the index is reported beside it (:attr:`index_nbytes`)."""
        return 1.0 - self.kv_nbytes / self.full_nbytes if self.full_nbytes else 0.0

    @property
    def kept_shares(self) -> list[float | None]:
        """Per layer, the share of its tokens seen a head holds (:attr:`LayerStats.kept_share`):
        how budgets shared across layers split the total."""
        return [layer.kept_share for layer in self.layers]

    @property
    def full_attention(self) -> CacheStats:
        """The full-attention layers alone: where a policy's saving is."""
        return CacheStats([layer for layer in self.layers if not layer.sliding])

    @property
    def sliding_window(self) -> CacheStats:
        """The sliding-window layers alone: each holds its last window, uncompressed (its
        ``nbytes`` is its ``full_nbytes``)."""
        return CacheStats([layer for layer in self.layers if layer.sliding])

    def kept_note(self) -> str:
        """One line: how many of the tokens seen a head of the full-attention layers holds."""
        layers = [layer for layer in self.full_attention.layers if layer.held is not None]
        if not layers:
            return "kept: nothing cached yet"
        seen = max(layer.seen for layer in layers)
        held = torch.cat([layer.held.flatten() for layer in layers]).double().mean().item()
        if held >= seen:
            return f"kept all {seen} tokens seen: nothing to drop at this length and ratio"
        return f"kept {held:.0f} of {seen} tokens per head on average ({held / seen:.0%})"

    def __str__(self) -> str:
        mib = 2**20
        text = (
            f"KV cache: {self.nbytes / mib:.2f} MiB held ({self.index_nbytes / 2**10:.1f} KiB of "
            f"it positions and indices), {self.full_nbytes / mib:.2f} MiB uncompressed "
            f"({self.ratio:.1%} saved)"
        )
        sliding = self.sliding_window
        if not sliding.layers:
            return text
        # a mixed model (Gemma): how much of what is held the policy could act on at all
        full = self.full_attention
        return (
            f"{text}; full-attention layers {full.nbytes / mib:.2f} of "
            f"{full.full_nbytes / mib:.2f} MiB ({full.ratio:.1%} saved), sliding-window layers "
            f"{sliding.nbytes / mib:.2f} MiB (their windows)"
        )


def layer_stats(layer) -> LayerStats:
    if isinstance(layer, CompressedLayer):
        return _compressed_layer_stats(layer)
    if not compat.layer_is_initialized(layer):
        return LayerStats(False, 0, None, None, 0, 0, sliding=_is_sliding(layer))
    b, h, held, _ = layer.keys.shape
    nbytes = storage_nbytes(layer.keys, layer.values)
    count = torch.full((b, h), held, dtype=torch.long, device=layer.keys.device)
    seen = layer.get_seq_length()
    return LayerStats(False, seen, count, None, nbytes, nbytes, nbytes, _is_sliding(layer))


def _is_sliding(layer) -> bool:
    """Whether a stock layer is a sliding window (``is_sliding`` since 4.56; kvpatch's own
    layers are full attention)."""
    return bool(getattr(layer, "is_sliding", False))


def _compressed_layer_stats(layer: CompressedLayer) -> LayerStats:
    if not layer.is_initialized:
        return LayerStats(False, 0, None, None, 0, 0)
    keys = layer.full_width_keys()
    b, h, _, key_dim = keys.shape
    value_dim = layer.store.tail()[1].shape[-1] if layer.is_compressed else layer.values.shape[-1]
    full = b * h * layer.seen * (key_dim + value_dim) * keys.element_size()
    return LayerStats(
        compressed=layer.is_compressed,
        seen=layer.seen,
        held=layer.physical_lengths(),
        kept=_kept_mask(layer),
        nbytes=layer.nbytes(),
        full_nbytes=full,
        kv_nbytes=layer.kv_nbytes(),
    )


def _kept_mask(layer: CompressedLayer) -> torch.Tensor:
    if layer.is_compressed:
        return layer.store.kept_mask()
    keys = layer.full_width_keys()
    return torch.ones(*keys.shape[:2], layer.seen, dtype=torch.bool, device=keys.device)


def cache_nbytes(cache) -> int:
    """Bytes of the tensors any transformers cache holds (storages): a kvpatch cache or a stock
    one, for comparisons."""
    return sum(layer_stats(layer).nbytes for layer in cache.layers)
