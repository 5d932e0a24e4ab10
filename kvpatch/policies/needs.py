"""What a policy needs beyond one layer's prefill, declared by the policy (:class:`Policy`'s
``reconstruction``, ``hidden_state_scorer``, ``needs_all_layers`` and ``prepare``), so that the
cache, the attention and the prefill ask it rather than check which kind of policy they hold.

- :class:`Reconstruction`: a second pass over the context after its prefill, whose attention
  scores the tokens (:mod:`kvpatch.feed.reconstruction` runs it);
- :class:`HiddenStateScorer`: scores each token from its hidden state as it arrives (the cache
  keeps the scores, to rank what it holds again later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Reconstruction:
    """A pass after the prefill that asks the model to repeat its context: the model reads
    ``first_prompt`` and then the context itself, teacher-forced, ``chunk_size`` context tokens
    per forward, through the uncompressed cache; nothing of the pass stays in it. Each (KV head,
    token) pair scores the largest attention weight any query of the pass gives it, in its GQA
    group (``LayerInputs.reconstruction_scores``).

    Attributes
    ----------
    first_prompt : what asks for the context, before the first chunk.
    continue_prompt : what asks for the rest, before a later chunk; followed by the last
        ``overlap`` tokens of the chunk before it.
    chunk_size : context tokens read per forward.
    overlap : tokens of the chunk before that introduce a later chunk (0: ``first_prompt``).
    sinks : leading real tokens always kept.
    local : each query's weights normalised over the sinks, the context tokens its chunk repeats
        and the chunk itself (cost linear in the context) instead of the whole context.
    weighted : each weight scaled by what the token adds to the layer's output over the norm of
        the query's hidden state (the pass records the hidden states' norms).
    """

    first_prompt: str
    continue_prompt: str
    chunk_size: int
    overlap: int
    sinks: int
    local: bool = False
    weighted: bool = False


class HiddenStateScorer(Protocol):
    """Scores tokens from the hidden states the attention reads (after the layer's input norm)."""

    def hidden_scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Scores ``[batch, kv_heads, tokens]`` of hidden states ``[batch, tokens, hidden]``."""


def reconstruction_of(policy) -> Reconstruction | None:
    """The reconstruction a prefill runs for ``policy``, or None: none at ratio 0, where every
    token is kept whatever the scores (no tokenizer, no extra pass, token ids or embeddings)."""
    if policy is None or policy.reconstruction is None:
        return None
    tokens = getattr(policy, "tokens", policy)  # a composed policy's token part
    return policy.reconstruction if tokens.ratio > 0 else None
