"""Budgets shared across layers: one ranking over every layer and KV head of a batch row, as
KVzip does (https://arxiv.org/abs/2505.23416)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.adakv import AdaKV
from kvpatch.policies.base import Policy, TokenScorer
from kvpatch.policies.contract import (
    LayerInputs,
    Plan,
    recent_window,
    row_budget,
    select_top,
)
from kvpatch.policies.wraps import WrapsScorer


@dataclass
class GlobalBudgets(WrapsScorer, Policy):
    """Rank the tokens of every layer and KV head together and keep the best.

    The model keeps as many tokens in total as ``scorer`` would with uniform budgets (so the bytes
    are the same), but layers and heads whose tokens score higher keep more. Scores must be
    comparable across layers, as attention weights are (``kvzip``, ``snapkv``, ``tova``,
    ``expected-attention``). Compression waits for the end of the prefill, when every layer's
    scores are known; alone (one layer, e.g. while decoding) it shares the budget among that
    layer's heads like :class:`~kvpatch.policies.AdaKV`.

    A layer whose scores live on a smaller scale than the others' (Gemma 3's deepest full-attention
    layer under KVzip) can lose all but its sinks to a single ranking; ``layer_floor`` keeps a
    share of every layer's uniform budget for the best of its own tokens whatever the scale, and
    ranks the rest across layers. The share comes on top of a prompt's window (the question a
    prompt ends with, kept in every layer: KVzip's ``prompt_window``), which would use it up at
    high ratios. Its default, a quarter, comes from measurement (docs/results.md,
    "Layer floors for global budgets"): it turns a single ranking's worst failures into gains
    (``global-kvzap`` on SmolLM2-135M at r = 0.9: 0.35 to 0.75; ``global-kvzip`` on Gemma 3 270M
    at r = 0.75: 0.05 to 0.20 at 2,000 tokens, 0.05 to 0.25 at 8,000) and costs at most three
    answers of 20 in any cell measured; half a budget cost Gemma 3 three answers at r = 0.5.

    Beyond ``floor_max_ratio`` the floor stops shrinking with the budget: each layer keeps
    ``layer_floor`` of the budget it would have at that ratio, never more than its budget. KVzip
    asks for it (:attr:`~kvpatch.policies.TokenScorer.layer_floor_max_ratio`): a quarter of a
    budget of 10% left Gemma 3's two deeper full-attention layers 2.5% of their tokens at
    r = 0.9, and ``global-kvzip`` lost needles uniform ``kvzip`` kept; with the floor kept at
    r = 0.75's, a sixteenth of their tokens, it answers as many or more on both models, while
    ``global-kvzap`` answers fewer (docs/results.md, "The floor past r = 0.75").

    Parameters
    ----------
    scorer : TokenScorer
        Scores tokens; its ``ratio`` is the model's ratio.
    layer_floor : float, default 0.25
        Share of its uniform budget each layer keeps of its own best tokens (besides the
        prompt's window) before the rest of the budget is ranked across layers: 0 ranks every
        token together (KVzip's global budgets), 1 gives every layer its uniform budget, shared
        among its heads by score.
    floor_max_ratio : float or None, default None
        The ratio whose budget the floor is a share of at higher ratios (see above); 1 lets the
        floor shrink with the budget at every ratio. None: the scorer's
        ``layer_floor_max_ratio`` (0.75 for KVzip and KVzip+, 1 for the others).
    """

    scorer: TokenScorer
    layer_floor: float = 0.25
    floor_max_ratio: float | None = None

    def __post_init__(self) -> None:
        self._check_scorer()
        if not 0.0 <= self.layer_floor <= 1.0:
            raise ValueError(
                f"GlobalBudgets needs layer_floor in [0, 1] (a share of each layer's uniform "
                f"budget), got {self.layer_floor!r}"
            )
        # resolved once, here: a policy string's setting is parsed as the type of the value held
        if self.floor_max_ratio is None:
            self.floor_max_ratio = self.scorer.layer_floor_max_ratio
        if not 0.0 <= self.floor_max_ratio <= 1.0:
            raise ValueError(
                f"GlobalBudgets needs floor_max_ratio in [0, 1] (the ratio whose budget the floor "
                f"is a share of at higher ratios), got {self.floor_max_ratio!r}"
            )

    @property
    def needs_all_layers(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return f"global-{self.scorer.name}"

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        return AdaKV(self.scorer, alpha=0.0).plan(inputs, must_keep)

    def plan_layers(
        self, inputs: list[LayerInputs], must_keep: list[torch.Tensor | None] | None = None
    ) -> list[Plan]:
        scores = self._rule_scores(inputs, must_keep)
        budgets = [row_budget(s, x, self.ratio) for s, x in zip(scores, inputs, strict=True)]
        if self.layer_floor > 0:
            floors = [self._floor(s, b, x) for s, b, x in zip(scores, budgets, inputs, strict=True)]
            scores = [with_floor(s, f) for s, f in zip(scores, floors, strict=True)]
        budget = sum(budgets)  # [batch]
        shapes = [s.shape for s in scores]
        flat = torch.cat([s.flatten(1) for s in scores], dim=1)  # [batch, layers * heads * tokens]
        keep = select_top(flat, budget).split([s[1] * s[2] for s in shapes], dim=1)
        # clone: a view would keep (and count) the whole model's mask in every layer
        return [
            Plan(keep=k.reshape(shape).clone(), channels=None, full_width_from=shape[2])
            for k, shape in zip(keep, shapes, strict=True)
        ]

    def _floor(
        self, scores: torch.Tensor, budget: torch.Tensor, inputs: LayerInputs
    ) -> torch.Tensor:
        """Tokens ``[batch]`` a layer keeps before the ranking across layers: its share of its
        budget (of the budget at ``floor_max_ratio`` past that ratio, within its own) for its own
        best tokens, on top of the prompt's window (the question, kept in every layer whatever it
        scores: counted in the share, it used the share up at high ratios)."""
        base = budget
        if self.ratio > self.floor_max_ratio:
            base = row_budget(scores, inputs, self.floor_max_ratio)
        own = torch.minimum(torch.floor(base * self.layer_floor).long(), budget)
        if not inputs.recent_tokens:
            return own
        return torch.minimum(own + recent_window(inputs).sum(dim=(-2, -1)), budget)


def with_floor(scores: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``scores`` ``[batch, kv_heads, tokens]`` of one layer with its best ``floor`` ``[batch]``
    tokens (over all its heads) marked always kept (``+inf``); padding stays out."""
    flat = scores.flatten(1)
    best = select_top(flat, floor) & (flat > float("-inf"))
    return flat.masked_fill(best, float("inf")).view_as(scores)
