"""The meaning of compression, computed the slow way.

The oracle runs the unpatched model on a full ``DynamicCache`` with an attention function of its
own: after the prefill, a query may not attend to the (row, head, token) keys the compressed cache
evicted, and the pruned key and value channels of the compressed tokens read as zero. Nothing here
uses kvpatch's attention code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

from kvpatch import compat
from kvpatch.cache import CompressedLayer

ORACLE = "kvpatch_test_oracle"


@dataclass
class Eviction:
    keep: torch.Tensor  # [batch, kv_heads, prefill] bool
    channel_keep: torch.Tensor | None  # [batch, kv_heads, head_dim] bool
    full_width_from: int
    value_channel_keep: torch.Tensor | None = None  # [batch, kv_heads, v_head_dim] bool


_evictions: dict[int, Eviction] = {}
# when evictions change while decoding: key length at a step -> that step's evictions
_schedule: dict[int, dict[int, Eviction]] = {}


def evictions_of(cache) -> dict[int, Eviction]:
    """What each compressed layer of ``cache`` dropped, read from its packed storage."""
    out = {}
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, CompressedLayer) or not layer.is_compressed:
            continue
        packed, start = layer.packed, layer.store.tail_start
        keep = packed.kept_mask(layer.seen)  # positions seen, some decoded after
        keep[..., start:] = True
        channel_keep = _channel_mask(packed.channels, keep.shape[:2], packed.head_dim)
        values_keep = _channel_mask(packed.value_channels, keep.shape[:2], packed.value_dim)
        out[idx] = Eviction(keep, channel_keep, start, values_keep)
    return out


def _channel_mask(channels: torch.Tensor | None, heads, width: int) -> torch.Tensor | None:
    """``channels`` ``[batch, kv_heads, kept]`` as a bool mask over ``width`` channels."""
    if channels is None:
        return None
    mask = torch.zeros(*heads, width, dtype=torch.bool, device=channels.device)
    return mask.scatter_(-1, channels, True)


def oracle_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    batch, kv_heads, length, dim = key.shape
    group = query.shape[1] // kv_heads
    keys, values = key.double().clone(), value.double().clone()
    allowed = torch.ones(batch, kv_heads, length, dtype=torch.bool, device=key.device)
    eviction = _schedule.get(length, _evictions).get(module.layer_idx)
    if eviction is not None and length > query.shape[2]:  # decoding after the prefill
        known = min(length, eviction.keep.shape[-1])
        allowed[..., :known] = eviction.keep[..., :known]
        start = eviction.full_width_from
        if eviction.channel_keep is not None:
            keys[..., :start, :] *= eviction.channel_keep[:, :, None, :].double()
        if eviction.value_channel_keep is not None:
            values[..., :start, :] *= eviction.value_channel_keep[:, :, None, :].double()
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    allowed = allowed.repeat_interleave(group, dim=1)
    scale = scaling if scaling is not None else dim**-0.5
    scores = query.double() @ keys.transpose(-1, -2) * scale
    if kwargs.get("softcap") is not None:
        scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
    if attention_mask is not None:
        scores = scores + attention_mask.double()
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    weights = scores.softmax(-1)
    output = (weights @ values).to(query.dtype)
    return output.transpose(1, 2).contiguous(), weights


AttentionInterface.register(ORACLE, oracle_attention)
AttentionMaskInterface.register(ORACLE, eager_mask)


def greedy_logits(model, ids: torch.Tensor, cache, steps: int, tokens: torch.Tensor | None = None):
    """Prefill ``ids`` then decode ``steps`` tokens one forward at a time.

    Feeds ``tokens`` when given (teacher forcing), else the greedy choice. Returns the logits of
    every step ``[steps + 1, batch, vocab]`` and the tokens fed.
    """
    name = compat.cache_argument(model)
    logits, fed = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True, **{name: cache})
        for step in range(steps + 1):
            last = out.logits[:, -1].float()
            logits.append(last)
            if step == steps:
                break
            nxt = (
                tokens[:, step : step + 1] if tokens is not None else last.argmax(-1, keepdim=True)
            )
            fed.append(nxt)
            out = model(nxt, use_cache=True, **{name: cache})
    return torch.stack(logits), torch.cat(fed, dim=1) if fed else ids[:, :0]


def oracle_logits(
    model,
    ids,
    evictions: dict[int, Eviction],
    tokens: torch.Tensor,
    schedule: dict[int, dict[int, Eviction]] | None = None,
):
    """Logits of the masked full-cache model fed the same tokens.

    ``schedule`` maps a key length (a decode step) to the evictions in force at that step.
    """
    implementation = compat.attention_implementation(model)
    _evictions.clear()
    _evictions.update(evictions)
    _schedule.clear()
    _schedule.update(schedule or {})
    compat.set_attention_implementation(model, ORACLE)
    try:
        logits, _ = greedy_logits(
            model, ids, DynamicCache(config=model.config), tokens.shape[1], tokens
        )
    finally:
        compat.set_attention_implementation(model, implementation)
        _evictions.clear()
        _schedule.clear()
    return logits
