"""PyramidKV: layer budgets shrinking from the lowest layer to the highest
(https://arxiv.org/abs/2406.02069)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import Policy, TokenScorer, WrapsScorer
from kvpatch.policies.contract import LayerInputs, Plan, kept_count, scores_with_rules, select_top


def pyramid_weights(layers: int, beta: float) -> list[float]:
    """Each layer's share of the average budget, lowest layer first: a straight line from
    ``2 - 1 / beta`` down to ``1 / beta``, whose mean is 1."""
    if layers == 1:
        return [1.0]
    top, bottom = 1.0 / beta, 2.0 - 1.0 / beta
    step = (bottom - top) / (layers - 1)
    return [bottom - layer * step for layer in range(layers)]


@dataclass
class Pyramid(WrapsScorer, Policy):
    """Give lower layers more tokens than upper ones, as attention gets sparser with depth.

    Every layer keeps the tokens ``scorer`` always keeps (its window, sinks); the rest of the
    uniform budget is shared among the layers along a straight line falling from the lowest layer
    to the highest, which keeps ``1 / beta`` of the average share (as in PyramidKV, where the
    window is added to every layer). The total is ``scorer``'s, so are the bytes, except where a
    low layer's share exceeds its tokens (ratios below about 0.5): it keeps them all and the total
    falls short. Inside a layer every KV head keeps the same number of tokens, chosen by
    ``scorer``. The layers wait for the end of the prefill,
    when their number is known; alone (one layer, e.g. while decoding) it is ``scorer``.

    Parameters
    ----------
    scorer : TokenScorer
        Scores tokens; its ``ratio`` is the model's ratio.
    beta : float, default 20
        How steep the pyramid is: the top layer keeps ``1 / beta`` of the average budget.
    """

    scorer: TokenScorer
    beta: float = 20.0

    def __post_init__(self) -> None:
        self._check_scorer()
        if not self.beta >= 1.0:
            raise ValueError(f"Pyramid needs beta >= 1 (1 is uniform), got {self.beta}")

    @property
    def needs_all_layers(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return f"pyramid-{self.scorer.name}"

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        return self.scorer.plan(inputs, must_keep)

    def plan_layers(
        self, inputs: list[LayerInputs], must_keep: list[torch.Tensor | None] | None = None
    ) -> list[Plan]:
        must_keep = must_keep or [None] * len(inputs)
        weights = pyramid_weights(len(inputs), self.beta)
        return [
            self._plan_layer(x, m, weight)
            for x, m, weight in zip(inputs, must_keep, weights, strict=True)
        ]

    def _plan_layer(
        self, inputs: LayerInputs, must_keep: torch.Tensor | None, weight: float
    ) -> Plan:
        scores = scores_with_rules(self.scorer.score(inputs), inputs, must_keep)
        uniform = kept_count(inputs, self.ratio)  # [batch, kv_heads]
        protected = (torch.isinf(scores) & (scores > 0)).sum(-1)
        floor = protected.minimum(uniform)
        shared = torch.round((uniform - floor).double() * weight).long()
        budget = (floor + shared).minimum(inputs.head_valid.sum(-1)).maximum(protected)
        keep = select_top(scores, budget)
        return Plan(keep=keep, channels=None, full_width_from=inputs.num_tokens)
