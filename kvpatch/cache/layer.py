"""One full-attention layer of a :class:`~kvpatch.cache.CompressedDynamicCache`: transformers'
layer API over a :class:`~kvpatch.cache.store.CompressedStore` (the storage), moved through the
phases of :mod:`kvpatch.cache.lifecycle`.

Its prefill is stored densely and returned with a ``PrefillRequest``
(:mod:`kvpatch.cache.requests`); kvpatch's attention attends over it exactly, then calls
:meth:`CompressedLayer.compress` (or ``defer``, for a policy that plans every layer at once). The
layer is then a ``CompressedStore``, and ``update`` returns its tail with a ``PackedRequest`` (the
packed tokens read in place) or a transient padded view of it with a ``PaddedRequest``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.cache_utils import DynamicLayer

from kvpatch import checks, compat
from kvpatch.cache import crop, recompress
from kvpatch.cache.budget import DecodeBudget
from kvpatch.cache.held_tensors import HeldTensors
from kvpatch.cache.hidden_scores import HiddenScores
from kvpatch.cache.lifecycle import Lifecycle, Phase
from kvpatch.cache.packed import PackedKV, storage_nbytes
from kvpatch.cache.quantized import Quantization
from kvpatch.cache.recompress import Deferred, LayerSetup, check_decode_budget
from kvpatch.cache.reconstructed import Reconstructed
from kvpatch.cache.reconstruction_chunk import ReconstructionChunk
from kvpatch.cache.requests import PrefillRequest, post
from kvpatch.cache.store import CompressedStore
from kvpatch.policies import HiddenStateScorer, LayerInputs, Plan, Policy


class CompressedLayer(HeldTensors, HiddenScores, Reconstructed, DynamicLayer):
    """One full-attention layer: dense until its prefill is compressed, a
    :class:`~kvpatch.cache.store.CompressedStore` afterwards.

    While dense, ``keys``/``values`` hold everything like ``DynamicLayer``. Once compressed they
    show what the store holds, laid out as transformers lays a layer out (``[batch, kv_heads,
    tokens, head_dim]``, see :class:`~kvpatch.cache.held_tensors.HeldTensors`). kvpatch reads
    the store itself.
    """

    def __init__(self, quantization: Quantization | None = None, **kwargs):
        super().__init__(**kwargs)
        compat.clear_layer(self)
        self.quantization = quantization  # how the packed part is stored, kept across resets
        self._clear()

    def _clear(self) -> None:
        self.store: CompressedStore | None = None
        self.setup: LayerSetup | None = None
        self.seen = 0  # logical length
        self.lifecycle = Lifecycle()
        self.deferred: Deferred | None = None  # what WAITING waits with
        self.reconstructing: ReconstructionChunk | None = None
        self.reconstruction_scores: torch.Tensor | None = None
        # appended tokens compressed after their forward: their queries, recorded while APPENDING
        self.segment_queries: torch.Tensor | None = None
        self.recent_queries: torch.Tensor | None = None  # for a decode budget
        # a policy scoring hidden states: the score of every token seen, [b, h, seen],
        # so that what is held can be ranked again (chunks, appended turns, a decode budget)
        self.hidden_scorer: HiddenStateScorer | None = None
        self.token_scores: torch.Tensor | None = None

    # -- phases ---------------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @contextlib.contextmanager
    def appending(self) -> Iterator[None]:
        """Record the queries of the tokens appended meanwhile (a turn compressed after its
        forward)."""
        self.lifecycle.move(Phase.APPENDING)
        try:
            yield
        finally:
            self.lifecycle.move(Phase.COMPRESSED)

    # -- transformers' layer API ---------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor = None):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :]
        self.values = (value_states if value_states is not None else key_states)[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.phase is Phase.PREFILLED:  # kvpatch's attention did not compress the prefill
            raise RuntimeError(
                "CompressedDynamicCache was used by an attention implementation that does not "
                "compress it. Call kvpatch.enable(model) before running the model with this cache."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        checks.same_kind_of_keys(self.full_width_keys(), key_states)
        if self.phase in (Phase.WAITING, Phase.RECONSTRUCTING):
            return self._reconstruction_view(key_states, value_states)
        first_forward = self.seen == 0
        self.seen += key_states.shape[-2]
        if self.store is not None:
            return self._append_compressed(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if first_forward and self.phase is Phase.EMPTY:
            self.lifecycle.move(Phase.PREFILLED)
            return post(self.keys, PrefillRequest(self)), self.values
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        return self.seen + compat.query_length(query), 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        self._clear()  # a new lifecycle: EMPTY
        compat.clear_layer(self)
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        remove = compat.tokens_to_remove(tokens_to_remove, self.seen)
        if remove == 0:
            return
        if self.store is None:
            self.keys = self.keys[..., : self.keys.shape[-2] - remove, :]
            self.values = self.values[..., : self.values.shape[-2] - remove, :]
        else:
            self.store = crop.crop(self.store, remove)
        self.seen -= remove
        if self.token_scores is not None:
            self.token_scores = self.token_scores[..., : self.seen]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            like = self.full_width_keys()
            rows = torch.arange(like.shape[0], device=like.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        indices = indices.to(self.full_width_keys().device)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        if self.store is None:
            self.keys, self.values = self.keys[indices], self.values[indices]
            return
        self.store.select_rows(indices)
        self.setup.select_rows(indices)
        if self.recent_queries is not None:
            self.recent_queries = self.recent_queries[indices]
        if self.token_scores is not None:
            self.token_scores = self.token_scores[indices]

    reorder_cache = batch_select_indices  # beam search's reordering

    def offload(self):
        self._move("cpu")

    def prefetch(self):
        if self.is_initialized and self.full_width_keys().device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        if self.store is not None:
            self.store.to(device)
            if self.token_scores is not None:
                self.token_scores = self.token_scores.to(device, non_blocking=True)
        elif self.is_initialized:
            self.keys, self.values = (
                t.to(device, non_blocking=True) for t in (self.keys, self.values)
            )

    # -- compression ---------------------------------------------------------------------------

    def compress(
        self,
        policy: Policy | None,
        inputs: LayerInputs,
        decode_budget: DecodeBudget | None = None,
        plan: Plan | None = None,
    ) -> None:
        """Replace the prefill by what ``policy`` keeps (called once, right after the prefill,
        or with the ``plan`` made for every layer at once)."""
        self.deferred = self.reconstructing = self.reconstruction_scores = None
        if kept_whole(policy, inputs, decode_budget, self.quantization):
            self.lifecycle.move(Phase.DENSE)
            return
        self.lifecycle.move(Phase.COMPRESSED)
        if decode_budget is not None:
            check_decode_budget(policy, decode_budget)
        inputs = self._score_hidden_states(policy, inputs)
        if plan is None:
            plan = policy.plan(inputs)
        plan.check(inputs)
        reserve = None if decode_budget is None else decode_budget.interval
        tokens = inputs.num_tokens  # the prefill; tokens after it (candidates) join the tail
        keys, values = self._keys, self._values
        self.store = CompressedStore.from_plan(
            keys[..., :tokens, :],
            values[..., :tokens, :],
            plan,
            inputs.head_valid,
            reserve,
            self.quantization,
        )
        if keys.shape[-2] > tokens:
            self.store.append(keys[..., tokens:, :], values[..., tokens:, :])
        self.setup = LayerSetup.from_inputs(policy, inputs, decode_budget)
        self.keys = self.values = None  # the prefill's storage is freed: the store holds it
        if decode_budget is not None:
            self.recent_queries = recompress.recent(None, inputs.queries, policy.query_window)

    def defer(
        self, policy: Policy, inputs: LayerInputs, decode_budget: DecodeBudget | None = None
    ) -> None:
        """Hold the prefill densely until the cache compresses every layer together."""
        if decode_budget is not None:
            check_decode_budget(policy, decode_budget)
        if kept_whole(policy, inputs, decode_budget, self.quantization):
            self.lifecycle.move(Phase.DENSE)
            return
        self.lifecycle.move(Phase.WAITING)
        inputs = self._score_hidden_states(policy, inputs)
        self.deferred = Deferred(policy, recompress.scored_for_later(policy, inputs), decode_budget)

    def _append_compressed(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if recompress.over_decode_budget(self.store, self.setup.decode_budget):
            self.store = recompress.compress_to_budget(
                self.store, self.setup, self.recent_queries, self._held_scores()
            )
        self.store.append(key_states, value_states)
        return self.store.attention_view(self)

    def remember_queries(self, queries: torch.Tensor) -> None:
        """Keep the last queries, which decoding-time compression scores with, and all of an
        appended segment's while appending."""
        if self.phase is Phase.APPENDING:
            previous = self.segment_queries
            self.segment_queries = (
                queries if previous is None else torch.cat([previous, queries], -2)
            )
        if self.setup.decode_budget is not None:
            self.recent_queries = recompress.recent(
                self.recent_queries, queries, self.setup.policy.query_window
            )

    # -- a segment appended after the compression (a chat turn) ---------------------------------

    def segment_inputs(self) -> LayerInputs:
        """The tail, as a policy sees it, with the queries recorded while it was appended."""
        scores = self.token_scores
        if scores is not None:
            scores = scores[..., self.store.tail_start : self.store.end]
        return recompress.segment_inputs(
            self.store, self.setup, self.segment_queries, self.reconstruction_scores, scores
        )

    def compress_segment(self, keep: torch.Tensor) -> None:
        """Keep the ``keep`` tokens ``[batch, kv_heads, tail]`` of the tail."""
        self.store = recompress.compress_segment(self.store, self.setup, keep)
        self.segment_queries = self.reconstruction_scores = None

    def held_inputs(self, keep_tokens: int | torch.Tensor) -> LayerInputs:
        """Everything held, scored by the recorded queries, to keep ``keep_tokens`` per head."""
        return recompress.held_inputs(
            self.store, self.setup, self.segment_queries, keep_tokens, self._held_scores()
        )

    def keep_held(self, inputs: LayerInputs, keep: torch.Tensor) -> None:
        """Keep the ``keep`` slots of :meth:`held_inputs` (a prefill chunk compressed back)."""
        self.store = recompress.keep_held(self.store, self.setup, inputs, keep)
        self.segment_queries = None

    # -- what is held --------------------------------------------------------------------------

    @property
    def is_compressed(self) -> bool:
        return self.store is not None

    @property
    def packed(self) -> PackedKV | None:
        return None if self.store is None else self.store.packed

    @property
    def policy(self) -> Policy | None:
        """The policy this layer was (or will be) compressed with."""
        holder = self.deferred if self.deferred is not None else self.setup
        return None if holder is None else holder.policy

    def physical_lengths(self) -> torch.Tensor | None:
        """Tokens held per (batch row, KV head), or None before the first update."""
        if not self.is_initialized:
            return None
        if self.store is not None:
            return self.store.physical_lengths()
        b, h, held, _ = self.keys.shape
        return torch.full((b, h), held, dtype=torch.long, device=self.keys.device)

    def nbytes(self) -> int:
        """Bytes of the tensors this layer holds (their storages, not views)."""
        if self.store is None:
            return self.kv_nbytes()
        extra = storage_nbytes(self.recent_queries, self.setup.position_offset, self.token_scores)
        return self.store.nbytes() + extra

    def kv_nbytes(self) -> int:
        """Bytes of the keys and values alone, without positions, indices or queries."""
        if self.store is not None:
            return self.store.kv_nbytes()
        return storage_nbytes(self.keys, self.values) if self.is_initialized else 0


def kept_whole(
    policy: Policy | None,
    inputs: LayerInputs,
    budget: DecodeBudget | None,
    quantization: Quantization | None,
) -> bool:
    """Whether a prefill is kept as it is, a plain dense layer: no policy, a single token, or a
    policy that keeps everything (ratio 0), with no budget in tokens to meet later and no
    quantized storage. Deciding it from settings alone keeps a ratio-0 forward free of branches on
    tensor values (``torch.export``)."""
    if policy is None or inputs.num_tokens <= 1:
        return True
    later = inputs.keep_tokens is not None or budget is not None
    return policy.keeps_everything and not later and quantization is None
