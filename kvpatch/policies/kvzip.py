"""KVzip: keep what the model needs to reconstruct its context (https://arxiv.org/abs/2505.23416)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import LayerInputs, check_ratio

#: how KVzip asks the model to reconstruct the context: the first chunk, then the later ones,
#: which are followed by the last tokens of the chunk before them
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class KVzip(TokenScorer):
    """Score each token by the largest attention it gets while the model repeats the context.

    After the context's prefill, :mod:`kvpatch.replay` feeds the model a repeat request and the
    context again, teacher-forced, through the uncompressed cache, ``chunk_size`` context tokens
    at a time. A (KV head, token) pair scores the largest softmax weight any reconstruction query
    of its GQA group gives it. Tokens a model needs to reproduce its context are the tokens any
    later question can need, so the scores do not depend on the question. The first ``n_sink``
    real tokens are always kept.

    The replay costs about one more prefill; no attention matrix larger than
    ``chunk_size + prompt`` queries by the context is ever held. The scores exist only for a
    prefill, so KVzip cannot compress while decoding.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    chunk_size : int, default 512
        Context tokens reconstructed per forward pass.
    n_sink : int, default 4
        Leading real tokens always kept.
    overlap : int, default 8
        A chunk after the first is introduced by the last ``overlap`` tokens of the one before.
    """

    ratio: float = 0.5
    chunk_size: int = 512
    n_sink: int = 4
    overlap: int = 8
    name = "kvzip"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        if self.chunk_size < 1 or self.n_sink < 0 or self.overlap < 0:
            raise ValueError(
                "KVzip needs chunk_size >= 1, n_sink >= 0 and overlap >= 0, got "
                f"chunk_size={self.chunk_size}, n_sink={self.n_sink}, overlap={self.overlap}"
            )

    @property
    def protected_tokens(self) -> int:
        return self.n_sink

    @property
    def needs_replay(self) -> bool:
        return True

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        if inputs.replay_attention is None:
            raise ValueError(
                "kvzip scores tokens from a reconstruction of the whole context, which only a "
                "prefill can provide (kvpatch.prefill, or generate on an enabled model); it "
                "cannot be used to compress while decoding (decode_budget)"
            )
        scores = inputs.replay_attention.float().clone()
        rank = inputs.head_valid.long().cumsum(-1) - 1
        return scores.masked_fill(inputs.head_valid & (rank < self.n_sink), float("inf"))
