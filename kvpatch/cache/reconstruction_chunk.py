"""A reconstruction chunk in progress (:mod:`kvpatch.feed.reconstruction`): its tokens are
attended over what a layer holds, and forgotten afterwards. Shared by every layer of the chunk, it
holds the masks and workspaces they all use."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpatch.cache.lifecycle import Lifecycle, Phase
from kvpatch.cache.requests import ReconstructionRequest, post

if TYPE_CHECKING:
    from kvpatch.cache.layer import CompressedLayer


@dataclass
class LocalColumns:
    """The held columns a chunk's softmax runs over when scored locally: per row,
    the sinks and the context tokens the chunk reconstructs. ``index`` ``[batch, columns]`` are
    positions in the held prefill, ``valid`` marks the real ones (rows differ in length)."""

    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of_chunk(
        cls, prefill_valid: torch.Tensor, starts: list[int], size: int, sinks: int
    ) -> LocalColumns:
        """Columns for a chunk reconstructing each row's real tokens ``[start, start + size)``
        (counted from its first real token) of a left-padded prefill, after its first ``sinks``
        real tokens (those before ``start``: a first chunk holds its sinks itself)."""
        width, device = prefill_valid.shape[1], prefill_valid.device
        lengths = prefill_valid.sum(-1).tolist()
        rows = []
        for length, start in zip(lengths, starts, strict=True):
            pad = width - length
            sink_part = range(pad, pad + min(sinks, start))
            chunk_part = range(pad + start, pad + min(start + size, length))
            rows.append([*sink_part, *chunk_part])
        columns = max(1, max(len(row) for row in rows))
        index = torch.zeros(len(rows), columns, dtype=torch.long, device=device)
        valid = torch.zeros(len(rows), columns, dtype=torch.bool, device=device)
        for b, row in enumerate(rows):
            index[b, : len(row)] = torch.tensor(row, dtype=torch.long, device=device)
            valid[b, : len(row)] = True
        return cls(index, valid)


@dataclass
class ReconstructionChunk:
    """``query_valid`` ``[batch, chunk]`` marks the chunk's real tokens; ``prefill_valid``
    ``[batch, prefill]`` the real tokens of a prefill that waits for its scores. ``local``: the
    columns of the authors' softmax, or None to normalise over everything held.
    ``hidden_norms``: per layer index, ``[batch, chunk]`` norms of the hidden states the
    attention reads (a weighted reconstruction), filled by hooks during the forward; None
    otherwise."""

    query_valid: torch.Tensor
    prefill_valid: torch.Tensor
    local: LocalColumns | None = None
    hidden_norms: dict[int, torch.Tensor] | None = None
    _buffers: dict = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def chunk_visible(self) -> torch.Tensor:
        """``[batch, chunk, chunk]``: which chunk tokens each chunk query sees (causal over the
        real ones; a padding query sees only itself, so that its softmax is defined)."""
        return _chunk_visibility(self.query_valid)

    @functools.cached_property
    def local_bias(self) -> torch.Tensor:
        """``[batch, 1, 1, chunk, local columns + chunk]``: 0 where a chunk query sees a key of
        the authors' softmax (the :class:`LocalColumns`, then the chunk), -inf elsewhere; one
        tensor for every layer."""
        real = self.query_valid[:, :, None]  # [b, q, 1]
        held = self.local.valid[:, None, :] & real  # [b, q, columns]
        visible = torch.cat([held, self.chunk_visible], dim=-1)
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
        return bias.masked_fill_(~visible, float("-inf"))[:, None, None]

    @functools.cached_property
    def prefill_held_valid(self) -> torch.Tensor:
        """``prefill_valid`` as ``[batch, 1, prefill]``, the held tokens' validity of every
        layer that waits for its scores."""
        return self.prefill_valid[:, None, :]

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A float32 workspace reused by every layer of the chunk: allocating a fresh one per
        layer costs more than the arithmetic on it (on CPU)."""
        key = (name, shape, like.device)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=torch.float32, device=like.device)
        return self._buffers[key]

    def view(
        self,
        layer: CompressedLayer,
        held_keys: torch.Tensor,
        held_values: torch.Tensor,
        held_valid: torch.Tensor | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        scored_from: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``layer`` holds, then the chunk's ``keys``/``values`` (not stored), posted with a
        :class:`~kvpatch.cache.requests.ReconstructionRequest`. ``held_valid`` None: the held
        tokens are a waiting prefill, :attr:`prefill_valid`."""
        if held_valid is None:
            held_valid = self.prefill_held_valid
        request = ReconstructionRequest(layer, self, held_valid, scored_from)
        keys = torch.cat([held_keys, keys], dim=-2)
        return post(keys, request), torch.cat([held_values, values], dim=-2)


def _chunk_visibility(query_valid: torch.Tensor) -> torch.Tensor:
    q_len = query_valid.shape[1]
    device = query_valid.device
    real = query_valid[:, :, None]  # [b, q, 1]
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    own = torch.eye(q_len, dtype=torch.bool, device=device)
    return torch.where(real, causal & query_valid[:, None, :], own)  # [b, q, q]


class Reconstructed:
    """Mixin of :class:`~kvpatch.cache.CompressedLayer`: how it serves a reconstruction chunk
    (``reconstructing``) and keeps the attention its tokens got (``reconstruction_scores``)."""

    lifecycle: Lifecycle
    reconstructing: ReconstructionChunk | None
    reconstruction_scores: torch.Tensor | None

    def begin_reconstruction(self, chunk: ReconstructionChunk) -> None:
        """Attend ``chunk`` over what is held, without storing it."""
        self.lifecycle.move(Phase.RECONSTRUCTING)
        self.reconstructing = chunk

    def end_reconstruction(self) -> None:
        self.lifecycle.end_reconstruction()
        self.reconstructing = None

    def _reconstruction_view(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The held tokens and a reconstruction chunk (not stored); scores all, or the tail."""
        if self.reconstructing is None:
            raise ValueError(
                "this cache waits for a context reconstruction (its policy scores tokens by "
                "asking the model to repeat its context) before it is compressed: prefill with "
                "kvpatch.prefill(model, ids) or model.generate on an enabled model, not with a "
                "plain forward"
            )
        if self.deferred is not None:
            held = self.keys, self.values, None
            return self.reconstructing.view(self, *held, key_states, value_states)
        keys, values, held_valid = *self.store.dense(), self.store.slot_valid()
        scored_from = self.store.packed.max_length  # only the tail is scored
        return self.reconstructing.view(
            self, keys, values, held_valid, key_states, value_states, scored_from
        )

    def record_reconstruction_scores(self, attention: torch.Tensor) -> None:
        """Keep the largest attention each scored token got, ``[batch, kv_heads, scored]``."""
        previous = self.reconstruction_scores
        self.reconstruction_scores = attention if previous is None else previous.maximum(attention)
