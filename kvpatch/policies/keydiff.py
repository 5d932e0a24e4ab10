"""KeyDiff: keep the keys least like the others (https://arxiv.org/abs/2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks


@dataclass
class KeyDiff(TokenScorer):
    """Score each token by ``-cos(k, anchor)``, the anchor being the mean of the head's
    L2-normalised keys: distinctive keys are kept, keys that look like the average are evicted.

    Needs no query at all, so it is question-agnostic by construction and costs one pass over
    the keys. Only real tokens enter the anchor.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    n_sink : int, default 4
        Leading real tokens always kept (the attention sinks); 0 keeps none, as the paper does.
    window : int, default 0
        The newest tokens always kept, as SnapKV keeps its window: with the question at the end
        of a short prompt, a budget smaller than the prompt would otherwise drop it. 0 keeps
        none, as the paper does.
    """

    ratio: float = 0.5
    n_sink: int = DEFAULT_SINKS
    window: int = 0
    name = "keydiff"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("KeyDiff", self.n_sink)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"KeyDiff needs an integer window >= 0, got {self.window!r}")

    @property
    def protected_tokens(self) -> int:
        return self.window + self.n_sink

    @property
    def query_window(self) -> int:
        return 1  # reads no query; one keeps the positions known

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        keys = F.normalize(inputs.keys.float(), dim=-1)  # [b, h, t, d]
        valid = inputs.head_valid[..., None].float()
        anchor = (keys * valid).sum(2, keepdim=True) / valid.sum(2, keepdim=True).clamp(min=1)
        scores = -F.cosine_similarity(keys, anchor, dim=-1)
        if self.window:  # real tokens end every row (padding is on the left)
            scores[..., max(scores.shape[-1] - self.window, 0) :] = float("inf")
        return scores
