"""TOVA: keep the tokens the newest query attends to (https://arxiv.org/abs/2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks


@dataclass
class TOVA(TokenScorer):
    """Score each token by the last query's attention, averaged over all heads of the layer.

    The score is the same for every KV head, and the last token is always kept.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    n_sink : int, default 4
        Leading real tokens always kept (the attention sinks); 0 keeps none, as the paper does.
    """

    ratio: float = 0.5
    n_sink: int = DEFAULT_SINKS
    name = "tova"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("TOVA", self.n_sink)

    @property
    def protected_tokens(self) -> int:
        return 1 + self.n_sink

    @property
    def query_window(self) -> int:
        return 1

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        attention = inputs.window_attention(1)[..., 0, :]  # [b, h, g, t]
        scores = attention.mean(dim=(1, 2), keepdim=True).squeeze(2)  # [b, 1, t]
        scores = scores.expand(-1, inputs.keys.shape[1], -1).clone()
        scores[..., -1] = float("inf")
        return scores
