"""A ``[batch, heads, length, dim]`` tensor that grows along ``length`` with spare room.

Appending to a plain tensor with ``torch.cat`` copies the whole cache at every decoded token;
appending here copies the new token only, and the buffer is re-allocated once every
``max(CHUNK, length / 8)`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK = 32  # small caches grow often but cheaply; large ones by an eighth


class GrowingBuffer:
    """Storage whose first ``length`` positions along dim 2 hold data.

    ``reserve``: grow by exactly that many positions at a time (a bounded cache, which compresses
    every ``reserve`` tokens, then never holds spare room beyond them); None: by
    ``max(CHUNK, length / 8)``.
    """

    def __init__(self, data: torch.Tensor, reserve: int | None = None):
        self.data = data
        self.length = data.shape[2]
        self.reserve = reserve

    @classmethod
    def copy_of(
        cls, data: torch.Tensor, reserve: int | None = None, room: int | None = None
    ) -> GrowingBuffer:
        """A buffer holding a copy of ``data``, with room for ``reserve`` more positions (at
        most ``room``)."""
        b, h, length, d = data.shape
        spare = (reserve or 0) if room is None else min(reserve or 0, room)
        storage = data.new_empty(b, h, length + spare, d)
        storage[:, :, :length] = data
        buffer = cls(storage, reserve)
        buffer.length = length
        return buffer

    def view(self) -> torch.Tensor:
        return self.data[:, :, : self.length]

    def append(self, states: torch.Tensor, max_capacity: Callable[[], int] | None = None) -> None:
        """Copy ``states`` after the held positions; a re-allocation leaves spare room, but holds
        no more than ``max_capacity()`` positions (asked then only; unless the held ones need
        more)."""
        end = self.length + states.shape[2]
        if end > self.data.shape[2]:
            capacity = end + (max(CHUNK, end // 8) if self.reserve is None else self.reserve)
            if max_capacity is not None:
                capacity = max(end, min(capacity, max_capacity()))
            grown = self.data.new_empty(*self.data.shape[:2], capacity, self.data.shape[3])
            grown[:, :, : self.length] = self.view()
            self.data = grown
        self.data[:, :, self.length : end] = states
        self.length = end

    def truncate(self, length: int) -> None:
        self.length = length

    def select_rows(self, rows: torch.Tensor) -> None:
        self.data = self.view()[rows]  # advanced indexing copies the held positions only

    def to(self, device: torch.device | str) -> None:
        self.data = self.data.to(device, non_blocking=True)
