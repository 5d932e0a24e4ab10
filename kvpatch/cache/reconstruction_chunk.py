"""A reconstruction chunk in progress (:mod:`kvpatch.feed.reconstruction`): its tokens are
attended over what a layer holds, and forgotten afterwards. Shared by every layer of the chunk, it
holds the masks and workspaces they all use."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


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


def _chunk_visibility(query_valid: torch.Tensor) -> torch.Tensor:
    q_len = query_valid.shape[1]
    device = query_valid.device
    real = query_valid[:, :, None]  # [b, q, 1]
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    own = torch.eye(q_len, dtype=torch.bool, device=device)
    return torch.where(real, causal & query_valid[:, None, :], own)  # [b, q, q]
