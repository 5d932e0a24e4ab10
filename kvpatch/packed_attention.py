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

from kvpatch.cache.packed import gather_channels
from kvpatch.cache.store import CompressedStore

#: devices whose decode steps read packed storage directly; elsewhere the padded view serves.
#: On an H200 (torch 2.11, bf16, 8 KV heads; benchmarks/gpu_check.py) head-wise and
#: channel-pruned caches decoded so 7-18x faster than through the padded view and torch's
#: default sdpa dispatch, and 0.75-1.25x its time with sdpa's cuDNN kernel disabled
DEVICES = ("cpu", "cuda")
#: beyond this many variable-length (batch row, KV head) segments, the per-segment loop costs
#: more than the padded view's copy
MAX_SEGMENTS = 64


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
    return packed.is_uniform or packed.lengths.numel() <= MAX_SEGMENTS


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
    store: CompressedStore,
    query: torch.Tensor,
    tail_visible: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[batch, q_heads, q_len, head_dim]`` over everything ``store``
    holds; ``tail_visible`` (bool, broadcastable to ``[batch, q_heads, q_len, tail]``, or None for
    all visible) says which tail tokens each query sees. Returns ``[batch, q_len, q_heads,
    value_dim]``, as transformers' attention functions do."""
    packed = store.packed
    tail_keys, tail_values = store.tail()
    batch, kv_heads = packed.lengths.shape
    q_heads, q_len = query.shape[1], query.shape[2]
    group = q_heads // kv_heads
    rows = group * q_len  # the queries of one KV head, (query head, position) major
    grouped = (query * scaling).reshape(batch, kv_heads, rows, query.shape[-1])
    tail_scores = grouped @ tail_keys.transpose(-1, -2)
    if tail_visible is not None:
        tail_scores.masked_fill_(~_per_kv_head(tail_visible, kv_heads, rows), float("-inf"))
    packed_queries = gather_channels(grouped, packed.channels)  # those the kept keys have
    attend_packed = _attend_uniform if packed.is_uniform else _attend_segments
    output = attend_packed(packed, packed_queries, tail_scores, tail_values, query.dtype)
    output = output.view(batch, kv_heads, group, q_len, -1).reshape(batch, q_heads, q_len, -1)
    return output.transpose(1, 2).contiguous()


def _attend_uniform(packed, queries, tail_scores, tail_values, dtype) -> torch.Tensor:
    """Heads of one length: every product batched."""
    keys, values = packed.rows()
    b, h = packed.lengths.shape
    length = packed.max_length
    keys = keys.view(b, h, length, keys.shape[-1])  # explicit widths: a view of no elements
    values = values.view(b, h, length, values.shape[-1])  # infers none
    packed_scores = queries @ keys.transpose(-1, -2)
    weights = _softmax(torch.cat([packed_scores, tail_scores], dim=-1), dtype)
    output = _widen(weights[..., :length] @ values, packed.value_channels, packed)
    return output.add_(weights[..., length:] @ tail_values)


def _attend_segments(packed, queries, tail_scores, tail_values, dtype) -> torch.Tensor:
    """Heads of different lengths: one product per (batch row, KV head) for its packed tokens,
    one softmax over every head (each head's packed scores first, -inf up to the longest)."""
    b, h, rows, tail = tail_scores.shape
    length = packed.max_length
    scores = tail_scores.new_full((b, h, rows, length + tail), -inf)
    scores[..., length:] = tail_scores
    segments = packed.segment_views()
    for segment, (keys, _) in enumerate(segments):
        row, head = divmod(segment, h)
        scores[row, head, :, : keys.shape[0]] = queries[row, head] @ keys.T
    weights = _softmax(scores, dtype)
    output = weights[..., length:] @ tail_values
    for segment, (keys, values) in enumerate(segments):
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
