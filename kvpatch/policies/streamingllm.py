"""StreamingLLM: attention sinks plus a recent window (https://arxiv.org/abs/2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks


@dataclass
class StreamingLLM(TokenScorer):
    """Keep the first ``n_sink`` real tokens of each row and then the most recent ones.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    n_sink : int, default 4
        Number of leading tokens always kept (the attention sinks), counted from the first
        non-padding token of each row.
    """

    ratio: float = 0.5
    n_sink: int = DEFAULT_SINKS
    name = "streamingllm"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("StreamingLLM", self.n_sink)

    @property
    def query_window(self) -> int:
        return 1  # reads no query; one keeps the positions known

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        valid = inputs.head_valid
        rank = valid.long().cumsum(-1) - 1  # position among the head's real tokens
        return rank.float()  # the sinks are kept by the rule every token policy shares
