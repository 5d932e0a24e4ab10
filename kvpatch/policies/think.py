"""ThinK: prune the key (and value) channels that matter least
(https://arxiv.org/abs/2407.21018)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import ChannelSelector
from kvpatch.policies.contract import LayerInputs


@dataclass
class ThinK(ChannelSelector):
    """Keep, per KV head, the key channels with the largest query-key magnitude.

    The score of channel ``c`` of a KV head is ``mean(q_c^2) * mean(k_c^2)``: ``q`` over the last
    ``window`` queries of the head's GQA group, ``k`` over the real tokens. The last ``window``
    tokens, and every token appended later, keep all channels.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the key channels removed.
    window : int, default 32
        Observation window, which also keeps full width.
    """

    ratio: float = 0.5
    window: int = 32
    name = "think"

    def select_channels(self, inputs: LayerInputs) -> torch.Tensor:
        window = min(self.window, inputs.num_tokens, inputs.queries.shape[2])
        queries = inputs.grouped_queries()[..., -window:, :].float()  # [b, h, g, w, d]
        real = inputs.head_valid[:, :, None, -window:, None].float()  # padding queries don't count
        query_energy = (queries.square() * real).sum(dim=(2, 3)) / (
            real.sum(dim=(2, 3)) * queries.shape[2]
        ).clamp(min=1)  # [b, h, d]
        valid = inputs.head_valid[..., None].float()
        key_energy = (inputs.keys.float().square() * valid).sum(2) / valid.sum(2).clamp(min=1)
        scores = query_energy * key_energy
        kept = self.kept_channels(inputs.keys.shape[-1])
        return scores.topk(kept, dim=-1).indices


@dataclass
class ThinKValues(ChannelSelector):
    """Keep, per KV head, the value channels that carry the most attention output (ThinK's
    value-cache pruning, https://arxiv.org/abs/2407.21018, appendix D).

    The score of value channel ``j`` of head ``i`` is
    ``|| softmax(Q_i[-S_obs:] K_i^T / sqrt(D)) V_i[:, j] ||_F``: the norm of that channel of the
    head's output over the observation window's queries (``S_obs = window``, causal inside it,
    every query of the head's GQA group), i.e. the output lost by dropping it. The last
    ``window`` tokens, and every token appended later, keep all channels.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the value channels removed.
    window : int, default 32
        Observation window, which also keeps full width.
    """

    ratio: float = 0.5
    window: int = 32
    name = "think-v"
    prunes = "values"

    def select_channels(self, inputs: LayerInputs) -> torch.Tensor:
        attention = inputs.window_attention(self.window)  # [b, h, g, w, t]
        output = attention @ inputs.values[:, :, None].float()  # [b, h, g, w, dv]
        scores = output.square().sum(dim=(2, 3))  # squared norm; padding queries add 0
        kept = self.kept_channels(inputs.values.shape[-1])
        return scores.topk(kept, dim=-1).indices
