"""Keep whole spans: a token inherits the score of a high-scoring token just before it.

Attention-based scorers (SnapKV, TOVA) score a token by the attention the prompt's last queries pay
it. A multi-token answer such as a 6-digit number ``8 2 7 3 8 0`` is attended that way only up to
its first tokens: the question's queries look for *where* the number is (``... for {key} is: 8``),
and the later digits are attended only while decoding them, one after the other, when they are
already gone. With spans, each token's score is the largest score within ``after`` tokens before
it (and ``before`` tokens after it), so the tokens following a retrieved token are kept with it.
The budget is unchanged: the same number of tokens is kept, chosen from the spread scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import LayerInputs, spread_scores
from kvpatch.policies.snapkv import SnapKV
from kvpatch.policies.tova import TOVA
from kvpatch.policies.wraps import WrapsScorer


@dataclass
class Spans(WrapsScorer, TokenScorer):
    """Wrap any token scorer: a token's score is the best score of the ``after`` tokens before it
    (and ``before`` after it). ``ratio`` is the wrapped scorer's.

    Parameters
    ----------
    scorer : TokenScorer
    after : int, default 8
        How far a high score carries forward (the rest of a number, a name, a short value).
    before : int, default 0
        How far it carries backward.
    """

    scorer: TokenScorer
    after: int = 8
    before: int = 0

    def __post_init__(self) -> None:
        self._check_scorer()
        if self.after < 0 or self.before < 0:
            raise ValueError(f"span widths must be >= 0, got {self.after=}, {self.before=}")

    @property
    def name(self) -> str:
        return f"span-{self.scorer.name}"

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return spread_scores(self.scorer.score(inputs), inputs.head_valid, self.after, self.before)


@dataclass
class _SpreadForward:
    """Mixin for a scorer class: its scores spread ``after`` tokens forward (and ``before``
    backward), as :class:`Spans` does around an instance."""

    after: int = 8
    before: int = 0

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return spread_scores(super().score(inputs), inputs.head_valid, self.after, self.before)


@dataclass
class SpanSnapKV(_SpreadForward, SnapKV):
    """SnapKV whose scores spread ``after`` tokens forward (``span-snapkv`` in policy strings)."""

    name = "span-snapkv"


@dataclass
class SpanTOVA(_SpreadForward, TOVA):
    """TOVA whose scores spread ``after`` tokens forward (``span-tova`` in policy strings)."""

    name = "span-tova"
