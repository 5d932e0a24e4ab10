"""A decode budget: how far a layer may grow while decoding before it is compressed again."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeBudget:
    """Keep a layer bounded while decoding: once its heads hold ``tokens + interval`` tokens on
    average, the layer is compressed back to ``tokens`` per head (on average, for head-wise
    budgets) with the same policy.

    Channels chosen at the prefill stay; the policy's full-width window stays full width.
    """

    tokens: int
    interval: int = 64

    def __post_init__(self) -> None:
        for name in ("tokens", "interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"decode budget {name} must be a positive integer, got {value!r}")
