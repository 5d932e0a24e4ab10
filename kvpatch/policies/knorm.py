"""Knorm: keep the keys of smallest norm (https://arxiv.org/abs/2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import LayerInputs, check_ratio


@dataclass
class Knorm(TokenScorer):
    """Score each token by ``-||k||_2`` of its cached (post-RoPE) key: low-norm keys draw attention.

    No window and no sink tokens are protected.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    """

    ratio: float = 0.5
    name = "knorm"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)

    @property
    def query_window(self) -> int:
        return 1  # reads no query; one keeps the positions known

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return -inputs.keys.float().norm(dim=-1)
