"""The contract between a compression policy and the cache, and the selection rules every policy
shares.

At the end of a layer's prefill the cache hands the policy a :class:`LayerInputs` (the layer's real
queries, keys and values) and gets back a :class:`Plan`: which tokens every (batch row, KV head)
keeps and which key channels are stored for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: keys scored at a time by :meth:`LayerInputs.mean_window_attention` (its workspace is
#: ``window x SCORE_CHUNK`` fp32 scores per query head, twice)
SCORE_CHUNK = 4096


#: leading real tokens every token policy keeps unless told otherwise (the attention sinks)
DEFAULT_SINKS = 4
#: the last tokens of a prompt that ``generate`` continues from (its question and the chat
#: template's assistant header) that a scorer blind to the question keeps in every head
DEFAULT_PROMPT_WINDOW = 64


def check_token_count(owner: str, name: str, count: int, kept: str) -> None:
    """Reject a setting ``name`` that counts tokens always ``kept`` and is not a non-negative
    integer."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(
            f"{owner} needs an integer {name} >= 0 ({kept}; 0 keeps none), got {count!r}"
        )


def check_sinks(owner: str, n_sink: int) -> None:
    """Reject a sink count that is not a non-negative integer."""
    check_token_count(owner, "n_sink", n_sink, "leading tokens always kept")


def check_ratio(ratio: float, name: str = "ratio") -> None:
    """Reject a compression ratio outside [0, 1) with an error that says what is allowed."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or math.isnan(ratio):
        raise ValueError(f"{name} must be a number in [0, 1), got {ratio!r}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the fraction removed), got {ratio}")


@dataclass
class LayerInputs:
    """One layer's cache content, as the policy sees it: the prefill, or (when the cache is
    compressed again while decoding) the tokens it holds.

    Attributes
    ----------
    queries : Tensor ``[batch, q_heads, n_queries, head_dim]``, after RoPE and any q-norm: the
        queries of the last ``n_queries`` tokens (every token at prefill, a recent window while
        decoding).
    keys : Tensor ``[batch, kv_heads, tokens, head_dim]``, after RoPE and any k-norm.
    values : Tensor ``[batch, kv_heads, tokens, v_head_dim]``.
    valid : bool Tensor ``[batch, tokens]`` or ``[batch, kv_heads, tokens]``, False where there
        is no real token (padding).
    scaling : the softmax scale the model uses for this layer.
    layer_idx : index of the layer in the model.
    keep_tokens : if set, the number of tokens each head keeps, instead of the ratio's share: an
        int, or a long Tensor ``[batch]`` with one budget per row.
    rotary : the model's rotary embedding as ``positions [n] -> (cos, sin)``, each ``[n,
        head_dim]`` (rotate-half convention), or None for a model without one.
    query_positions : long Tensor ``[batch, n_queries]``, the position ids of the queries
        (every real token counted from 0); None at prefill, where they follow from ``valid``.
    reconstruction_scores : Tensor ``[batch, kv_heads, tokens]``, the largest attention each token
        got from the queries of a context reconstruction (:mod:`kvpatch.feed.reconstruction`),
        when the policy asked for one.
    sink_tokens : leading real tokens the context itself asks to keep (a chat template's system
        prefix), on top of the policy's own ``n_sink``.
    recent_tokens : trailing real tokens the prompt asks to keep (the question of a prompt that
        ``generate`` continues from, :attr:`Policy.prompt_window`).
    at_start : whether the tokens begin the sequence, so that its leading ones are the sinks
        (False for a segment appended later, e.g. a chat turn).
    scores : Tensor ``[batch, kv_heads, tokens]``, the token scorer's own scores, computed at the
        layer's prefill when compression waits for every layer (so that its queries need not be
        kept); None: the scorer computes them.
    hidden_states : Tensor ``[batch, tokens, hidden]``, what the attention read for these tokens
        (after the layer's input norm), for a policy that scores from it; None otherwise.
    hidden_scores : Tensor ``[batch, kv_heads, tokens]``, such a policy's scores of tokens held
        earlier, computed from their hidden states as they arrived.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    scaling: float
    layer_idx: int = 0
    keep_tokens: int | torch.Tensor | None = None
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    query_positions: torch.Tensor | None = None
    reconstruction_scores: torch.Tensor | None = None
    sink_tokens: int = 0
    recent_tokens: int = 0
    at_start: bool = True
    scores: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    hidden_scores: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.queries.shape[1] // self.keys.shape[1]

    @property
    def head_valid(self) -> torch.Tensor:
        """``valid`` as ``[batch, kv_heads, tokens]``."""
        if self.valid.dim() == 3:
            return self.valid
        return self.valid[:, None, :].expand(-1, self.keys.shape[1], -1)

    def positions_of_queries(self) -> torch.Tensor:
        """Position ids of the queries, ``[batch, n_queries]`` (padding queries get 0)."""
        if self.query_positions is not None:
            return self.query_positions
        valid = self.valid if self.valid.dim() == 2 else self.valid.any(1)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        return positions[:, -self.queries.shape[2] :]

    def grouped_queries(self) -> torch.Tensor:
        """Queries as ``[batch, kv_heads, group_size, n_queries, head_dim]``."""
        b, _, n, d = self.queries.shape
        return self.queries.view(b, self.keys.shape[1], self.group_size, n, d)

    def window_attention(self, window: int) -> torch.Tensor:
        """Softmax attention of the last ``window`` queries over all keys, fp32.

        Returns ``[batch, kv_heads, group_size, window, tokens]`` (``window`` capped by the
        queries available); causal inside the window, padding keys get zero weight.
        """
        queries = self._window_queries(window)
        scores = self._window_scores(queries, 0, self.num_tokens)
        return scores.softmax(dim=-1).nan_to_num_(0.0)

    def mean_window_attention(self, window: int, chunk: int | None = None) -> torch.Tensor:
        """:meth:`window_attention` averaged over its queries, ``[batch, kv_heads, group_size,
        tokens]``, computed ``chunk`` keys (default :data:`SCORE_CHUNK`) at a time: the window's
        scores over a long context (``window x tokens`` per query head, in fp32) are never held
        at once. Two passes over the keys: each query's log-sum-exp, then its weights."""
        t, chunk = self.num_tokens, chunk or SCORE_CHUNK
        if t <= chunk:
            return self.window_attention(window).mean(dim=3)
        queries = self._window_queries(window)
        spans = [(start, min(start + chunk, t)) for start in range(0, t, chunk)]
        lse = torch.stack(
            [self._window_scores(queries, *span).logsumexp(-1) for span in spans]
        ).logsumexp(0)  # [b, h, g, w]
        mean = queries.new_empty(*lse.shape[:3], t)
        for start, end in spans:
            weights = (self._window_scores(queries, start, end) - lse[..., None]).exp_()
            mean[..., start:end] = weights.nan_to_num_(0.0).mean(dim=3)
        return mean

    def _window_queries(self, window: int) -> torch.Tensor:
        """The last ``window`` queries (capped by the tokens and queries there are), fp32,
        ``[batch, kv_heads, group_size, window, head_dim]``."""
        window = min(window, self.num_tokens, self.queries.shape[2])
        return self.grouped_queries()[..., -window:, :].float()

    def _window_scores(self, queries: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Scaled scores of the window ``queries`` over keys ``start`` to ``end``, -inf where a
        query does not see the key (after it, or padding)."""
        t, window = self.num_tokens, queries.shape[3]
        keys = self.keys[:, :, start:end].float()
        scores = torch.einsum("bhgwd,bhtd->bhgwt", queries, keys) * self.scaling
        query_pos = torch.arange(t - window, t, device=queries.device)
        key_pos = torch.arange(start, end, device=queries.device)
        visible = (key_pos[None, :] <= query_pos[:, None])[None, None, None]
        visible = visible & self.head_valid[:, :, None, None, start:end]
        return scores.masked_fill_(~visible, float("-inf"))  # in place: one [w, t] per head


@dataclass
class Plan:
    """What one layer keeps.

    Attributes
    ----------
    keep : bool Tensor ``[batch, kv_heads, tokens]``; each (row, head) may keep a different number.
    channels : long Tensor ``[batch, kv_heads, kept_channels]`` (sorted) or None for all channels:
        the key channels stored for kept tokens before ``full_width_from``.
    full_width_from : tokens at or after this position keep every channel; every head keeps them.
    value_channels : long Tensor ``[batch, kv_heads, kept_value_channels]`` (sorted) or None: the
        value channels stored for kept tokens before ``full_width_from``.
    """

    keep: torch.Tensor
    channels: torch.Tensor | None
    full_width_from: int
    value_channels: torch.Tensor | None = None

    def check(self, inputs: LayerInputs) -> None:
        """Reject a plan that does not fit ``inputs`` (a policy's bug, caught before storage)."""
        b, h, t, _ = inputs.keys.shape
        if self.keep.shape != (b, h, t) or self.keep.dtype != torch.bool:
            raise ValueError(
                f"a plan's keep mask must be bool [{b}, {h}, {t}], got {tuple(self.keep.shape)}"
            )
        if not 0 <= self.full_width_from <= t:
            raise ValueError(f"full_width_from must be in [0, {t}], got {self.full_width_from}")
        # a branch on tensor values: checked in eager runs only (torch.compile and torch.export
        # trace the forward, where such a branch cannot be decided)
        if not torch.compiler.is_compiling() and (self.keep & ~inputs.head_valid).any():
            raise ValueError("a plan must not keep padding tokens")
        for name, width in (
            ("channels", inputs.keys.shape[-1]),
            ("value_channels", inputs.values.shape[-1]),
        ):
            index = getattr(self, name)
            if index is not None and (
                index.shape[:2] != (b, h) or not 0 < index.shape[-1] <= width
            ):
                raise ValueError(
                    f"a plan's {name} must be [{b}, {h}, n] indices with 0 < n <= {width}, got "
                    f"{tuple(index.shape)}"
                )


def kept_count(inputs: LayerInputs, ratio: float) -> torch.Tensor:
    """Tokens each head keeps, ``[batch, kv_heads]``: its real tokens minus the fraction
    ``ratio`` (or ``inputs.keep_tokens``), at least 1."""
    n = inputs.head_valid.sum(-1)
    if isinstance(inputs.keep_tokens, torch.Tensor):  # one budget per batch row
        return n.minimum(inputs.keep_tokens.to(n.device)[:, None])
    if inputs.keep_tokens is not None:
        return n.clamp(max=inputs.keep_tokens)
    # float64 and a tiny epsilon: 300 * 0.21 must remove 63 tokens, not 62.99999 -> 62
    removed = torch.floor(n.double() * ratio + 1e-9).long()
    return (n - removed).clamp(min=1).minimum(n)


def select_top(scores: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the ``count`` highest scores along the last dim.

    ``count`` has the shape of ``scores`` without its last dim, or a prefix of it (broadcast).
    """
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scores.shape[-1], device=scores.device)
    count = count.reshape(*count.shape, *([1] * (scores.dim() - count.dim())))
    chosen = (ranks < count).expand_as(scores)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, chosen)


def scores_with_rules(
    scores: torch.Tensor, inputs: LayerInputs, must_keep: torch.Tensor | None, n_sink: int = 0
) -> torch.Tensor:
    """Apply the rules every token policy shares: padding is never kept, ``must_keep`` always is,
    and so are the sinks, the first ``max(n_sink, inputs.sink_tokens)`` real tokens of each head
    when ``inputs`` begins the sequence, and its last ``inputs.recent_tokens`` real tokens."""
    scores = scores.float()
    valid = inputs.head_valid
    sinks = max(n_sink, inputs.sink_tokens) if inputs.at_start else 0
    if sinks:
        leading = valid & (valid.long().cumsum(-1) <= sinks)
        scores = scores.masked_fill(leading, float("inf"))
    if inputs.recent_tokens:
        scores = scores.masked_fill(recent_window(inputs), float("inf"))
    if must_keep is not None:
        scores = scores.masked_fill(must_keep[:, None, :], float("inf"))
    return scores.masked_fill(~inputs.head_valid, float("-inf"))


def recent_window(inputs: LayerInputs) -> torch.Tensor:
    """The last ``inputs.recent_tokens`` real tokens of each head, ``[batch, kv_heads, tokens]``."""
    valid = inputs.head_valid
    return valid & (valid.long().flip(-1).cumsum(-1).flip(-1) <= inputs.recent_tokens)


def budget_per_head(scores: torch.Tensor, inputs: LayerInputs, ratio: float) -> torch.Tensor:
    """Tokens per head ``[batch, kv_heads]``: the ratio's budget, raised to cover every token
    that must be kept."""
    return torch.maximum(kept_count(inputs, ratio), protected_count(scores))


def row_budget(scores: torch.Tensor, inputs: LayerInputs, ratio: float) -> torch.Tensor:
    """Tokens the KV heads of each batch row keep together, ``[batch]``, for budgets shared
    across heads: the per-head budgets' sum; under ``keep_tokens``, that many per head on
    average (a head holding fewer leaves the rest to the others), never more than is held."""
    per_head = budget_per_head(scores, inputs, ratio)
    if inputs.keep_tokens is None:
        return per_head.sum(-1)
    held = inputs.head_valid.sum(dim=(-1, -2))
    keep = torch.as_tensor(inputs.keep_tokens, device=held.device).expand_as(held)
    return held.minimum(per_head.sum(-1).maximum(keep * per_head.shape[-1]))


def protected_count(scores: torch.Tensor) -> torch.Tensor:
    """Tokens per head that must be kept (a score of ``+inf``), ``[batch, kv_heads]``."""
    return (torch.isinf(scores) & (scores > 0)).sum(-1)


def full_width_window(
    inputs: LayerInputs, full_width_from: int, must_keep: torch.Tensor | None
) -> torch.Tensor:
    """The tokens the token policy must keep: the channel selectors' full-width window (real
    tokens only) and any forced ones."""
    positions = torch.arange(inputs.num_tokens, device=inputs.keys.device)
    window = (positions >= full_width_from)[None, :] & inputs.valid
    if window.dim() == 3:  # per-head validity: the window is kept where any head has it
        window = window.any(1)
    return window if must_keep is None else window | must_keep


def spread_scores(
    scores: torch.Tensor, valid: torch.Tensor, after: int = 8, before: int = 0
) -> torch.Tensor:
    """``out[..., i] = max(scores[..., i - after : i + before + 1])`` over real tokens: a score
    carried to the tokens around it (the span policies, KVzip's ``span_before``).

    ``scores`` is ``[..., tokens]``; ``+inf`` marks protected tokens, which stay ``+inf`` but do not
    spread (a window would otherwise grow). Padding (``valid`` False) neither gives nor gets a
    score (it is masked later anyway).
    """
    if after < 0 or before < 0:
        raise ValueError(f"span widths must be >= 0, got after={after}, before={before}")
    scores = scores.float()
    protected = torch.isposinf(scores)
    source = scores.masked_fill(protected | ~valid, float("-inf"))
    if after or before:
        padded = F.pad(source, (after, before), value=float("-inf"))
        source = padded.unfold(-1, after + before + 1, 1).amax(-1)
    # a token with no scored neighbour at all keeps its own score
    source = torch.where(torch.isneginf(source), scores, source)
    return source.masked_fill(protected, float("inf"))
