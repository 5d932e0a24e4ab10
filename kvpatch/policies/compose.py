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

    def plan(self, inputs: LayerInputs, must_keep: torch.Tensor | None = None) -> Plan:
        channel_plan = self.channels.plan(inputs)
        positions = torch.arange(inputs.num_tokens, device=inputs.keys.device)
        window = (positions >= channel_plan.full_width_from)[None, :] & inputs.valid
        if window.dim() == 3:  # per-head validity: the window is kept where any head has it
            window = window.any(1)
        if must_keep is not None:
            window = window | must_keep
        token_plan = self.tokens.plan(inputs, must_keep=window)
        return Plan(
            keep=token_plan.keep,
            channels=channel_plan.channels,
            full_width_from=channel_plan.full_width_from,
        )


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
