"""A compressed layer read through a padded view by the stock kernel: short heads' padding
slots get fake keys whose softmax weight is exactly zero (or, where that cannot be guaranteed,
an explicit mask), and the logical mask is translated to the view's columns."""

from __future__ import annotations

import torch

from kvpatch.attention.fake_keys import fake_keys
from kvpatch.attention.masks import physical_mask, physical_padding_mask
from kvpatch.attention.modules import scaling
from kvpatch.attention.reference import reference_attention
from kvpatch.cache import PaddedRequest


def attend_padded(
    backend, original, module, query, key, value, attention_mask, request: PaddedRequest, kwargs
):
    """The stock kernel ``original`` on the padded view ``key``/``value``."""
    request.layer.remember_queries(query)
    scale = scaling(module, query, kwargs)
    explicit = kwargs.get("softcap") is not None  # soft-capping bounds logits: no key can zero them
    flash = backend.startswith("flash")
    # whether fake keys worked is known from their values only: a traced step (torch.compile)
    # masks the padding slots instead, which kernels other than flash take
    explicit = explicit or (torch.compiler.is_compiling() and not flash)
    if request.padding_slots is not None and not explicit:
        explicit = not _write_fake_keys(query, key, request, scale)
    head_padding = None
    if request.padding_slots is not None and explicit:
        slots = torch.arange(request.packed_length, device=key.device)
        head_padding = slots >= request.lengths[..., None]  # [b, h, packed_length]
    if head_padding is not None and flash:
        # flash kernels take no per-head mask: compute this rare case exactly with plain math
        mask = physical_mask(attention_mask, request, query, key, head_padding, additive=True)
        return reference_attention(module, query, key, value, mask, scale, kwargs)
    if flash:
        mask = physical_padding_mask(attention_mask, request)
    else:
        eager = backend == "eager"
        mask = physical_mask(attention_mask, request, query, key, head_padding, additive=eager)
    return original(module, query, key, value, mask, **kwargs)


def _write_fake_keys(query, key, request: PaddedRequest, scale: float) -> bool:
    """Fill the padding slots of ``key`` with keys every current query of the KV group scores
    below any real key by enough to get weight 0; False where no such key was found."""
    batch, kv_heads, _, dim = key.shape
    group, q_len = query.shape[1] // kv_heads, query.shape[2]
    grouped = query.reshape(batch, kv_heads, group * q_len, dim)
    keys, ok = fake_keys(grouped, request.key_norm_bound(), scale, key.dtype)
    rows, heads, slots = request.padding_slots()
    key[rows, heads, slots] = keys[rows, heads]  # only the padding slots are written
    return bool(ok.all())


def logical_weights(weights: torch.Tensor, request: PaddedRequest) -> torch.Tensor:
    """Attention weights over the view's columns ``[batch, heads, queries, columns]`` laid out
    over the logical positions, as the stock cache gives them (``output_attentions``): an
    evicted token or padding gets weight 0."""
    store = request.layer.store
    batch, heads, q_len, _ = weights.shape
    group = heads // store.packed.lengths.shape[1]
    positions = store.slot_positions().masked_fill(~store.slot_valid(), store.end)  # spare: end
    index = positions.repeat_interleave(group, dim=1)[:, :, None, :].expand(-1, -1, q_len, -1)
    logical = weights.new_zeros(batch, heads, q_len, store.end + 1)
    return logical.scatter_add_(-1, index, weights)[..., : store.end]
