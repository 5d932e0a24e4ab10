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

from dataclasses import dataclass, field

import torch

from kvpatch.policies.base import Policy, TokenScorer
from kvpatch.policies.contract import DEFAULT_SINKS, LayerInputs, check_ratio, check_sinks

#: the kinds of map: a linear layer per model layer, or a two-layer MLP per model layer
MAP_KINDS = ("linear", "mlp")


@dataclass
class HiddenStateMap:
    """Per model layer, a map from a hidden state ``[..., hidden]`` to one log-score per KV head
    ``[..., kv_heads]``.

    Attributes
    ----------
    kind : ``"linear"`` (``h @ weight + bias``) or ``"mlp"`` (``gelu(h @ weight + bias) @ weight2
        + bias2``).
    weight : ``[layers, hidden, kv_heads]`` (linear) or ``[layers, hidden, width]`` (mlp).
    bias : ``[layers, kv_heads]`` or ``[layers, width]``.
    weight2, bias2 : the MLP's second layer, ``[layers, width, kv_heads]`` and ``[layers,
        kv_heads]``; None for a linear map.
    layers : the model layers the map covers (its full-attention layers), in the order of the
        tensors' first dimension.
    """

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor
    layers: list[int]
    weight2: torch.Tensor | None = None
    bias2: torch.Tensor | None = None
    _row: dict[int, int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in MAP_KINDS:
            raise ValueError(f"a map's kind is one of {MAP_KINDS}, got {self.kind!r}")
        if (self.weight2 is None) != (self.kind == "linear"):
            raise ValueError("a linear map has one layer of weights, an MLP two")
        self._row = {layer: row for row, layer in enumerate(self.layers)}

    @property
    def kv_heads(self) -> int:
        return (self.weight if self.weight2 is None else self.weight2).shape[-1]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The map's tensors by name (what a file stores)."""
        named = {"weight": self.weight, "bias": self.bias}
        if self.weight2 is not None:
            named |= {"weight2": self.weight2, "bias2": self.bias2}
        return named

    def score(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Log-scores ``[batch, kv_heads, tokens]`` of hidden states ``[batch, tokens, hidden]``
        of layer ``layer_idx``."""
        row = self._row.get(layer_idx)
        if row is None:
            raise ValueError(
                f"this kvzap map covers layers {self.layers}, not layer {layer_idx}: it was "
                "fitted for another model"
            )
        x = hidden.to(self.weight.dtype)
        out = x @ self.weight[row].to(x.device) + self.bias[row].to(x.device)
        if self.weight2 is not None:
            out = torch.nn.functional.gelu(out) @ self.weight2[row].to(x.device)
            out = out + self.bias2[row].to(x.device)
        return out.transpose(-1, -2)

    def to(self, device: torch.device | str) -> HiddenStateMap:
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return HiddenStateMap(self.kind, layers=self.layers, **moved)


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

    Parameters
    ----------
    ratio : float, default 0.5
        Fraction of the tokens removed.
    path : str or None, default None
        The fitted map's file; None: the model's default (``<kvpatch cache>/scorers/``).
    n_sink : int, default 4
        Leading real tokens always kept (the paper keeps a window instead; 0 keeps none).
    """

    ratio: float = 0.5
    path: str | None = None
    n_sink: int = DEFAULT_SINKS
    name = "kvzap"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_sinks("KVzap", self.n_sink)
        self.map: HiddenStateMap | None = None  # set when the policy meets its model
        self.model_key: str | None = None  # which model the map was checked against

    @property
    def needs_hidden_states(self) -> bool:
        return True

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


def hidden_state_scorer(policy: Policy | None) -> KVzap | None:
    """The :class:`KVzap` inside ``policy`` (composed, head-wise, global, spread), or None."""
    while policy is not None and not isinstance(policy, KVzap):
        policy = getattr(policy, "tokens", None) or getattr(policy, "scorer", None)
    return policy
