"""How a :class:`~kvpatch.cache.CompressedLayer` serves a reconstruction chunk
(:mod:`kvpatch.feed.reconstruction`): what it holds and the chunk, posted with a
:class:`~kvpatch.cache.requests.ReconstructionRequest`, and the scores the chunk's attention
records."""

from __future__ import annotations

import torch

from kvpatch.cache.lifecycle import Lifecycle, Phase
from kvpatch.cache.reconstruction_chunk import ReconstructionChunk
from kvpatch.cache.requests import ReconstructionRequest, post


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
        if self.deferred is not None:  # a waiting prefill: every held token is scored
            held = self.keys, self.values, self.reconstructing.prefill_held_valid
            return self._post_chunk(*held, key_states, value_states, scored_from=0)
        keys, values, held_valid = *self.store.dense(), self.store.slot_valid()
        scored_from = self.store.packed.max_length  # only the tail is scored
        return self._post_chunk(keys, values, held_valid, key_states, value_states, scored_from)

    def _post_chunk(self, held_keys, held_values, held_valid, keys, values, scored_from: int):
        """What the layer holds, then the chunk's ``keys``/``values`` (not stored), posted with a
        :class:`~kvpatch.cache.requests.ReconstructionRequest`."""
        request = ReconstructionRequest(self, self.reconstructing, held_valid, scored_from)
        keys = torch.cat([held_keys, keys], dim=-2)
        return post(keys, request), torch.cat([held_values, values], dim=-2)

    def record_reconstruction_scores(self, attention: torch.Tensor) -> None:
        """Keep the largest attention each scored token got, ``[batch, kv_heads, scored]``."""
        previous = self.reconstruction_scores
        self.reconstruction_scores = attention if previous is None else previous.maximum(attention)
