"""A transformers cache that stores only what the policy keeps.

:class:`CompressedLayer` is one full-attention layer. Its life:

1. **prefill** — the first ``update`` stores the prompt's keys and values densely, like
   ``DynamicLayer``, and returns them marked :class:`PrefillView`. The kvpatch attention function
   computes the prefill's attention exactly, then calls :meth:`CompressedLayer.compress`.
2. **compressed** — the prefill is replaced by a :class:`~kvpatch.packed.PackedKV` (variable-length
   heads, channel-pruned keys) and a dense full-width *tail* (the policy's full-width window, then
   every token appended later). ``update`` appends to the tail and returns a transient dense view of
   the whole layer, marked :class:`CompressedView` so the attention function knows which slots are
   padding and where the tail starts.

Lengths are *logical* (tokens seen, which positions and masks follow) or *physical* (tokens held).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvpatch import compat
from kvpatch.buffer import GrowingBuffer
from kvpatch.packed import PackedKV, storage_nbytes
from kvpatch.policies import ChannelSelector, Composed, LayerInputs, Plan, Policy, parse_policy

_VIEW_ATTRIBUTE = "_kvpatch_view"
#: queries kept per layer for decoding-time compression (SnapKV's default window)
RECENT_QUERIES = 64


@dataclass
class PrefillView:
    """Marks the keys of a layer's first forward: compress after attending.

    ``policy`` is the cache's own policy, which overrides the model's.
    """

    layer: CompressedLayer
    policy: Policy | None = None
    decode_budget: DecodeBudget | None = None


@dataclass(frozen=True)
class DecodeBudget:
    """Keep a layer bounded while decoding: once its heads hold ``tokens + interval`` tokens on
    average, the layer is compressed back to ``tokens`` per head (on average, for head-wise
    budgets) with the same policy.

    Channels chosen at the prefill stay; the policy's full-width window stays full width.
    """

    tokens: int
    interval: int = 64

    def __post_init__(self) -> None:
        for name in ("tokens", "interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"decode budget {name} must be a positive integer, got {value!r}")


@dataclass
class ReplayChunk:
    """A reconstruction chunk in progress (:mod:`kvpatch.replay`): its tokens are attended over
    what a layer holds and forgotten afterwards.

    ``query_valid`` ``[batch, chunk]`` marks the chunk's real tokens; ``prefill_valid``
    ``[batch, prefill]`` the real tokens of a prefill that waits for its scores.
    """

    query_valid: torch.Tensor
    prefill_valid: torch.Tensor
    _masks: dict = dataclasses.field(default_factory=dict, repr=False)
    _buffers: dict = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def prefill_held_valid(self) -> torch.Tensor:
        """``prefill_valid`` as ``[batch, 1, prefill]``, one tensor for every layer (so that
        :meth:`additive_mask` builds its mask once)."""
        return self.prefill_valid[:, None, :]

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A float32 workspace reused by every layer of the chunk: allocating a fresh
        ``chunk x context`` tensor per layer costs more than the arithmetic on it (on CPU)."""
        key = (name, shape, like.device)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=torch.float32, device=like.device)
        return self._buffers[key]

    def additive_mask(self, held_valid: torch.Tensor, group: int) -> torch.Tensor:
        """``[batch, 1 or kv_heads, group * chunk, held + chunk]``, 0 where a query (rows ordered
        (group, chunk)) sees a key and -inf elsewhere: real held keys and the chunk causally. A
        padding query sees only itself, so it gives no held key any weight."""
        key = (id(held_valid), group)
        if key not in self._masks:  # the tensor is kept with it: its id cannot be reused
            self._masks[key] = (held_valid, _replay_mask(held_valid, self.query_valid, group))
        return self._masks[key][1]


def _replay_mask(held_valid: torch.Tensor, query_valid: torch.Tensor, group: int) -> torch.Tensor:
    q_len = query_valid.shape[1]
    device = query_valid.device
    real = query_valid[:, :, None]  # [b, q, 1]
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    own = torch.eye(q_len, dtype=torch.bool, device=device)
    chunk = torch.where(real, causal & query_valid[:, None, :], own)  # [b, q, q]
    held = held_valid[:, :, None, :] & real[:, None]  # [b, h, q, held]
    visible = torch.cat([held, chunk[:, None].expand(-1, held.shape[1], -1, -1)], dim=-1)
    visible = visible.repeat(1, 1, group, 1)
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    return mask.masked_fill_(~visible, float("-inf"))


@dataclass
class ReplayView:
    """Marks the keys of a layer during a reconstruction chunk: what it holds, then the chunk.

    The held columns from ``scored_from`` on are the tokens being scored; ``held_valid``
    ``[batch, 1 or kv_heads, held]`` marks the real ones.
    """

    layer: CompressedLayer
    chunk: ReplayChunk
    held_valid: torch.Tensor
    scored_from: int


@dataclass
class CompressedView:
    """Describes the dense view returned for a compressed layer.

    Columns ``[0, packed_length)`` are the packed block: head ``(b, h)`` holds
    ``lengths[b, h]`` real tokens there, the rest are padding slots. Columns from
    ``packed_length`` on are the tail, whose first token has logical position ``tail_start``.
    """

    layer: CompressedLayer
    lengths: torch.Tensor
    packed_length: int
    tail_start: int
    key_norm_bound: torch.Tensor  # [batch, kv_heads], largest norm of a held key
    #: ``(rows, heads, slots)`` of the padding slots; None when every head is ``packed_length`` long
    padding_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


View = PrefillView | CompressedView | ReplayView


def mark(keys: torch.Tensor, view: View) -> torch.Tensor:
    setattr(keys, _VIEW_ATTRIBUTE, view)
    return keys


def view_of(keys: torch.Tensor) -> View | None:
    """The kvpatch description attached to keys returned by a :class:`CompressedLayer`, if any."""
    return getattr(keys, _VIEW_ATTRIBUTE, None)


class CompressedLayer(DynamicLayer):
    """One full-attention layer: dense until its prefill is compressed, packed afterwards.

    While dense, ``keys``/``values`` hold everything like ``DynamicLayer``. Once compressed
    they hold the full-width tail and :attr:`packed` holds the rest.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        compat.clear_layer(self)
        self._clear()

    def _clear(self) -> None:
        self.packed: PackedKV | None = None
        # once compressed: the tail, preceded by the packed tokens when those are stored dense
        self.block_keys: GrowingBuffer | None = None
        self.block_values: GrowingBuffer | None = None
        self.tail_start = 0
        self.tail_valid: torch.Tensor | None = None  # [batch, tail], False for padding
        self.seen = 0
        self.key_norm_bound: torch.Tensor | None = None
        self.awaiting_compression = False
        self.passthrough = False
        # a policy that plans every layer at once: the prefill's inputs, until the cache compresses
        self.deferred: LayerInputs | None = None
        self.replay: ReplayChunk | None = None
        self.replay_attention: torch.Tensor | None = None
        # appended tokens compressed after their forward: their queries, recorded meanwhile
        self.capture_queries = False
        self.segment_queries: torch.Tensor | None = None
        self.rotary = None
        self.position_offset: torch.Tensor | None = None  # left padding of each row
        # what decoding-time compression needs
        self.policy: Policy | None = None
        self.decode_budget: DecodeBudget | None = None
        self.recent_queries: torch.Tensor | None = None
        self.scaling = 1.0
        self.layer_idx = 0

    # -- transformers' layer API ---------------------------------------------------------------

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None
    ):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :]
        self.values = (value_states if value_states is not None else key_states)[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.awaiting_compression:
            raise RuntimeError(
                "CompressedDynamicCache was used by an attention implementation that does not "
                "compress it. Call kvpatch.enable(model) before running the model with this cache."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.replay is not None or self.deferred is not None:
            return self._replay_view(key_states, value_states)
        first_forward = self.seen == 0
        self.seen += key_states.shape[-2]
        if self.packed is not None:
            return self._append_compressed(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if first_forward and not self.passthrough:
            self.awaiting_compression = True
            return mark(self.keys, PrefillView(self)), self.values
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        return self.seen + compat.query_length(query), 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def _replay_view(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """What the layer holds and a reconstruction chunk, which is not stored: a waiting
        prefill (every token scored), or a compressed layer (its tail scored)."""
        if self.replay is None:
            raise ValueError(
                "this cache waits for a context reconstruction (the policy scores tokens with "
                "KVzip) before it is compressed: prefill with kvpatch.prefill(model, ids) or "
                "model.generate on an enabled model, not with a plain forward"
            )
        if self.deferred is not None:
            keys, values, scored_from = self.keys, self.values, 0
            held_valid = self.replay.prefill_held_valid
        else:
            keys, values, held_valid, _ = self._held()
            scored_from = self.packed.max_length
        keys = torch.cat([keys, key_states], dim=-2)
        values = torch.cat([values, value_states], dim=-2)
        view = ReplayView(self, self.replay, held_valid, scored_from)
        return mark(keys, view), values

    def record_replay_attention(self, attention: torch.Tensor) -> None:
        """Keep the largest attention each scored token got, ``[batch, kv_heads, scored]``."""
        if self.replay_attention is None:
            self.replay_attention = attention
        else:
            self.replay_attention = torch.maximum(self.replay_attention, attention)

    def reset(self) -> None:
        compat.clear_layer(self)
        super().reset()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        remove = compat.tokens_to_remove(tokens_to_remove, self.seen)
        if remove == 0:
            return
        if self.packed is None:
            self.keys = self.keys[..., : self.keys.shape[-2] - remove, :]
            self.values = self.values[..., : self.values.shape[-2] - remove, :]
            self.seen -= remove
            return
        if remove > self.tail_length:
            raise ValueError(
                f"cannot crop {remove} tokens: only the {self.tail_length} tokens after the "
                "compressed part of the cache can be removed"
            )
        self.seen -= remove
        for block in (self.block_keys, self.block_values):
            block.truncate(block.length - remove)
        self.tail_valid = self.tail_valid[:, : self.tail_length]
        self._expose_tail()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            rows = torch.arange(self.keys.shape[0], device=self.keys.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        indices = indices.to(self.keys.device)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        if self.packed is None:
            self.keys = self.keys[indices]
            self.values = self.values[indices]
        else:
            self.block_keys.select_rows(indices)
            self.block_values.select_rows(indices)
            self._expose_tail()
            self.packed = self.packed.select_rows(indices)
            self.key_norm_bound = self.key_norm_bound[indices]
            self.tail_valid = self.tail_valid[indices]
            if self.recent_queries is not None:
                self.recent_queries = self.recent_queries[indices]

    def offload(self):
        self._move("cpu")

    def prefetch(self):
        if self.is_initialized and self.keys.device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        if self.packed is None:
            if self.is_initialized:
                self.keys = self.keys.to(device, non_blocking=True)
                self.values = self.values.to(device, non_blocking=True)
            return
        self.block_keys.to(device)
        self.block_values.to(device)
        self.packed = self.packed.to(device)
        self._expose_tail()

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
        self.awaiting_compression = False
        self.deferred = self.replay = self.replay_attention = None
        if policy is None or inputs.num_tokens <= 1:
            self.passthrough = True
            return
        if decode_budget is not None:
            _check_decode_budget(policy, decode_budget)
        if plan is None:
            plan = policy.plan(inputs)
        _check_plan(plan, inputs)
        start = plan.full_width_from
        self._store(
            PackedKV.from_plan(self.keys, self.values, plan),
            self.keys[..., start:, :],
            self.values[..., start:, :],
            tail_start=start,
            tail_valid=inputs.head_valid[:, 0, start:],
        )
        self.policy, self.decode_budget = policy, decode_budget
        self.scaling, self.layer_idx, self.rotary = inputs.scaling, inputs.layer_idx, inputs.rotary
        self.position_offset = (~inputs.head_valid[:, 0]).sum(-1)
        if decode_budget is not None:
            self.remember_queries(inputs.queries)

    def defer(
        self, policy: Policy, inputs: LayerInputs, decode_budget: DecodeBudget | None = None
    ) -> None:
        """Hold the prefill densely until the cache compresses every layer together."""
        self.awaiting_compression = False
        if decode_budget is not None:
            _check_decode_budget(policy, decode_budget)
        if inputs.num_tokens <= 1:
            self.passthrough = True
            return
        if policy.needs_replay:  # KVzip scores need no query; a ThinK window needs the last ones
            inputs = dataclasses.replace(
                inputs, queries=inputs.queries[..., -RECENT_QUERIES:, :].clone()
            )
        self.deferred = inputs
        self.policy, self.decode_budget = policy, decode_budget

    def _store(
        self,
        packed: PackedKV,
        tail_keys: torch.Tensor,
        tail_values: torch.Tensor,
        tail_start: int,
        tail_valid: torch.Tensor,
    ) -> None:
        """Hold ``packed`` and a full-width tail starting at logical position ``tail_start``.

        Heads of equal length without pruned channels need no packing: their tokens go, dense,
        at the front of the tail's buffer, so the attention view costs no copy.
        """
        b, h = packed.lengths.shape
        self.key_norm_bound = packed.max_key_norms()
        if packed.is_uniform and packed.channels is None:
            length = packed.max_length
            dense_keys = packed.keys.view(b, h, length, packed.keys.shape[-1])
            dense_values = packed.values.view(b, h, length, packed.values.shape[-1])
            tail_keys = torch.cat([dense_keys, tail_keys], dim=-2)
            tail_values = torch.cat([dense_values, tail_values], dim=-2)
            packed = packed.without_data()
        self.packed = packed
        self.block_keys = GrowingBuffer(tail_keys.contiguous().clone())
        self.block_values = GrowingBuffer(tail_values.contiguous().clone())
        self.tail_start, self.tail_valid = tail_start, tail_valid.clone()
        self._bound_key_norms(self.block_keys.view())
        self._expose_tail()

    @property
    def tail_length(self) -> int:
        """Tokens held at full width after the compressed part (logical positions from
        ``tail_start``)."""
        return self.seen - self.tail_start

    def _expose_tail(self) -> None:
        """``keys``/``values`` show the tail, as transformers' code expects them to exist."""
        keys, values = self.block_keys.view(), self.block_values.view()
        start = keys.shape[-2] - self.tail_length
        self.keys, self.values = keys[..., start:, :], values[..., start:, :]

    def _append_compressed(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if self._over_decode_budget():
            self.seen -= key_states.shape[-2]  # compress what was held before these tokens
            self._compress_while_decoding()
            self.seen += key_states.shape[-2]
        self.block_keys.append(key_states)
        self.block_values.append(value_states)
        valid = self.tail_valid.new_ones(key_states.shape[0], key_states.shape[-2])
        self.tail_valid = torch.cat([self.tail_valid, valid], dim=-1)
        self._bound_key_norms(key_states)
        self._expose_tail()
        return self._dense_view()

    def remember_queries(self, queries: torch.Tensor) -> None:
        """Keep the last queries, which decoding-time compression scores with, and all of an
        appended segment's while ``capture_queries`` is set."""
        if self.capture_queries:
            previous = self.segment_queries
            self.segment_queries = (
                queries if previous is None else torch.cat([previous, queries], -2)
            )
        if self.decode_budget is None:
            return
        if self.recent_queries is not None:
            queries = torch.cat([self.recent_queries, queries], dim=-2)
        self.recent_queries = queries[..., -RECENT_QUERIES:, :].clone()

    def _over_decode_budget(self) -> bool:
        if self.decode_budget is None:
            return False
        # average over heads: head-wise budgets (AdaKV) share the layer's total unevenly
        per_head = self.packed.lengths.float().mean(-1).max() + self.tail_length
        return bool(per_head >= self.decode_budget.tokens + self.decode_budget.interval)

    def _compress_while_decoding(self) -> None:
        """Compress everything held back to the decode budget, channels and window unchanged."""
        keys, values, valid, positions = self._held()
        queries = self.recent_queries
        inputs = LayerInputs(
            queries=queries,
            keys=keys,
            values=values,
            valid=valid,
            scaling=self.scaling,
            layer_idx=self.layer_idx,
            keep_tokens=self.decode_budget.tokens,
            rotary=self.rotary,
            query_positions=self.positions_of_last(queries.shape[2]),
        )
        must_keep = self.full_width_window(keys.shape[2])
        keep = token_policy_of(self.policy).plan(inputs, must_keep=must_keep).keep
        self._repack(keys, values, positions, keep & valid)

    # -- compressing appended tokens (a new turn, a chunk of a long prefill) -------------------

    def segment_inputs(self) -> LayerInputs:
        """The tail (tokens held at full width since the last compression) as a policy sees it,
        with the queries recorded while it was appended (``capture_queries``)."""
        queries = self.segment_queries
        return LayerInputs(
            queries=queries,
            keys=self.keys,
            values=self.values,
            valid=self.tail_valid,
            scaling=self.scaling,
            layer_idx=self.layer_idx,
            rotary=self.rotary,
            query_positions=self.positions_of_last(queries.shape[2]),
            replay_attention=self.replay_attention,
        )

    def compress_segment(self, keep: torch.Tensor) -> None:
        """Keep the ``keep`` tokens ``[batch, kv_heads, tail]`` of the tail (and everything
        compressed before); the last tokens of a channel policy's window stay full width."""
        keys, values, valid, positions = self._held()
        packed = self.packed.max_length
        keep = torch.cat([valid[..., :packed], keep & valid[..., packed:]], dim=-1)
        self._repack(keys, values, positions, keep)
        self.segment_queries = self.replay_attention = None

    def full_width_window(self, tokens: int) -> torch.Tensor | None:
        """``[batch, tokens]``: the last tokens that must stay full width (the channel policy's
        window, capped by the tail) and so are always kept; None without pruned channels."""
        width = self._full_width()
        if not width:
            return None
        batch = self.tail_valid.shape[0]
        window = torch.zeros(batch, tokens, dtype=torch.bool, device=self.tail_valid.device)
        window[:, tokens - width :] = True
        return window

    def _full_width(self) -> int:
        if self.packed.channels is None:
            return 0
        return min(self.policy.channels.window, self.tail_length)

    def positions_of_last(self, count: int) -> torch.Tensor:
        """Position ids ``[batch, count]`` of the last ``count`` tokens (left padding excluded)."""
        logical = torch.arange(self.seen - count, self.seen, device=self.tail_valid.device)
        return (logical[None, :] - self.position_offset[:, None]).clamp(min=0)

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything held, densely: keys and values ``[batch, kv_heads, slots, dim]`` (packed
        heads padded, pruned channels as zeros, then the tail), which slots are real tokens and
        their logical positions, ``[batch, kv_heads, slots]``."""
        keys, values = self._dense_kv()
        b, h, _, _ = keys.shape
        packed_slots = torch.arange(self.packed.max_length, device=keys.device)
        tail_valid = self.tail_valid[:, None, :].expand(b, h, -1)
        valid = torch.cat([packed_slots < self.packed.lengths[..., None], tail_valid], dim=-1)
        tail_positions = torch.arange(self.tail_start, self.seen, device=keys.device)
        positions = torch.cat([self.packed.positions(), tail_positions.expand(b, h, -1)], -1)
        return keys, values, valid, positions

    def _repack(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> None:
        """Store the ``keep`` slots of :meth:`_held`'s layout as the packed part, except the
        channel policy's full-width window, which becomes the tail."""
        b, h, slots, _ = keys.shape
        full_width = self._full_width()
        cut = slots - full_width
        keep = keep[..., :cut]
        new_tail_start = self.seen - full_width
        record = torch.zeros(b, h, new_tail_start, dtype=torch.int8, device=keys.device)
        record.scatter_add_(-1, positions[..., :cut], keep.to(torch.int8))
        packed = PackedKV.pack(
            keys[..., :cut, :], values[..., :cut, :], keep, self.packed.channels, record > 0
        )
        tail_valid = self.tail_valid[:, self.tail_valid.shape[-1] - full_width :]
        self._store(packed, keys[..., cut:, :], values[..., cut:, :], new_tail_start, tail_valid)

    def _bound_key_norms(self, keys: torch.Tensor) -> None:
        if keys.shape[-2]:
            norms = keys.float().norm(dim=-1).amax(dim=-1)
            self.key_norm_bound = torch.maximum(self.key_norm_bound, norms)

    def _dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed tokens (padded per head, pruned channels as zeros) followed by the tail."""
        if self.packed.keys is None:  # stored dense already
            return self.block_keys.view(), self.block_values.view()
        b, h = self.packed.lengths.shape
        length, tail = self.packed.max_length, self.tail_length
        keys = self.keys.new_empty(b, h, length + tail, self.packed.head_dim)
        values = self.values.new_empty(b, h, length + tail, self.values.shape[-1])
        self.packed.write_into(keys, values)
        keys[:, :, length:] = self.keys
        values[:, :, length:] = self.values
        return keys, values

    def _dense_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._dense_kv()
        view = CompressedView(
            layer=self,
            lengths=self.packed.lengths,
            packed_length=self.packed.max_length,
            tail_start=self.tail_start,
            key_norm_bound=self.key_norm_bound,
            padding_slots=None if self.packed.is_uniform else self.packed.padding_slots,
        )
        return mark(keys, view), values

    # -- what is held --------------------------------------------------------------------------

    @property
    def is_compressed(self) -> bool:
        return self.packed is not None

    def physical_lengths(self) -> torch.Tensor | None:
        """Tokens held per (batch row, KV head), or None before the first update."""
        if not self.is_initialized:
            return None
        b, h, tail, _ = self.keys.shape
        held = torch.full((b, h), tail, dtype=torch.long, device=self.keys.device)
        return held if self.packed is None else held + self.packed.lengths

    def kept_positions(self, row: int, head: int) -> torch.Tensor:
        """Logical positions of the tokens held by one head, in order."""
        tail = torch.arange(self.tail_start, self.seen, device=self.keys.device)
        if self.packed is None:
            return torch.arange(self.seen, device=self.keys.device)
        return torch.cat([self.packed.kept[row, head].nonzero().flatten(), tail])

    def nbytes(self) -> int:
        """Bytes of the tensors this layer holds (their storages, not views)."""
        if not self.is_initialized:
            return 0
        if self.packed is None:
            return storage_nbytes(self.keys, self.values)
        blocks = (self.block_keys.data, self.block_values.data)
        extra = (self.key_norm_bound, self.tail_valid, self.recent_queries, self.position_offset)
        return storage_nbytes(*blocks, *extra) + self.packed.nbytes()


def token_policy_of(policy: Policy) -> Policy:
    """The part of ``policy`` that evicts tokens (what decoding-time compression runs)."""
    if isinstance(policy, Composed):
        return policy.tokens
    if isinstance(policy, ChannelSelector):
        raise ValueError(
            f"decoding-time compression needs a token policy (snapkv, ada-snapkv, ...); "
            f"{policy.name!r} only prunes channels"
        )
    return policy


def _check_decode_budget(policy: Policy, budget: DecodeBudget) -> None:
    if token_policy_of(policy).needs_replay:
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


def _check_plan(plan: Plan, inputs: LayerInputs) -> None:
    b, h, t, _ = inputs.keys.shape
    if plan.keep.shape != (b, h, t) or plan.keep.dtype != torch.bool:
        raise ValueError(
            f"a plan's keep mask must be bool [{b}, {h}, {t}], got {tuple(plan.keep.shape)}"
        )
    if not 0 <= plan.full_width_from <= t:
        raise ValueError(f"full_width_from must be in [0, {t}], got {plan.full_width_from}")
    if (plan.keep & ~inputs.valid[:, None, :]).any():
        raise ValueError("a plan must not keep padding tokens")


class CompressedDynamicCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are compressed after the prefill.

    Parameters
    ----------
    config : PretrainedConfig, optional
        The model's config; sliding-window layers found there stay uncompressed ``DynamicCache``
        layers. Without it every layer is a :class:`CompressedLayer`.
    policy : str or Policy, optional
        What to keep; overrides the policy given to :func:`kvpatch.enable`. Without either, nothing
        is compressed.
    decode_budget : int, optional
        Bound the cache while decoding too: once a layer's heads hold ``decode_budget +
        decode_interval`` tokens on average, the layer is compressed back to ``decode_budget``
        tokens per head with the same (token) policy. Without it, every generated token is kept.
    decode_interval : int, default 64
        How many tokens are appended between two decoding-time compressions.
    """

    def __init__(
        self,
        config=None,
        policy: str | Policy | None = None,
        decode_budget: int | None = None,
        decode_interval: int = 64,
        **kwargs,
    ):
        super().__init__(config=config, **kwargs)
        self.policy = parse_policy(policy)
        self.decode_budget = (
            None if decode_budget is None else DecodeBudget(decode_budget, decode_interval)
        )
        if self.policy is not None and self.decode_budget is not None:
            _check_decode_budget(self.policy, self.decode_budget)
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = CompressedLayer
        self.layers = [
            CompressedLayer() if type(layer) is DynamicLayer else layer for layer in self.layers
        ]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        deferred = isinstance(layer, CompressedLayer) and layer.deferred is not None
        if deferred and layer.replay is None and not layer.policy.needs_replay:
            self.compress_deferred()  # every layer's prefill is known by now
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        view = view_of(keys)
        if isinstance(view, PrefillView):
            view.policy, view.decode_budget = self.policy, self.decode_budget
        return keys, values

    @property
    def deferred_layers(self) -> list[CompressedLayer]:
        """Layers holding their whole prefill until :meth:`compress_deferred`."""
        return [layer for layer in self.compressed_layers if layer.deferred is not None]

    def compress_deferred(self) -> None:
        """Compress the layers whose policy plans every layer at once (shared budgets, KVzip's
        reconstruction scores in ``layer.replay_attention``)."""
        layers = self.deferred_layers
        if not layers:
            return
        policy = layers[0].policy
        inputs = [
            dataclasses.replace(layer.deferred, replay_attention=layer.replay_attention)
            for layer in layers
        ]
        plans = policy.plan_layers(inputs)
        for layer, layer_inputs, plan in zip(layers, inputs, plans, strict=True):
            layer.compress(policy, layer_inputs, layer.decode_budget, plan=plan)

    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def nbytes(self) -> int:
        """Bytes held by every layer's tensors (their storages), compressed or not."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                total += layer.nbytes()
            elif compat.layer_is_initialized(layer):
                total += storage_nbytes(layer.keys, layer.values)
        return total

    def physical_lengths(self) -> list[torch.Tensor | None]:
        """Per layer, the tokens held by each (batch row, KV head); None for other layer kinds."""
        return [
            layer.physical_lengths() if isinstance(layer, CompressedLayer) else None
            for layer in self.layers
        ]
