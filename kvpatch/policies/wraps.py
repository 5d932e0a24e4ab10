"""Policies around a token scorer (head-wise, global or layer budgets, spans) share its ratio,
protected tokens, needs and query window through :class:`WrapsScorer`."""

from __future__ import annotations

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import LayerInputs
from kvpatch.policies.needs import HiddenStateScorer, Reconstruction


class WrapsScorer:
    """Mixin for a policy around a token scorer (``self.scorer``): the ratio, the protected
    tokens and what it needs (a reconstruction, hidden states, a fitted map) are the
    scorer's."""

    scorer: TokenScorer

    def _rule_scores(
        self, inputs: list[LayerInputs], must_keep: list[torch.Tensor | None] | None
    ) -> list[torch.Tensor]:
        """The scorer's scores of every layer, with the shared rules applied (padding never
        kept, ``must_keep`` always)."""
        must_keep = must_keep or [None] * len(inputs)
        return [self.scorer.rule_scores(x, m) for x, m in zip(inputs, must_keep, strict=True)]

    def _check_scorer(self) -> None:
        if not isinstance(self.scorer, TokenScorer):
            raise ValueError(
                f"{type(self).__name__} wraps a token scorer, got {type(self.scorer).__name__}"
            )

    @property
    def ratio(self) -> float:
        return self.scorer.ratio

    @property
    def protected_tokens(self) -> int:
        return self.scorer.protected_tokens

    @property
    def n_sink(self) -> int:
        return self.scorer.n_sink

    @property
    def keeps_everything(self) -> bool:
        return self.scorer.keeps_everything  # the scorer's ratio is the wrapper's

    @property
    def layer_floor_max_ratio(self) -> float:
        return self.scorer.layer_floor_max_ratio

    @property
    def deferred_scorer(self) -> TokenScorer:
        return self.scorer  # the scores that budgets across layers rank

    @property
    def reconstruction(self) -> Reconstruction | None:
        return self.scorer.reconstruction

    @property
    def hidden_state_scorer(self) -> HiddenStateScorer | None:
        return self.scorer.hidden_state_scorer

    @property
    def needs_hidden_states(self) -> bool:
        return self.scorer.needs_hidden_states

    def prepare(self, model: torch.nn.Module) -> None:
        self.scorer.prepare(model)

    @property
    def query_window(self) -> int:
        return self.scorer.query_window

    @property
    def prompt_window(self) -> int:
        return self.scorer.prompt_window
