"""The kinds of policy. Each has one method to implement:

- :class:`TokenScorer` — ``score(inputs)``: one score per token and KV head; the highest are kept,
  with the same budget for every head of a batch row.
- :class:`ChannelSelector` — ``select_channels(inputs)``: the key (or value) channels each KV
  head keeps.
- :class:`Policy` itself — ``plan(inputs)``: anything else (head-wise budgets).

:class:`Composed` (``key_channels + value_channels + token_policy``, any two or three) is the
one rule that combines them; it lives here so that ``Policy.__add__`` needs nothing above this
module.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpatch.policies.contract import (
    DEFAULT_SINKS,
    LayerInputs,
    Plan,
    budget_per_head,
    check_ratio,
    full_width_window,
    scores_with_rules,
    select_top,
)
from kvpatch.policies.needs import HiddenStateScorer, Reconstruction

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
    def full_width_tokens(self) -> int:
        """How many of the newest tokens keep every channel (a channel selector's window)."""
        return 0

    @property
    def prompt_window(self) -> int:
        """How many of the last tokens of a prompt that ``generate`` continues from (the question,
        when it is in the prompt) every layer and head keeps, for a policy whose scores do not
        favour them; a context compressed for later questions (:func:`kvpatch.prefill`) keeps no
        such window."""
        return 0

    @property
    def keeps_everything(self) -> bool:
        """Whether the policy keeps every token and channel (a ratio of 0): its layers then stay
        plain dense layers, never planned. A policy that decides otherwise says False."""
        return False

    @property
    def token_part(self) -> Policy | None:
        """The part of the policy that evicts tokens (what compressing again runs), or None for
        channel pruning alone."""
        return self

    @property
    def deferred_scorer(self) -> TokenScorer | None:
        """The token scorer whose scores a layer waiting for every layer keeps, computed at its
        prefill, instead of its queries (shared budgets rank them later); None: the layer keeps
        its inputs whole (a policy of the user's own)."""
        return None

    @property
    def reconstruction(self) -> Reconstruction | None:
        """The pass over the context that scores the tokens after the prefill, or None: the
        cache then holds the whole prefill until :mod:`kvpatch.feed.reconstruction` has run it,
        which needs the model's tokenizer."""
        return None

    @property
    def needs_all_layers(self) -> bool:
        """Whether :meth:`plan_layers` must see every layer at once (budgets shared across
        layers, or scores from a reconstruction): compression then waits for the end of the
        prefill."""
        return self.reconstruction is not None

    @property
    def hidden_state_scorer(self) -> HiddenStateScorer | None:
        """What scores each token from its hidden state as it arrives, or None: the cache then
        keeps every token's score, to rank what it holds again later."""
        return None

    @property
    def needs_hidden_states(self) -> bool:
        """Whether :meth:`plan` reads the hidden states of the layer's tokens: the attention then
        hands the policy what it read."""
        return self.hidden_state_scorer is not None

    def prepare(self, model: torch.nn.Module) -> None:
        """Load what the policy needs for ``model`` before it runs (a fitted map); called when
        the policy meets the model (``enable``, ``prefill``, ``generate``)."""
        return None  # most policies need nothing but the layer's prefill

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

    Subclasses are dataclasses with ``ratio`` and ``n_sink`` fields and implement :meth:`score`.
    A score of ``+inf`` marks a token that is always kept (a window). The first ``n_sink`` real
    tokens of each row (the attention sinks) are always kept too, whatever :meth:`score` says.
    """

    #: short name used in policy strings
    name: str = ""
    #: leading real tokens always kept (attention sinks); 0 keeps none
    n_sink: int = DEFAULT_SINKS
    #: past this ratio, budgets shared across layers (:class:`~kvpatch.policies.GlobalBudgets`)
    #: stop shrinking each layer's floor with its budget; 1: the floor shrinks at every ratio
    layer_floor_max_ratio: ClassVar[float] = 1.0

    @property
    def protected_tokens(self) -> int:
        return self.n_sink

    @property
    def keeps_everything(self) -> bool:
        return self.ratio == 0  # the top (1 - 0) * n of n real tokens: all of them

    @abstractmethod
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        """Return ``[batch, kv_heads, tokens]`` scores; higher is kept first."""

    def rule_scores(
        self, inputs: LayerInputs, must_keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`score` (or the scores computed earlier, ``inputs.scores``) with the rules every
        token policy shares: padding never kept, sinks and ``must_keep`` always kept."""
        scores = self.score(inputs) if inputs.scores is None else inputs.scores
        return scores_with_rules(scores, inputs, must_keep, self.n_sink)

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        scores = self.rule_scores(inputs, must_keep)
        keep = select_top(scores, budget_per_head(scores, inputs, self.ratio))
        return Plan(keep=keep, channels=None, full_width_from=inputs.num_tokens)


class ChannelSelector(Policy):
    """A policy that prunes the key channels (``prunes = "keys"``) or the value channels
    (``"values"``) of each KV head; it keeps every (real) token.

    Subclasses are dataclasses with ``ratio`` (fraction of the channels removed) and ``window``
    (the last tokens keep full width) and implement :meth:`select_channels`.
    """

    name: str = ""
    window: int = 0
    #: which tensor's channels are pruned: "keys" or "values"
    prunes: ClassVar[str] = "keys"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(
                f"{type(self).__name__} needs an integer window >= 1 (its observation window, "
                f"kept at full width), got {self.window!r}"
            )

    @abstractmethod
    def select_channels(self, inputs: LayerInputs) -> torch.Tensor:
        """Return ``[batch, kv_heads, kept_channels]`` channel indices."""

    def kept_channels(self, head_dim: int) -> int:
        return head_dim - math.floor(head_dim * self.ratio)

    @property
    def keeps_everything(self) -> bool:
        return self.ratio == 0  # head_dim - floor(0) channels: all of them

    @property
    def full_width_tokens(self) -> int:
        return self.window

    @property
    def token_part(self) -> Policy | None:
        return None  # it keeps every token

    def full_width_from(self, inputs: LayerInputs) -> int:
        return max(inputs.num_tokens - self.window, 0)

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        width = (inputs.keys if self.prunes == "keys" else inputs.values).shape[-1]
        channels = self.select_channels(inputs).sort(dim=-1).values
        channels = None if channels.shape[-1] == width else channels
        keys, values = (channels, None) if self.prunes == "keys" else (None, channels)
        return Plan(
            keep=inputs.head_valid.clone(),
            channels=keys,
            full_width_from=self.full_width_from(inputs),
            value_channels=values,
        )


@dataclass
class Composed(Policy):
    """Prune key channels, prune value channels and evict tokens, each part by its own policy
    (at least two of the three).

    The channel selectors' full-width window (the longer of the two) is kept by the token policy
    in every head, so that the full-width tokens form one dense block.

    Parameters
    ----------
    channels : ChannelSelector or None
        Chooses the key channels stored for older tokens (``think``).
    tokens : Policy or None
        Chooses the tokens (a token scorer, AdaKV, ...).
    value_channels : ChannelSelector or None
        Chooses the value channels stored for older tokens (``think-v``).
    """

    channels: ChannelSelector | None = None
    tokens: Policy | None = None
    value_channels: ChannelSelector | None = None

    def __post_init__(self) -> None:
        parts = (self.channels, self.tokens, self.value_channels)
        if sum(p is not None for p in parts) < 2:
            raise ValueError("a composition takes at least two of: key channels, tokens, values")
        for selector, prunes in ((self.channels, "keys"), (self.value_channels, "values")):
            if selector is not None and getattr(selector, "prunes", None) != prunes:
                raise ValueError(f"{selector!r} does not prune {prunes}")

    @property
    def selectors(self) -> list[ChannelSelector]:
        return [s for s in (self.channels, self.value_channels) if s is not None]

    @property
    def ratio(self) -> float:
        """Fraction of the cache removed, keys and values counted alike."""
        kept_tokens = 1.0 - (self.tokens.ratio if self.tokens is not None else 0.0)
        key_share = 1.0 - (self.channels.ratio if self.channels is not None else 0.0)
        value_share = 1.0 - (self.value_channels.ratio if self.value_channels is not None else 0.0)
        return 1.0 - kept_tokens * (key_share + value_share) / 2

    @property
    def full_width_tokens(self) -> int:
        return max(s.window for s in self.selectors)

    @property
    def protected_tokens(self) -> int:
        """The full-width window and, before it, the token policy's sinks (or more)."""
        if self.tokens is None:
            return self.full_width_tokens
        sinks = getattr(self.tokens, "n_sink", 0)
        return max(self.full_width_tokens, self.tokens.protected_tokens - sinks) + sinks

    @property
    def name(self) -> str:
        parts = (self.channels, self.value_channels, self.tokens)
        return "+".join(p.name for p in parts if p is not None)

    @property
    def keeps_everything(self) -> bool:
        return all(part.keeps_everything for part in (*self.selectors, self.tokens) if part)

    @property
    def token_part(self) -> Policy | None:
        return self.tokens

    @property
    def deferred_scorer(self) -> TokenScorer | None:
        return None if self.tokens is None else self.tokens.deferred_scorer

    @property
    def reconstruction(self) -> Reconstruction | None:
        return None if self.tokens is None else self.tokens.reconstruction

    @property
    def needs_all_layers(self) -> bool:
        return self.tokens is not None and self.tokens.needs_all_layers

    @property
    def hidden_state_scorer(self) -> HiddenStateScorer | None:
        return None if self.tokens is None else self.tokens.hidden_state_scorer

    @property
    def needs_hidden_states(self) -> bool:
        return self.tokens is not None and self.tokens.needs_hidden_states

    def prepare(self, model: torch.nn.Module) -> None:
        for part in (self.channels, self.value_channels, self.tokens):
            if part is not None:
                part.prepare(model)

    @property
    def query_window(self) -> int:
        return self.tokens.query_window if self.tokens is not None else DEFAULT_QUERY_WINDOW

    @property
    def prompt_window(self) -> int:
        return 0 if self.tokens is None else self.tokens.prompt_window

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        return self.plan_layers([inputs], [must_keep])[0]

    def plan_layers(
        self, inputs: list[LayerInputs], must_keep: list[torch.Tensor | None] | None = None
    ) -> list[Plan]:
        must_keep = must_keep or [None] * len(inputs)
        full_width = [min(s.full_width_from(x) for s in self.selectors) for x in inputs]
        if self.tokens is None:
            keeps = [x.head_valid.clone() for x in inputs]
        else:
            windows = [
                full_width_window(x, start, m)
                for x, start, m in zip(inputs, full_width, must_keep, strict=True)
            ]
            keeps = [plan.keep for plan in self.tokens.plan_layers(inputs, windows)]
        keys = [self.channels.plan(x).channels if self.channels else None for x in inputs]
        values = [
            self.value_channels.plan(x).value_channels if self.value_channels else None
            for x in inputs
        ]
        return [
            Plan(keep=keep, channels=k, full_width_from=start, value_channels=v)
            for keep, k, start, v in zip(keeps, keys, full_width, values, strict=True)
        ]


def compose(*parts: Policy) -> Composed:
    """Combine at most one key-channel selector, one value-channel selector and one token
    policy (at least two of them), in any order; a composition given as a part is unpacked."""
    flat: list[Policy] = []
    for part in parts:
        if isinstance(part, Composed):
            flat += [p for p in (part.channels, part.value_channels, part.tokens) if p is not None]
        else:
            flat.append(part)
    roles: dict[str, list[Policy]] = {"channels": [], "value_channels": [], "tokens": []}
    for part in flat:
        if isinstance(part, ChannelSelector):
            roles["channels" if part.prunes == "keys" else "value_channels"].append(part)
        else:
            roles["tokens"].append(part)
    if len(flat) < 2 or any(len(found) > 1 for found in roles.values()):
        raise ValueError(
            "a composition takes at most one key-channel policy (think), one value-channel "
            "policy (think-v) and one token policy (snapkv, ada-snapkv, ...), got "
            + " and ".join(repr(p) for p in flat)
        )
    return Composed(**{role: found[0] if found else None for role, found in roles.items()})
