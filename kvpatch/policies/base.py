"""The kinds of policy. Each has one method to implement:

- :class:`TokenScorer` — ``score(inputs)``: one score per token and KV head; the highest are kept,
  with the same budget for every head of a batch row.
- :class:`ChannelSelector` — ``select_channels(inputs)``: the key channels each KV head keeps.
- :class:`Policy` itself — ``plan(inputs)``: anything else (head-wise budgets).

:class:`Composed` (``channel_selector + token_policy``) is the one rule that combines them; it
lives here so that ``Policy.__add__`` needs nothing above this module.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvpatch.policies.contract import (
    LayerInputs,
    Plan,
    budget_per_head,
    scores_with_rules,
    select_top,
)

#: recent queries kept for compressing again while decoding, unless a policy needs fewer
DEFAULT_QUERY_WINDOW = 64


class Policy(ABC):
    """Anything that turns one layer's prefill into a :class:`Plan`."""

    #: fraction of the cache removed; every policy has one
    ratio: float

    @property
    def query_window(self) -> int:
        """How many of the newest queries :meth:`plan` reads when the cache compresses again
        while decoding (the cache keeps no more of them)."""
        return DEFAULT_QUERY_WINDOW

    @property
    def protected_tokens(self) -> int:
        """Tokens every head always keeps (a window, sinks): the smallest possible budget."""
        return 0

    @property
    def needs_replay(self) -> bool:
        """Whether the scores come from a context reconstruction (KVzip): the cache then holds
        the whole prefill until :mod:`kvpatch.replay` has run it."""
        return False

    @property
    def needs_all_layers(self) -> bool:
        """Whether :meth:`plan_layers` must see every layer at once (budgets shared across
        layers): compression then waits for the end of the prefill."""
        return self.needs_replay

    @abstractmethod
    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        """Decide what the layer keeps; ``must_keep`` ``[batch, tokens]`` marks forced tokens."""

    def plan_layers(
        self, inputs: list[LayerInputs], must_keep: list[torch.Tensor | None] | None = None
    ) -> list[Plan]:
        """Plans for several layers at once; layer by layer unless budgets are shared."""
        must_keep = must_keep or [None] * len(inputs)
        return [self.plan(x, m) for x, m in zip(inputs, must_keep, strict=True)]

    def __add__(self, other: Policy) -> Policy:
        return compose(self, other)


class TokenScorer(Policy):
    """A policy that scores tokens; every KV head of a batch row keeps the same number of them.

    Subclasses are dataclasses with a ``ratio`` field and implement :meth:`score`. A score of
    ``+inf`` marks a token that is always kept (a window, sink tokens).
    """

    #: short name used in policy strings
    name: str = ""

    @abstractmethod
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        """Return ``[batch, kv_heads, tokens]`` scores; higher is kept first."""

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        scores = scores_with_rules(self.score(inputs), inputs, must_keep)
        keep = select_top(scores, budget_per_head(scores, inputs, self.ratio))
        return Plan(keep=keep, channels=None, full_width_from=inputs.num_tokens)


class WrapsScorer:
    """Mixin for a policy around a token scorer (``self.scorer``): the ratio, the protected
    tokens and the need for a replay are the scorer's."""

    scorer: TokenScorer

    def _rule_scores(
        self, inputs: list[LayerInputs], must_keep: list[torch.Tensor | None] | None
    ) -> list[torch.Tensor]:
        """The scorer's scores of every layer, with the shared rules applied (padding never
        kept, ``must_keep`` always)."""
        must_keep = must_keep or [None] * len(inputs)
        return [
            scores_with_rules(self.scorer.score(x), x, m)
            for x, m in zip(inputs, must_keep, strict=True)
        ]

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
    def needs_replay(self) -> bool:
        return self.scorer.needs_replay

    @property
    def query_window(self) -> int:
        return self.scorer.query_window


class ChannelSelector(Policy):
    """A policy that prunes key channels; it keeps every (real) token.

    Subclasses are dataclasses with ``ratio`` (fraction of key channels removed) and ``window``
    (the last tokens keep full width) and implement :meth:`select_channels`.
    """

    name: str = ""
    window: int = 0

    @abstractmethod
    def select_channels(self, inputs: LayerInputs) -> torch.Tensor:
        """Return ``[batch, kv_heads, kept_channels]`` channel indices."""

    def kept_channels(self, head_dim: int) -> int:
        return head_dim - math.floor(head_dim * self.ratio)

    def full_width_from(self, inputs: LayerInputs) -> int:
        return max(inputs.num_tokens - self.window, 0)

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        keep = inputs.head_valid.clone()
        channels = self.select_channels(inputs)
        if channels.shape[-1] == inputs.keys.shape[-1]:
            channels = None
        else:
            channels = channels.sort(dim=-1).values
        return Plan(keep=keep, channels=channels, full_width_from=self.full_width_from(inputs))


@dataclass
class Composed(Policy):
    """Prune key channels with ``channels`` and evict tokens with ``tokens``.

    The channel selector's full-width window is kept by the token policy in every head, so that
    the full-width tokens form one dense block.

    Parameters
    ----------
    channels : ChannelSelector
        Chooses the key channels stored for older tokens (e.g. ThinK).
    tokens : Policy
        Chooses the tokens (a token scorer or AdaKV).
    """

    channels: ChannelSelector
    tokens: Policy

    @property
    def ratio(self) -> float:
        """Fraction of the cache removed, keys and values counted alike."""
        kept_tokens = 1.0 - self.tokens.ratio
        return 1.0 - kept_tokens * (1.0 - self.channels.ratio / 2)

    @property
    def protected_tokens(self) -> int:
        return max(self.channels.window, self.tokens.protected_tokens)

    @property
    def name(self) -> str:
        return f"{self.channels.name}+{self.tokens.name}"

    @property
    def needs_replay(self) -> bool:
        return self.tokens.needs_replay

    @property
    def needs_all_layers(self) -> bool:
        return self.tokens.needs_all_layers

    @property
    def query_window(self) -> int:
        return self.tokens.query_window

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        return self.plan_layers([inputs], [must_keep])[0]

    def plan_layers(
        self, inputs: list[LayerInputs], must_keep: list[torch.Tensor | None] | None = None
    ) -> list[Plan]:
        must_keep = must_keep or [None] * len(inputs)
        channel_plans = [self.channels.plan(x) for x in inputs]
        windows = [
            _full_width_window(x, p, m)
            for x, p, m in zip(inputs, channel_plans, must_keep, strict=True)
        ]
        token_plans = self.tokens.plan_layers(inputs, windows)
        return [
            Plan(keep=t.keep, channels=c.channels, full_width_from=c.full_width_from)
            for t, c in zip(token_plans, channel_plans, strict=True)
        ]


def _full_width_window(
    inputs: LayerInputs, channel_plan: Plan, must_keep: torch.Tensor | None
) -> torch.Tensor:
    """The tokens the token policy must keep: the channel selector's full-width window (real
    tokens only) and any forced ones."""
    positions = torch.arange(inputs.num_tokens, device=inputs.keys.device)
    window = (positions >= channel_plan.full_width_from)[None, :] & inputs.valid
    if window.dim() == 3:  # per-head validity: the window is kept where any head has it
        window = window.any(1)
    return window if must_keep is None else window | must_keep


def compose(first: Policy, second: Policy) -> Composed:
    """Combine one channel selector and one token policy, in either order."""
    pair = (first, second)
    channel = [p for p in pair if isinstance(p, ChannelSelector)]
    token = [p for p in pair if not isinstance(p, (ChannelSelector, Composed))]
    if len(channel) != 1 or len(token) != 1:
        raise ValueError(
            "a composition takes one channel policy (think) and one token policy "
            f"(snapkv, ada-snapkv, ...), got {first!r} and {second!r}"
        )
    return Composed(channels=channel[0], tokens=token[0])
