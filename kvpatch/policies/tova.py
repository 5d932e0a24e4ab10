"""TOVA: keep the tokens the newest query attends to (https://arxiv.org/abs/2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import LayerInputs, check_ratio


@dataclass
class TOVA(TokenScorer):
    """Score each token by the last query's attention, averaged over all heads of the layer.

    The score is the same for every KV head, and the last token is always kept.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    """

    ratio: float = 0.5
    name = "tova"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)

    @property
    def protected_tokens(self) -> int:
        return 1

    @property
    def query_window(self) -> int:
        return 1

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        attention = inputs.window_attention(1)[..., 0, :]  # [b, h, g, t]
        scores = attention.mean(dim=(1, 2), keepdim=True).squeeze(2)  # [b, 1, t]
        scores = scores.expand(-1, inputs.keys.shape[1], -1).clone()
        scores[..., -1] = float("inf")
        return scores
