"""Expected attention: score keys by the attention future queries are expected to pay them
(https://arxiv.org/abs/2510.00636)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks


@dataclass
class ExpectedAttention(TokenScorer):
    """Model the queries still to come as a Gaussian and keep the keys they will attend to.

    The context's own queries (after the first ``n_sink``, un-rotated to their pre-RoPE form)
    give a mean ``mu`` and covariance ``S`` per query head. A query at a future position ``p`` is
    ``R_p q``; averaged over the next ``future_positions`` positions, the rotation is ``R``, so the
    future queries have mean ``R mu`` and covariance ``R S R^T``. For a Gaussian query the
    expected logit of key ``k`` is ``k.R mu * scale + 0.5 * k^T R S R^T k * scale**2``; its softmax
    over the real keys, averaged over the GQA group and times ``||v||`` (a key's effect on the
    output scales with its value), is the score. The first ``n_sink`` tokens are always kept.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    future_positions : int, default 512
        How many positions ahead the rotation is averaged over.
    n_sink : int, default 4
        Leading real tokens always kept and left out of the query statistics.
    use_covariance : bool, default True
        Include the covariance term (False: the mean query only).
    use_value_norm : bool, default True
        Multiply by the value norm.
    epsilon : float, default 0.0
        Added to the attention before the value norm multiplies it, so that value norms rank
        tokens the expected attention barely tells apart (kvpress runs head-wise budgets with
        1e-2).
    """

    ratio: float = 0.5
    future_positions: int = 512
    n_sink: int = DEFAULT_SINKS
    use_covariance: bool = True
    use_value_norm: bool = True
    epsilon: float = 0.0
    name = "expected-attention"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("ExpectedAttention", self.n_sink)
        if self.future_positions < 1 or not self.epsilon >= 0:
            raise ValueError(
                "ExpectedAttention needs future_positions >= 1 and epsilon >= 0, got "
                f"future_positions={self.future_positions}, epsilon={self.epsilon}"
            )

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        b, h, t, d = inputs.keys.shape
        queries, weight = self._query_sample(inputs)  # [b, hq, n, d], [b, 1, n, 1]
        count = weight.sum(2, keepdim=True).clamp(min=1)
        mean = (queries * weight).sum(2, keepdim=True) / count  # [b, hq, 1, d]
        rotation = self._mean_future_rotation(inputs, d)  # [b, d, d]
        future_mean = mean @ rotation.transpose(-1, -2)[:, None]
        keys = inputs.keys.float().repeat_interleave(inputs.group_size, dim=1)  # [b, hq, t, d]
        logits = (keys @ future_mean.transpose(-1, -2)).squeeze(-1) * inputs.scaling
        if self.use_covariance:
            centred = (queries - mean) * weight
            covariance = centred.transpose(-1, -2) @ centred / count  # [b, hq, d, d]
            covariance = rotation[:, None] @ covariance @ rotation.transpose(-1, -2)[:, None]
            quadratic = ((keys @ covariance) * keys).sum(-1)
            logits = logits + 0.5 * quadratic * inputs.scaling**2
        valid = inputs.head_valid.repeat_interleave(inputs.group_size, dim=1)
        attention = logits.masked_fill(~valid, float("-inf")).softmax(-1).nan_to_num(0.0)
        scores = attention.view(b, h, inputs.group_size, t).mean(2)
        if self.use_value_norm:
            scores = (scores + self.epsilon) * inputs.values.float().norm(dim=-1)
        return scores  # the sinks are kept by the rule every token policy shares

    def _query_sample(self, inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-RoPE queries of the real tokens after the sinks, and their 0/1 weights."""
        queries = inputs.queries.float()
        positions = inputs.positions_of_queries()  # [b, n]
        n = queries.shape[2]
        valid = inputs.valid if inputs.valid.dim() == 2 else inputs.valid.any(1)
        real = valid[:, -n:] & (positions >= self.n_sink)
        if inputs.rotary is not None:
            cos, sin = inputs.rotary(positions.flatten())
            cos = cos.float().view(*positions.shape, -1)[:, None]
            sin = sin.float().view(*positions.shape, -1)[:, None]
            queries = queries * cos - _rotate_half(queries) * sin  # R_p^T q: undo the rotation
        return queries, real[:, None, :, None].float()

    def _mean_future_rotation(self, inputs: LayerInputs, dim: int) -> torch.Tensor:
        """``mean_p R_p`` over the next positions of each row, ``[b, d, d]`` (identity without
        a rotary embedding)."""
        b = inputs.keys.shape[0]
        eye = torch.eye(dim, device=inputs.keys.device)
        if inputs.rotary is None:
            return eye.expand(b, dim, dim)
        start = inputs.positions_of_queries()[:, -1] + 1  # [b]
        offsets = torch.arange(self.future_positions, device=start.device)
        future = (start[:, None] + offsets).flatten()
        cos, sin = inputs.rotary(future)
        cos = cos.float().view(b, self.future_positions, dim).mean(1)
        sin = sin.float().view(b, self.future_positions, dim).mean(1)
        # R_p x = x * cos + rotate_half(x) * sin, and rotate_half(x) = J x
        half = dim // 2
        rotate = torch.zeros(dim, dim, device=eye.device)
        rotate[:half, half:] = -torch.eye(half, device=eye.device)
        rotate[half:, :half] = torch.eye(half, device=eye.device)
        return torch.diag_embed(cos) + sin[:, :, None] * rotate


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
