"""Composition: a channel selector and a token policy applied to the same layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import ChannelSelector, LayerInputs, Plan, Policy


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
