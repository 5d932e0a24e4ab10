"""Compressing again what a compressed layer holds.

Two occasions: while decoding, once a layer exceeds its :class:`DecodeBudget`, everything held is
scored from the recent queries and cut back to the budget; and after a segment is appended (a new
chat turn, see :meth:`kvpatch.CompressedContext.extend`), the segment is scored and packed with
the rest. Either way the channels chosen at the prefill stay, and the channel policy's
full-width window stays at full width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpatch.cache.budget import DecodeBudget
from kvpatch.cache.store import CompressedStore
from kvpatch.policies import LayerInputs, Policy
from kvpatch.policies.base import DEFAULT_QUERY_WINDOW

#: queries kept by default for compressing again (a policy may read fewer: ``query_window``)
RECENT_QUERIES = DEFAULT_QUERY_WINDOW


@dataclass
class Deferred:
    """A prefill held densely until the cache compresses every layer together."""

    policy: Policy
    inputs: LayerInputs
    decode_budget: DecodeBudget | None


@dataclass
class LayerSetup:
    """What a compressed layer remembers of its prefill to compress again later."""

    policy: Policy
    scaling: float
    layer_idx: int
    rotary: Callable | None
    #: long ``[batch]``, left padding of each row (positions count real tokens only)
    position_offset: torch.Tensor
    decode_budget: DecodeBudget | None = None
    #: leading real tokens the context asked to keep (``LayerInputs.sink_tokens``)
    sink_tokens: int = 0

    @classmethod
    def from_inputs(
        cls, policy: Policy, inputs: LayerInputs, decode_budget: DecodeBudget | None
    ) -> LayerSetup:
        """The setup of a layer whose prefill was ``inputs``."""
        offset = (~inputs.head_valid[:, 0]).sum(-1)
        return cls(
            policy,
            inputs.scaling,
            inputs.layer_idx,
            inputs.rotary,
            offset,
            decode_budget,
            inputs.sink_tokens,
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        self.position_offset = self.position_offset[rows]

    def positions_of_last(self, end: int, count: int) -> torch.Tensor:
        """Position ids ``[batch, count]`` of the last ``count`` of ``end`` logical tokens."""
        logical = torch.arange(end - count, end, device=self.position_offset.device)
        return (logical[None, :] - self.position_offset[:, None]).clamp(min=0)

    def inputs(self, queries: torch.Tensor, end: int, **fields) -> LayerInputs:
        """:class:`LayerInputs` for tensors ``fields`` scored by the last ``queries``."""
        return LayerInputs(
            queries=queries,
            scaling=self.scaling,
            layer_idx=self.layer_idx,
            rotary=self.rotary,
            query_positions=self.positions_of_last(end, queries.shape[2]),
            sink_tokens=self.sink_tokens,
            **fields,
        )

    def full_width(self, store: CompressedStore) -> int:
        """How many of the last tokens stay at full width: the channel policy's window, capped
        by the tail (0 without pruned channels)."""
        if store.packed.channels is None and store.packed.value_channels is None:
            return 0
        return min(self.policy.full_width_tokens, store.tail_length)

    def full_width_window(self, store: CompressedStore, tokens: int) -> torch.Tensor | None:
        """``[batch, tokens]``: which of the last ``tokens`` must stay full width, and so are
        always kept; None without pruned channels."""
        width = self.full_width(store)
        if not width:
            return None
        window = store.tail_valid.new_zeros(store.tail_valid.shape[0], tokens)
        window[:, tokens - width :] = True
        return window


def scored_for_later(policy: Policy, inputs: LayerInputs) -> LayerInputs:
    """``inputs`` of a layer whose compression waits for every layer, holding only what the
    budget split still needs: the token scorer's scores, computed now, instead of every query
    (the last ones stay, for a channel policy's window and a decode budget). A reconstruction's
    scores come later, from the pass; a policy of another kind keeps its inputs whole."""
    scorer = policy.deferred_scorer
    keep = max(RECENT_QUERIES, policy.query_window, policy.full_width_tokens)
    if policy.reconstruction is not None:
        return dataclasses.replace(inputs, queries=recent(None, inputs.queries, keep))
    if scorer is None:
        return inputs
    scores = scorer.score(inputs)
    return dataclasses.replace(
        inputs, scores=scores, queries=recent(None, inputs.queries, keep), hidden_states=None
    )


def token_part(policy: Policy) -> Policy | None:
    """The part of ``policy`` that evicts tokens, or None for channel pruning alone."""
    return policy.token_part


def check_max_kv_tokens(tokens: int | None, policy: Policy | None) -> int | None:
    """``max_kv_tokens`` as given, or a ValueError naming what it needs."""
    if tokens is None:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"max_kv_tokens must be an integer >= 1, got {tokens!r}")
    if policy is not None:
        bounded_history_policy(policy)
    return tokens


def bounded_history_policy(policy: Policy) -> Policy:
    """The token part of ``policy``, which compresses a bounded history back to its budget with
    the newest turn's queries; a ValueError for a policy that cannot."""
    tokens = token_part(policy)
    if tokens is None or tokens.reconstruction is not None:
        reason = (
            "it only prunes channels"
            if tokens is None
            else "it scores by reconstructing the context"
        )
        name = getattr(policy, "name", "") or type(policy).__name__
        raise ValueError(
            f"max_kv_tokens compresses the older history with the newest turn's queries, which "
            f"{name!r} cannot do ({reason}); use a token policy such as keydiff, snapkv or "
            "ada-snapkv"
        )
    return tokens


def token_policy_of(policy: Policy) -> Policy:
    """The part of ``policy`` that evicts tokens (what re-compression runs); raises for
    channel pruning alone."""
    tokens = token_part(policy)
    if tokens is None:
        raise ValueError(
            f"decoding-time compression needs a token policy (snapkv, ada-snapkv, ...); "
            f"{policy.name!r} only prunes channels"
        )
    return tokens


def check_decode_budget(policy: Policy, budget: DecodeBudget) -> None:
    if token_policy_of(policy).reconstruction is not None:
        raise ValueError(
            f"{policy.name!r} scores tokens from a reconstruction of the prefilled context and "
            "cannot compress while decoding; drop decode_budget or use a policy that scores "
            "from queries (snapkv, tova, ...)"
        )
    if budget.tokens < policy.protected_tokens:
        raise ValueError(
            f"decode_budget={budget.tokens} is smaller than the {policy.protected_tokens} tokens "
            f"that {policy.name!r} always keeps (its window or sinks); use a larger budget"
        )


def recent(
    previous: torch.Tensor | None, queries: torch.Tensor, window: int = RECENT_QUERIES
) -> torch.Tensor:
    """The last ``window`` of ``previous`` followed by ``queries`` (a copy, so that the model's
    query tensor is not kept alive)."""
    if previous is not None:
        queries = torch.cat([previous, queries], dim=-2)
    return queries[..., -window:, :].clone()


def over_decode_budget(store: CompressedStore, budget: DecodeBudget | None) -> bool:
    if budget is None:
        return False
    # average over heads: head-wise budgets (AdaKV) share the layer's total unevenly
    return store.held_per_head() >= budget.tokens + budget.interval


def compress_to_budget(
    store: CompressedStore,
    setup: LayerSetup,
    queries: torch.Tensor,
    hidden_scores: torch.Tensor | None = None,
) -> CompressedStore:
    """Everything held, cut back to the decode budget by the policy scoring with ``queries``
    (or ``hidden_scores``, every slot's, for a policy that scores hidden states)."""
    inputs = held_inputs(store, setup, queries, setup.decode_budget.tokens, hidden_scores)
    must_keep = setup.full_width_window(store, inputs.num_tokens)
    keep = token_policy_of(setup.policy).plan(inputs, must_keep=must_keep).keep
    reserve = setup.decode_budget.interval  # room for the tokens until the next compression
    return keep_held(store, setup, inputs, keep, reserve)


def held_inputs(
    store: CompressedStore,
    setup: LayerSetup,
    queries: torch.Tensor,
    keep_tokens: int | torch.Tensor,
    hidden_scores: torch.Tensor | None = None,
) -> LayerInputs:
    """Everything the layer holds as a policy sees it, scored by the last ``queries`` (or the
    slots' ``hidden_scores``), to keep ``keep_tokens`` per head (an int, or long ``[batch]`` per
    row)."""
    keys, values = store.dense()
    return setup.inputs(
        queries,
        store.end,
        keys=keys,
        values=values,
        valid=store.slot_valid(),
        keep_tokens=keep_tokens,
        hidden_scores=hidden_scores,
    )


def keep_held(
    store: CompressedStore,
    setup: LayerSetup,
    inputs: LayerInputs,
    keep: torch.Tensor,
    reserve: int | None = None,
) -> CompressedStore:
    """The ``keep`` slots of :func:`held_inputs`'s ``inputs``, repacked; the last tokens of a
    channel policy's window stay full width."""
    keep = keep & inputs.head_valid
    dense = (inputs.keys, inputs.values)
    return store.repacked(keep, setup.full_width(store), dense, reserve)


def segment_inputs(
    store: CompressedStore,
    setup: LayerSetup,
    queries: torch.Tensor,
    reconstruction_scores: torch.Tensor | None,
    hidden_scores: torch.Tensor | None = None,
) -> LayerInputs:
    """The tail (tokens held at full width since the last compression) as a policy sees it,
    with the ``queries`` recorded while it was appended (and its tokens' ``hidden_scores``)."""
    keys, values = store.tail()
    return setup.inputs(
        queries,
        store.end,
        keys=keys,
        values=values,
        valid=store.tail_valid,
        reconstruction_scores=reconstruction_scores,
        at_start=False,
        hidden_scores=hidden_scores,
    )


def compress_segment(
    store: CompressedStore, setup: LayerSetup, keep: torch.Tensor
) -> CompressedStore:
    """Keep the ``keep`` tokens ``[batch, kv_heads, tail]`` of the tail, and everything
    compressed before; the last tokens of a channel policy's window stay full width."""
    valid = store.slot_valid()
    packed = store.packed.max_length
    keep = torch.cat([valid[..., :packed], keep & valid[..., packed:]], dim=-1)
    return store.repacked(keep, setup.full_width(store))
