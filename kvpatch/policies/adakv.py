"""AdaKV: head-wise budgets on top of any token scorer (https://arxiv.org/abs/2407.11550)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpatch.policies.base import Policy, TokenScorer
from kvpatch.policies.contract import (
    LayerInputs,
    Plan,
    budget_per_head,
    row_budget,
    select_top,
)
from kvpatch.policies.wraps import WrapsScorer


@dataclass
class AdaKV(WrapsScorer, Policy):
    """Share a layer's budget among its KV heads by one top-k over all of them.

    The layer keeps as many tokens in total as ``scorer`` would with uniform budgets, but heads
    whose scores are concentrated give tokens to heads that need more. Each head first keeps its
    best ``alpha`` share of the uniform budget, so that no head is left empty.

    Parameters
    ----------
    scorer : TokenScorer
        Scores tokens; its ``ratio`` is the layer's ratio.
    alpha : float, default 0.2
        Safeguard: fraction of the uniform per-head budget every head keeps.
    """

    scorer: TokenScorer
    alpha: float = 0.2

    def __post_init__(self) -> None:
        self._check_scorer()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"AdaKV needs alpha in [0, 1], got {self.alpha}")

    @property
    def name(self) -> str:
        return f"ada-{self.scorer.name}"

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        scores = self.scorer.rule_scores(inputs, must_keep)
        b, h, t = scores.shape
        per_head = budget_per_head(scores, inputs, self.ratio)  # [b, h]
        safeguard = torch.floor(per_head.float() * self.alpha).long()
        guaranteed = select_top(scores, safeguard) & (scores > float("-inf"))
        boosted = scores.masked_fill(guaranteed, math.inf)
        total = row_budget(scores, inputs, self.ratio)
        keep = select_top(boosted.reshape(b, h * t), total).view(b, h, t)
        return Plan(keep=keep, channels=None, full_width_from=t)
