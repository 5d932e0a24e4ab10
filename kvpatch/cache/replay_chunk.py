"""A reconstruction chunk in progress (:mod:`kvpatch.replay`): its tokens are attended over what a
layer holds, and forgotten afterwards. Shared by every layer of the chunk, it holds the masks and
workspaces they all use."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpatch.cache.views import ReplayView, mark

if TYPE_CHECKING:
    from kvpatch.cache.layer import CompressedLayer


@dataclass
class ReplayChunk:
    """``query_valid`` ``[batch, chunk]`` marks the chunk's real tokens; ``prefill_valid``
    ``[batch, prefill]`` the real tokens of a prefill that waits for its scores."""

    query_valid: torch.Tensor
    prefill_valid: torch.Tensor
    _masks: dict = dataclasses.field(default_factory=dict, repr=False)
    _buffers: dict = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def prefill_held_valid(self) -> torch.Tensor:
        """``prefill_valid`` as ``[batch, 1, prefill]``, one tensor for every layer (so that
        :meth:`additive_mask` builds its mask once)."""
        return self.prefill_valid[:, None, :]

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A float32 workspace reused by every layer of the chunk: allocating a fresh
        ``chunk x context`` tensor per layer costs more than the arithmetic on it (on CPU)."""
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
        """What ``layer`` holds, then the chunk's ``keys``/``values`` (not stored), marked
        :class:`~kvpatch.cache.views.ReplayView`. ``held_valid`` None: the held tokens are a
        waiting prefill, :attr:`prefill_valid`."""
        if held_valid is None:
            held_valid = self.prefill_held_valid
        view = ReplayView(layer, self, held_valid, scored_from)
        keys = torch.cat([held_keys, keys], dim=-2)
        return mark(keys, view), torch.cat([held_values, values], dim=-2)

    def additive_mask(self, held_valid: torch.Tensor, group: int) -> torch.Tensor:
        """``[batch, 1 or kv_heads, group * chunk, held + chunk]``, 0 where a query (rows ordered
        (group, chunk)) sees a key and -inf elsewhere: real held keys and the chunk causally. A
        padding query sees only itself, so it gives no held key any weight."""
        key = (id(held_valid), group)
        if key not in self._masks:  # the tensor is kept with it: its id cannot be reused
            self._masks[key] = (held_valid, _replay_mask(held_valid, self.query_valid, group))
        return self._masks[key][1]


def _replay_mask(held_valid: torch.Tensor, query_valid: torch.Tensor, group: int) -> torch.Tensor:
    q_len = query_valid.shape[1]
    device = query_valid.device
    real = query_valid[:, :, None]  # [b, q, 1]
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    own = torch.eye(q_len, dtype=torch.bool, device=device)
    chunk = torch.where(real, causal & query_valid[:, None, :], own)  # [b, q, q]
    held = held_valid[:, :, None, :] & real[:, None]  # [b, h, q, held]
    visible = torch.cat([held, chunk[:, None].expand(-1, held.shape[1], -1, -1)], dim=-1)
    visible = visible.repeat(1, 1, group, 1)
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    return mask.masked_fill_(~visible, float("-inf"))
