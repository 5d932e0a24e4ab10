"""Decode attention read straight from packed storage, with no padded copy of the cache.

The padded view (:meth:`~kvpatch.cache.store.CompressedStore.dense`) lets any stock kernel run,
but builds a ``[batch, kv_heads, longest head, head_dim]`` copy of the packed tokens at every step
and attends over the longest head's length in every head. On the CPU and on CUDA (see
:data:`DEVICES`), attention here reads each (batch row, KV head)'s packed tokens where they lie,
and its full-width tail as one batch:

- keys with pruned channels meet the query's matching channels (the query is pruned, not the
  key widened);
- values with pruned channels give the output's matching channels (the others take the tail's
  contribution only, as zeros would);
- the packed tokens are visible to every query (they are real and precede it); the tail takes the
  logical mask's last columns.

The numerics are those of transformers' eager attention: scores and output in the model's dtype,
softmax in fp32.
"""

from __future__ import annotations

from math import inf

import torch

from kvpatch.attention import varlen
from kvpatch.cache.packed import PackedKV, gather_channels
from kvpatch.cache.shared_context import SharedContextStore
from kvpatch.cache.store import CompressedStore

#: devices whose decode steps read packed storage directly; elsewhere the padded view serves.
#: On an H200 (torch 2.11, bf16, 8 KV heads; benchmarks/gpu_check.py) head-wise and
#: channel-pruned caches decoded so 7-18x faster than through the padded view and torch's
#: default sdpa dispatch, and 0.75-1.25x its time with sdpa's cuDNN kernel disabled
DEVICES = ("cpu", "cuda")
#: beyond this many variable-length (batch row, KV head) segments, the per-segment loop costs
#: more than the padded view's copy
MAX_SEGMENTS = 64
#: devices where variable-length heads are read segment by segment (a few small products cost
#: little on a CPU); elsewhere, where each product is a kernel launch, the variable-length
#: kernel reads them in one call (:mod:`~kvpatch.attention.varlen`) or, without one, a padded
#: copy of the kept channels serves every head in one batched product
SEGMENT_DEVICES = ("cpu",)


#: attention arguments that packed reading does not implement (the padded view serves them)
_UNREAD_ARGUMENTS = ("softcap", "s_aux", "sinks", "position_bias")


def serves(store: CompressedStore, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether :func:`attend` serves this call: plain attention (no soft-capping, sinks or
    dropout), on a device and with a number of segments where it beats the padded view."""
    if any(kwargs.get(name) is not None for name in _UNREAD_ARGUMENTS):
        return False
    if kwargs.get("dropout") or kwargs.get("output_attentions"):
        return False
    packed = store.packed
    if query.device.type not in DEVICES:
        return False
    one_call = varlen.kernel_for(query, packed) is not None  # a shared context's too
    batched = not isinstance(store, SharedContextStore) and query.device.type not in SEGMENT_DEVICES
    return packed.is_uniform or one_call or batched or packed.lengths.numel() <= MAX_SEGMENTS


def tail_visibility(
    logical: torch.Tensor | None, start: int, end: int, query: torch.Tensor
) -> torch.Tensor | None:
    """Bool ``[batch or 1, heads or 1, q_len, end - start]``: which of the logical positions
    ``start`` to ``end`` (the tail) each query sees, from the logical 4-D mask, or causally
    without one; None when every query sees all of them."""
    q_len = query.shape[2]
    if logical is not None:
        tail = logical[..., start:end]
        return tail if tail.dtype == torch.bool else tail == 0
    if q_len == 1:
        return None
    query_pos = torch.arange(end - q_len, end, device=query.device)
    key_pos = torch.arange(start, end, device=query.device)
    return (key_pos[None, :] <= query_pos[:, None])[None, None]


def attend(
    store: CompressedStore | SharedContextStore,
    query: torch.Tensor,
    tail_visible: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[batch, q_heads, q_len, head_dim]`` over everything ``store``
    holds; ``tail_visible`` (bool, broadcastable to ``[batch, q_heads, q_len, tail]``, or None for
    all visible) says which tail tokens each query sees. Returns ``[batch, q_len, q_heads,
    value_dim]``, as transformers' attention functions do."""
    if isinstance(store, SharedContextStore):
        context = store.context.packed
        kernel = varlen.kernel_for(query, context)
        if kernel is not None and context.keys is not None and not context.is_uniform:
            try:
                return _attend_shared_in_one_call(store, query, tail_visible, scaling, kernel)
            except RuntimeError as error:  # a kernel this GPU cannot run: never tried again
                varlen.refused(query.device.type, error)
        return _attend_shared(store, query, tail_visible, scaling)
    packed = store.packed
    tail_keys, tail_values = store.tail()
    kv_heads = packed.lengths.shape[1]
    grouped = _grouped(query, scaling, kv_heads)
    kernel = varlen.kernel_for(query, packed)
    if kernel is not None and not packed.is_uniform:
        try:
            packed_part = varlen.packed_part(packed, grouped, kernel)
            tail_scores = _tail_scores(grouped, tail_keys, tail_visible).float()
            merged = varlen.merge([packed_part, _normalised(tail_scores, tail_values)], query.dtype)
            return _ungrouped(merged, query)
        except RuntimeError as error:  # a kernel this GPU cannot run: never tried again
            varlen.refused(query.device.type, error)
    tail_scores = _tail_scores(grouped, tail_keys, tail_visible)
    held = _held(packed, query.device)
    packed_scores = _packed_scores(packed, held, grouped)
    weights = _softmax(torch.cat([packed_scores, tail_scores], dim=-1), query.dtype)
    length = packed.max_length
    output = _packed_output(packed, held, weights[..., :length])
    output = output.add_(weights[..., length:] @ tail_values)
    return _ungrouped(output, query)


def _tail_scores(grouped: torch.Tensor, keys: torch.Tensor, visible) -> torch.Tensor:
    """Scores of the grouped queries ``[batch, kv_heads, rows, dim]`` against full-width
    ``keys``, -inf where ``visible`` (per query head, or None: all) hides a token."""
    scores = grouped @ keys.transpose(-1, -2)
    if visible is not None:
        kv_heads, rows = grouped.shape[1:3]
        scores.masked_fill_(~_per_kv_head(visible, kv_heads, rows), float("-inf"))
    return scores


def _attend_shared_in_one_call(store, query, rows_visible, scaling, kernel) -> torch.Tensor:
    """:func:`attend` for rows sharing one context, its packed heads read by one call of the
    variable-length ``kernel`` for every row's queries at once (each KV head a sequence), its
    own tail and each row's tail in one product each, the three merged by log-sum-exp."""
    row_keys, row_values = store.tail()
    batch, kv_heads = row_keys.shape[:2]
    grouped = _grouped(query, scaling, kv_heads)  # [batch, kv_heads, rows, dim]
    rows = grouped.shape[2]
    together = grouped.transpose(0, 1).reshape(1, kv_heads, batch * rows, -1)
    own_scores = _tail_scores(grouped, row_keys, rows_visible).float()
    # each row's own tail, laid out as the context's parts are: [1, kv_heads, batch * rows, ...]
    together_layout = lambda t: t.transpose(0, 1).reshape(1, kv_heads, batch * rows, *t.shape[3:])
    parts = [tuple(together_layout(t) for t in _normalised(own_scores, row_values))]
    context_keys, context_values = store.context.keys.view(), store.context.values.view()
    if context_keys.shape[-2]:  # the context's own tail, after its packed tokens
        parts.append(
            _normalised((together @ context_keys.transpose(-1, -2)).float(), context_values)
        )
    parts.append(varlen.packed_part(store.context.packed, together, kernel))
    output = varlen.merge(parts, query.dtype).view(kv_heads, batch, rows, -1)
    return _ungrouped(output.transpose(0, 1), query)


def _normalised(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted ``values`` over fp32 ``scores`` and the scores' log-sum-exp (a row that
    sees nothing: zeros and -inf)."""
    lse = scores.logsumexp(-1)
    finite = lse.masked_fill(~torch.isfinite(lse), 0.0)
    weights = (scores - finite[..., None]).exp().to(values.dtype)
    return weights @ values, lse


def _attend_shared(
    store: SharedContextStore,
    query: torch.Tensor,
    rows_visible: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """:func:`attend` for batch rows sharing one context: each KV head's context part (packed
    tokens and the context's own tail, one batch row) is read once for every row's queries, and
    one softmax per query spans it and the query row's own tail."""
    row_keys, row_values = store.tail()
    batch, kv_heads = row_keys.shape[:2]
    grouped = _grouped(query, scaling, kv_heads)  # [batch, kv_heads, rows, dim]
    rows = grouped.shape[2]
    together = grouped.transpose(0, 1).reshape(1, kv_heads, batch * rows, -1)
    row_scores = _tail_scores(grouped, row_keys, rows_visible)  # [batch, kv_heads, rows, tail]
    own = row_scores.transpose(0, 1).reshape(1, kv_heads, batch * rows, -1).float()
    parts = _context_parts(store.context, together)
    # one softmax per query over the context's parts and its own tail, each part exponentiated
    # where it lies (nothing padded, copied per row or concatenated) and the output divided by
    # the parts' sum
    top = own.amax(-1, keepdim=True)
    for heads, scores, _, _ in parts:
        top[:, heads] = torch.maximum(top[:, heads], scores.amax(-1, keepdim=True))
    own = own.sub_(top).exp_()
    total = own.sum(-1, keepdim=True)
    output = together.new_zeros(1, kv_heads, batch * rows, row_values.shape[-1])
    for heads, scores, values, channels in parts:
        weights = scores.sub_(top[:, heads]).exp_()
        total[:, heads] += weights.sum(-1, keepdim=True)
        weighted = weights.to(query.dtype) @ values
        if channels is None:
            output[:, heads] += weighted
        elif channels.dim() == 1:  # one head's kept value channels; the others take nothing
            output[0, heads].index_add_(-1, channels, weighted[0])
        else:
            output += _widen(weighted, channels, store.context.packed)
    output = output.view(kv_heads, batch, rows, -1)
    own = own.to(query.dtype).view(kv_heads, batch, rows, -1)
    output = output.add_(own @ row_values.transpose(0, 1))  # [kv_heads, batch, row tail, dim]
    output = output.div_(total.view(kv_heads, batch, rows, 1).to(output.dtype))
    return _ungrouped(output.transpose(0, 1), query)


def _context_parts(context: CompressedStore, together: torch.Tensor) -> list[tuple]:
    """The parts of a shared context (one batch row) that ``together`` ``[1, kv_heads, queries,
    dim]`` attends to, as ``(heads, scores, values, value channels)``: ``heads`` the KV heads
    (a slice) the part covers, ``scores`` fp32 ``[1, heads, queries, tokens]``, ``values``
    ``[1, heads, tokens, kept value channels]`` and the kept channels' indices (None when all
    are kept; ``[kept]`` for one head, ``[1, kv_heads, kept]`` for all). Heads of different
    lengths are one part each, so that no padding is scored."""
    parts = []
    context_keys, context_values = context.keys.view(), context.values.view()
    if context_keys.shape[-2]:  # the context's own tail, after its packed tokens
        scores = (together @ context_keys.transpose(-1, -2)).float()
        parts.append((slice(None), scores, context_values, None))
    packed = context.packed
    if packed.keys is None or not packed.max_length:
        return parts
    queries = gather_channels(together, packed.channels)
    if packed.is_uniform:
        shape = (1, packed.lengths.shape[1], packed.max_length, -1)
        keys, values = (t.view(shape) for t in packed.rows())
        scores = (queries @ keys.transpose(-1, -2)).float()
        parts.append((slice(None), scores, values, packed.value_channels))
        return parts
    for head, (keys, values) in enumerate(packed.segment_views()):
        if not keys.shape[0]:
            continue
        scores = (queries[:, head : head + 1] @ keys.T).float()
        channels = None if packed.value_channels is None else packed.value_channels[0, head]
        parts.append((slice(head, head + 1), scores, values[None, None], channels))
    return parts


def _grouped(query: torch.Tensor, scaling: float, kv_heads: int) -> torch.Tensor:
    """The scaled queries of each KV head, ``[batch, kv_heads, group * q_len, head_dim]``
    (query head, then position, major)."""
    batch, q_heads, q_len, dim = query.shape
    return (query * scaling).reshape(batch, kv_heads, q_heads // kv_heads * q_len, dim)


def _ungrouped(output: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, rows, value_dim]`` as ``[batch, q_len, q_heads, value_dim]``."""
    batch, q_heads, q_len, _ = query.shape
    output = output.reshape(batch, q_heads, q_len, output.shape[-1])
    return output.transpose(1, 2).contiguous()


def _held(packed: PackedKV, device: torch.device):
    """The packed keys and values as the two functions below read them: ``(keys, values)``
    rows of uniform heads, else each (batch row, KV head)'s views on the devices that read
    segment by segment, else a padded copy ``[batch, kv_heads, max_length, channels]`` (decoded
    once per step if quantized)."""
    if packed.is_uniform:
        return packed.rows()
    if device.type in SEGMENT_DEVICES:
        return packed.segment_views()
    return packed.padded_rows()


def _packed_scores(packed: PackedKV, held, queries: torch.Tensor) -> torch.Tensor:
    """Scores ``[batch, kv_heads, rows, max_length]`` of the grouped ``queries`` (at full width:
    pruned here to the channels each head kept) against the packed keys; -inf after the end of
    a shorter head."""
    queries = gather_channels(queries, packed.channels)
    b, h = packed.lengths.shape
    length = packed.max_length
    if packed.is_uniform:
        # explicit widths: a view of no elements infers none
        keys = held[0].view(b, h, length, held[0].shape[-1])
        return queries @ keys.transpose(-1, -2)
    if isinstance(held, tuple):  # the padded copy: one product, the padding at -inf
        scores = queries @ held[0].transpose(-1, -2)
        padding = torch.arange(length, device=scores.device) >= packed.lengths[..., None]
        return scores.masked_fill_(padding[:, :, None, :], -inf)
    scores = queries.new_full((b, h, queries.shape[2], length), -inf)
    for segment, (keys, _) in enumerate(held):
        row, head = divmod(segment, h)
        scores[row, head, :, : keys.shape[0]] = queries[row, head] @ keys.T
    return scores


def _packed_output(packed: PackedKV, held, weights: torch.Tensor) -> torch.Tensor:
    """The packed values weighted by ``weights`` ``[batch, kv_heads, rows, max_length]``, at
    full value width (zeros in pruned channels)."""
    b, h = packed.lengths.shape
    if packed.is_uniform:
        values = held[1].view(b, h, packed.max_length, held[1].shape[-1])
        return _widen(weights @ values, packed.value_channels, packed)
    if isinstance(held, tuple):  # the padded copy (its padding has weight 0)
        return _widen(weights @ held[1], packed.value_channels, packed)
    output = weights.new_zeros(b, h, weights.shape[2], packed.value_dim)
    for segment, (keys, values) in enumerate(held):
        row, head = divmod(segment, h)
        kept = weights[row, head, :, : keys.shape[0]] @ values
        if packed.value_channels is None:
            output[row, head] += kept
        else:
            output[row, head].index_add_(-1, packed.value_channels[row, head], kept)
    return output


def _per_kv_head(visible: torch.Tensor, kv_heads: int, rows: int) -> torch.Tensor:
    """``visible`` ``[batch, 1 or q_heads, q_len, tail]`` as ``[batch, 1 or kv_heads, rows,
    tail]``, matching the grouped queries."""
    batch, heads, q_len, tail = visible.shape
    if heads == 1:
        group = rows // q_len
        grouped = visible[:, :, None].expand(batch, 1, group, q_len, tail)
        return grouped.reshape(batch, 1, rows, tail)
    return visible.reshape(batch, kv_heads, rows, tail)


def _widen(kept: torch.Tensor, channels: torch.Tensor | None, packed) -> torch.Tensor:
    """An output over the kept value ``channels`` at full width (zeros in the pruned ones)."""
    if channels is None:
        return kept
    full = kept.new_zeros(*kept.shape[:-1], packed.value_dim)
    index = channels if channels.dim() == 1 else channels[:, :, None, :]
    return full.scatter_(-1, index.expand_as(kept), kept)


def _softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
