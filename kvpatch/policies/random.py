"""Random eviction: the baseline every scorer should beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks


@dataclass
class RandomScorer(TokenScorer):
    """Score tokens uniformly at random, reproducibly.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    n_sink : int, default 4
        Leading real tokens always kept (the attention sinks); 0 keeps none.
    seed : int, default 0
        Seed of the generator; each layer draws from ``seed + layer_idx``.
    """

    ratio: float = 0.5
    n_sink: int = DEFAULT_SINKS
    seed: int = 0
    name = "random"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("RandomScorer", self.n_sink)

    @property
    def query_window(self) -> int:
        return 1  # reads no query; one keeps the positions known

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        # one draw per (head, real-token rank): a row scores the same alone or padded in a batch
        generator = torch.Generator().manual_seed(self.seed + inputs.layer_idx)
        _, h, t, _ = inputs.keys.shape
        # drawn on the CPU (its generator's device, whatever the default device), then moved
        table = torch.rand(t, h, generator=generator, device="cpu").to(inputs.keys.device)
        rank = (inputs.head_valid.long().cumsum(-1) - 1).clamp(min=0)  # [b, h, t]
        return table.T.expand(rank.shape[0], -1, -1).gather(-1, rank)
