"""A reconstruction chunk in progress (:mod:`kvpatch.replay`): its tokens are attended over what a
layer holds, and forgotten afterwards. Shared by every layer of the chunk, it holds the masks and
workspaces they all use."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


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
