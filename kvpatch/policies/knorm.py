"""Knorm: keep the keys of smallest norm (https://arxiv.org/abs/2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks


@dataclass
class Knorm(TokenScorer):
    """Score each token by ``-||k||_2`` of its cached (post-RoPE) key: low-norm keys draw attention.

    No window is protected.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    n_sink : int, default 4
        Leading real tokens always kept (the attention sinks); 0 keeps none, as the paper does.
    """

    ratio: float = 0.5
    n_sink: int = DEFAULT_SINKS
    name = "knorm"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("Knorm", self.n_sink)

    @property
    def query_window(self) -> int:
        return 1  # reads no query; one keeps the positions known

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return -inputs.keys.float().norm(dim=-1)
