"""KVzip: keep what the model needs to reconstruct its context (https://arxiv.org/abs/2505.23416),
and KVzip+, its scores weighted by each token's effect on the layer's output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import (
    DEFAULT_PROMPT_WINDOW,
    DEFAULT_SINKS,
    LayerInputs,
    check_ratio,
    check_sinks,
    spread_scores,
)
from kvpatch.policies.needs import Reconstruction, reconstruction_of

#: how KVzip asks the model to reconstruct the context: the first chunk, then the later ones,
#: which are followed by the last tokens of the chunk before them
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"

#: how a reconstruction query's attention is normalised (see :class:`KVzip`)
NORMALISATIONS = ("chunk", "context")


@dataclass
class KVzip(TokenScorer):
    """Score each token by the largest attention it gets while the model repeats the context.

    After the context's prefill, the model reads a repeat request and the context again,
    teacher-forced, through the uncompressed cache, ``chunk_size`` context tokens at a time (the
    :attr:`reconstruction` this policy declares, run by :mod:`kvpatch.feed.reconstruction`). A
    (KV head, token) pair scores the largest attention weight any reconstruction query of its GQA
    group gives it. Tokens a model needs to reproduce its context are the tokens
    any later question can need, so the scores do not depend on the question.

    With ``normalise="chunk"`` (the authors' scoring), a query's weights are a softmax over the
    sinks, the context tokens its chunk reconstructs and the reconstruction tokens before it, so
    each token is scored by the chunk that repeats it, and scoring costs ``chunk x 2 chunks`` per
    chunk, linear in the context; the layer's output still attends over everything. With
    ``"context"`` the softmax runs over the whole context (every chunk scores every token), a
    cost quadratic in the context. The sinks are the first ``n_sink`` real tokens, or the chat
    template's system prefix when the context starts with it, whichever is longer; they are always
    kept. Turns appended later (:meth:`~kvpatch.CompressedContext.extend`) are scored with the
    whole-context softmax over what is held.

    The reconstruction scores a prompt's question like any context token, and keeps little of it
    (repeating a context needs few of its last tokens), so in a prompt that ``generate`` continues
    from, the last ``prompt_window`` tokens (the question and the chat template's assistant
    header) are kept in every layer and head, within the budget (raised to them and the sinks
    for a prompt shorter than that budget allows). A context compressed for later
    questions (:func:`kvpatch.prefill`) keeps no such window: its whole budget goes to the context.

    A fact is a span of tokens, and the reconstruction need not attend to all of them alike: on
    Gemma 3 270M it attends to a number's last digits and passes over its first. With
    ``span_before=N`` a token's score is at least the best score of the ``N`` tokens after it (and
    with ``span_after=N``, of the ``N`` before it), so a kept token keeps the tokens that lead to
    it; the budget is unchanged.

    The scores exist only for a prefill, so KVzip cannot compress while decoding.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    chunk_size : int, default 512
        Context tokens reconstructed per forward pass.
    n_sink : int, default 4
        Leading real tokens always kept (at least; see above).
    overlap : int, default 8
        A chunk after the first is introduced by the last ``overlap`` tokens of the one before.
    normalise : {"context", "chunk"}, default "context"
        Which keys a reconstruction query's softmax runs over (see above). "chunk" costs less
        time at long contexts (both score a few queries at a time, in bounded memory); on
        SmolLM2-135M "context" keeps more facts with uniform and head-wise budgets and as many
        or more with global ones (README), hence the default.
    prompt_window : int, default 64
        Last tokens of a prompt that ``generate`` continues from, always kept (see above); 0
        keeps none.
    span_before : int, default 8
        How many tokens before a high-scoring token share its score (see above); 0 scores each
        token alone, as KVzip's authors do. On Gemma 3 270M 8 lifts ``global-kvzip`` at r = 0.75
        from 0.20 to 0.95 of the needles found at ~2,000 tokens and from 0.25 to 0.80 at ~8,000;
        on SmolLM2-135M global budgets keep their accuracy and uniform ones gain (``kvzip`` at
        r = 0.5: 0.45 to 0.85; docs/results.md).
    span_after : int, default 0
        How many tokens after a high-scoring token share its score.
    """

    ratio: float = 0.5
    chunk_size: int = 512
    n_sink: int = DEFAULT_SINKS
    overlap: int = 8
    normalise: str = "context"
    prompt_window: int = DEFAULT_PROMPT_WINDOW
    span_before: int = 8
    span_after: int = 0
    name = "kvzip"
    #: its layers score on scales orders of magnitude apart (Gemma 3 270M's three full-attention
    #: layers: medians ~0.49, 0.14, 0.002): a global ranking leaves the quieter ones little but
    #: their floor, which at r = 0.9 lost needles while it shrank with the budget
    layer_floor_max_ratio = 0.75
    #: weight each score by the token's output norm over the query's hidden-state norm (KVzip+)
    weighted = False

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks(type(self).__name__, self.n_sink)
        if self.chunk_size < 1 or min(self._counts.values()) < 0:
            given = ", ".join(f"{name}={value}" for name, value in self._counts.items())
            raise ValueError(
                f"{type(self).__name__} needs chunk_size >= 1 and {', '.join(self._counts)} >= 0"
                f", got chunk_size={self.chunk_size}, {given}"
            )
        if self.normalise not in NORMALISATIONS:
            raise ValueError(
                f"{type(self).__name__} normalise must be one of {NORMALISATIONS}, got "
                f"{self.normalise!r}"
            )

    @property
    def _counts(self) -> dict[str, int]:
        """The settings that count tokens and may be 0."""
        names = ("overlap", "prompt_window", "span_before", "span_after")
        return {name: getattr(self, name) for name in names}

    @property
    def reconstruction(self) -> Reconstruction:
        return Reconstruction(
            first_prompt=REPEAT_PROMPT,
            continue_prompt=CONTINUE_PROMPT,
            chunk_size=self.chunk_size,
            overlap=self.overlap,
            sinks=self.n_sink,
            local=self.normalise == "chunk",
            weighted=self.weighted,
        )

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        if inputs.reconstruction_scores is None and reconstruction_of(self) is None:
            return torch.zeros(inputs.keys.shape[:-1], device=inputs.keys.device)  # all kept
        if inputs.reconstruction_scores is None:
            raise ValueError(
                f"{self.name} scores tokens from a reconstruction of the whole context, which "
                "only a prefill can provide (kvpatch.prefill, or generate on an enabled model); "
                "it cannot be used to compress while decoding (decode_budget)"
            )
        return spread_scores(
            inputs.reconstruction_scores, inputs.head_valid, self.span_after, self.span_before
        )


@dataclass
class KVzipPlus(KVzip):
    """KVzip whose attention weights are scaled by what each token adds to the layer's output.

    A weight ``a[g, t, i]`` of query head ``g`` of the group, reconstruction query ``t`` and token
    ``i`` becomes ``a[g, t, i] * ||W_o[g] v_i|| / ||h_t||``: ``W_o[g]`` is the slice of the output
    projection that head ``g`` writes through, ``v_i`` the token's value, ``h_t`` the hidden state
    the attention reads (after the input norm). The group's query heads each weigh with their own
    slice, and the score is the largest weighted value over the group and the queries, as in
    KVzip. The parameters are :class:`KVzip`'s. kvpress calls this normalisation KVzip+.
    """

    name = "kvzip-plus"
    weighted = True
