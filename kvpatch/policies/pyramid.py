"""PyramidKV: layer budgets shrinking from the lowest layer to the highest
(https://arxiv.org/abs/2406.02069)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import Policy, TokenScorer
from kvpatch.policies.contract import LayerInputs, Plan, kept_count, protected_count, select_top
from kvpatch.policies.wraps import WrapsScorer


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
    window is added to every layer). The total is ``scorer``'s, so are the bytes: where a low
    layer's share would exceed its tokens (ratios below about 0.5) it keeps them all and the rest
    goes to the layers above. Inside a layer every KV head keeps the same number of tokens, chosen
    by ``scorer``. The layers wait for the end of the prefill,
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
        scores = self._rule_scores(inputs, must_keep)
        budgets = self._budgets(inputs, scores)
        return [
            Plan(keep=select_top(s, budget), channels=None, full_width_from=x.num_tokens)
            for s, budget, x in zip(scores, budgets, inputs, strict=True)
        ]

    def _budgets(self, inputs: list[LayerInputs], scores: list[torch.Tensor]) -> torch.Tensor:
        """Tokens each layer and head keeps, ``[layers, batch, kv_heads]``: the protected ones,
        plus the rest of the uniform budget along the pyramid; what a layer cannot hold (it has
        fewer tokens) goes, in equal parts, to the layers that can."""
        uniform = torch.stack([kept_count(x, self.ratio) for x in inputs]).double()
        tokens = torch.stack([x.head_valid.sum(-1) for x in inputs]).double()
        protected = torch.stack([protected_count(s) for s in scores]).double()
        floor = protected.minimum(uniform)
        weights = torch.tensor(pyramid_weights(len(inputs), self.beta), dtype=torch.float64)
        budget = floor + (uniform - floor) * weights.to(uniform.device)[:, None, None]
        for _ in inputs:  # each pass fills at least one more layer
            excess = (budget - tokens).clamp(min=0).sum(0)
            budget = budget.minimum(tokens)
            room = budget < tokens
            if not bool((excess > 0).any()) or not bool(room.any()):
                break
            budget = budget + room * excess / room.sum(0).clamp(min=1)
        return torch.round(budget).long().minimum(tokens.long()).maximum(protected.long())
