"""SnapKV: keep the tokens the last queries attend to (https://arxiv.org/abs/2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks


@dataclass
class SnapKV(TokenScorer):
    """Score each token by the attention the last ``window`` queries pay it.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    window : int, default 64
        Observation window: the last queries whose attention is averaged; these tokens are
        always kept.
    kernel_size : int, default 5
        Width of the 1-D average pooling that smooths scores over neighbouring tokens.
    n_sink : int, default 4
        Leading real tokens always kept (the attention sinks); 0 keeps none, as the paper does.
    """

    ratio: float = 0.5
    window: int = 64
    kernel_size: int = 5
    n_sink: int = DEFAULT_SINKS
    name = "snapkv"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks(type(self).__name__, self.n_sink)
        if self.window < 1 or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(
                f"SnapKV needs window >= 1 and an odd kernel_size >= 1, got window={self.window}, "
                f"kernel_size={self.kernel_size}"
            )

    @property
    def protected_tokens(self) -> int:
        return self.window + self.n_sink

    @property
    def query_window(self) -> int:
        return self.window

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        attention = inputs.mean_window_attention(self.window)  # [b, h, g, t]
        b, h, g, t = attention.shape
        w = min(self.window, t, inputs.queries.shape[2])
        per_query_head = attention.reshape(b, h * g, t)
        valid = inputs.head_valid.repeat_interleave(g, dim=1)
        scores = self._smooth(per_query_head, valid).view(b, h, g, t).mean(dim=2)
        scores[..., t - w :] = float("inf")
        return scores

    def _smooth(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Average over the ``kernel_size`` neighbours that are real tokens (padding excluded)."""
        pool = lambda x: F.avg_pool1d(x, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        weight = valid.float()
        return pool(scores * weight) / pool(weight).clamp_min(1e-12)
