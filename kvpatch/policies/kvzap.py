"""KVzap: KVzip's choices without its replay, from a map fitted per model
(https://arxiv.org/abs/2601.07891).

KVzip+ scores a token by the attention it gets while the model repeats its context, which costs
a second pass over the context and exists only for a whole prefill. KVzap fits, once per model,
a small map from each token's hidden state (the attention's input, after the layer's input norm)
to the log of that score for each KV head, then scores any token from its hidden state alone:
in a prefill, in every chunk of a chunked one, in a turn appended later and while decoding.
``kvpatch fit-scorer`` fits the map (:mod:`kvpatch.tools.fitting`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvpatch.policies import fitted_maps
from kvpatch.policies.base import TokenScorer
from kvpatch.policies.contract import (
    DEFAULT_PROMPT_WINDOW,
    DEFAULT_SINKS,
    LayerInputs,
    check_ratio,
    check_sinks,
    check_token_count,
)
from kvpatch.policies.fitted_maps import HiddenStateMap


@dataclass
class KVzap(TokenScorer):
    """Score each token from its hidden state with a map fitted to KVzip+'s scores.

    The map (:class:`HiddenStateMap`) is fitted once per model by ``kvpatch fit-scorer`` and
    read from ``path`` (default: where ``fit-scorer`` writes it for the model) when the policy
    meets the model (:func:`kvpatch.enable`, :func:`kvpatch.prefill`, ``generate``). A token is
    scored when it arrives, at a cost of one small matrix product per layer: no query is kept
    and nothing is replayed, so the scores do not depend on the question, and KVzap compresses
    where KVzip cannot: chunked prefills, appended turns and decode budgets. Every token's score
    is kept beside the cache (4 bytes per KV head and token seen) so that the tokens held can be
    ranked again.

    The map scores a prompt's question like any context token (it learnt KVzip+'s scores, whose
    reconstruction needs few of a context's last tokens), so in a prompt that ``generate``
    continues from, the last ``prompt_window`` tokens are kept in every layer and head, within
    the budget, as the authors protect a window of recent tokens; a context compressed for later
    questions (:func:`kvpatch.prefill`) keeps no such window.

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    path : str or None, default None
        The fitted map's file; None: the model's default (``<kvpatch cache>/scorers/``).
    n_sink : int, default 4
        Leading real tokens always kept (0 keeps none).
    prompt_window : int, default 64
        Last tokens of a prompt that ``generate`` continues from, always kept (see above); 0
        keeps none. On SmolLM2-135M with the question in the prompt, ``global-kvzap`` answers
        1.00 of the needles at r = 0.75 with it, 0.30 without (docs/results.md).
    """

    ratio: float = 0.5
    path: str | None = None
    n_sink: int = DEFAULT_SINKS
    prompt_window: int = DEFAULT_PROMPT_WINDOW
    name = "kvzap"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("KVzap", self.n_sink)
        check_token_count(
            "KVzap", "prompt_window", self.prompt_window, "last prompt tokens always kept"
        )
        self.map: HiddenStateMap | None = None  # set when the policy meets its model
        self.model_key: str | None = None  # which model the map was checked against

    @property
    def hidden_state_scorer(self) -> KVzap:
        return self

    def prepare(self, model: torch.nn.Module) -> None:
        """Read the map for ``model``: from ``path``, else from the model's default file; kept
        while the model stays the same."""
        if self.map is not None and self.model_key is None:
            return  # a map given by hand (use_map): the caller vouches for it
        key = fitted_maps.model_key(model)
        if self.map is not None and self.model_key == key:
            return
        path = Path(self.path).expanduser() if self.path else fitted_maps.default_path(model)
        self.use_map(fitted_maps.load_map(path, model), key)

    @property
    def query_window(self) -> int:
        return 1  # reads no query; one keeps the positions known

    def use_map(self, hidden_map: HiddenStateMap, model_key: str | None = None) -> None:
        """Score with ``hidden_map``, read from a file checked against the model identified by
        ``model_key``; None: a map set by hand, used with any model."""
        self.map, self.model_key = hidden_map, model_key

    def hidden_scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Scores ``[batch, kv_heads, tokens]`` of hidden states ``[batch, tokens, hidden]``."""
        if self.map is None:
            raise ValueError(
                "kvzap has no fitted map yet: it is read when the policy meets its model "
                "(kvpatch.enable(model, 'kvzap'), kvpatch.prefill or generate on an enabled "
                "model). Fit one first with: kvpatch fit-scorer --model MODEL"
            )
        return self.map.score(hidden, layer_idx).float()

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        if inputs.hidden_scores is not None:
            return inputs.hidden_scores.float().clone()
        if inputs.hidden_states is None:
            raise ValueError(
                "kvzap scores tokens from their hidden states, which kvpatch's attention records "
                "on an enabled model only: call kvpatch.enable(model) first"
            )
        return self.hidden_scores(inputs.hidden_states, inputs.layer_idx)
