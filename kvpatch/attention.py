"""The attention functions kvpatch registers with transformers: ``kvpatch_<backend>``.

Each wraps the stock implementation of its backend (sdpa, eager, flash_attention_2) and reads the
description :mod:`kvpatch.cache` attaches to the keys:

- no description (a plain cache, a sliding layer): the stock function runs unchanged;
- :class:`~kvpatch.cache.PrefillView`: the stock function attends over the full prefill, then the
  layer is compressed with the policy;
- :class:`~kvpatch.cache.PackedView` (a layer whose packed tokens are not stored dense): on the
  CPU with sdpa, :mod:`kvpatch.packed_attention` reads them in place; otherwise the store lays
  them out as a padded view, described by a ``CompressedView``;
- :class:`~kvpatch.cache.CompressedView`: padding slots of short heads get fake keys, the logical
  attention mask is translated to the physical layout, and the stock function runs on the view.
  Where fake keys cannot be guaranteed (soft-capped logits, queries no hyperplane separates), the
  padding slots are masked explicitly instead.
- :class:`~kvpatch.cache.ReplayView` (a KVzip context reconstruction): the weights are needed,
  so :mod:`kvpatch.replay_attention` computes them, whatever the backend (the stock kernel still
  gives the output where the scores are normalised over the chunk alone).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from kvpatch import compat, hidden_states, packed_attention, replay_attention
from kvpatch.cache import CompressedView, PackedView, PrefillView, ReplayView, view_of
from kvpatch.fake_keys import fake_keys
from kvpatch.policies import LayerInputs, Policy

BACKENDS = ("sdpa", "eager", "flash_attention_2")
PREFIX = "kvpatch_"

# Policy and rotary embedding of each attention module of an enabled model (weak, so a deleted
# model is forgotten).
_module_policies: weakref.WeakKeyDictionary[torch.nn.Module, Policy | None] = (
    weakref.WeakKeyDictionary()
)
_module_rotary: weakref.WeakKeyDictionary[torch.nn.Module, Callable] = weakref.WeakKeyDictionary()


def bind_policy(
    module: torch.nn.Module, policy: Policy | None, rotary: Callable | None = None
) -> None:
    _module_policies[module] = policy
    if rotary is not None:
        _module_rotary[module] = rotary


def unbind_policy(module: torch.nn.Module) -> None:
    _module_policies.pop(module, None)
    _module_rotary.pop(module, None)


def implementation_name(backend: str) -> str:
    return PREFIX + backend


def backend_of(implementation: str | None) -> str | None:
    """The stock backend behind ``implementation`` (``sdpa`` for ``kvpatch_sdpa``), or None."""
    if implementation in BACKENDS:
        return implementation
    if (
        implementation
        and implementation.startswith(PREFIX)
        and implementation[len(PREFIX) :] in BACKENDS
    ):
        return implementation[len(PREFIX) :]
    return None


def register() -> None:
    """Register ``kvpatch_<backend>`` for every backend (idempotent)."""
    for backend in BACKENDS:
        name = implementation_name(backend)
        if not compat.is_registered(name):
            compat.register_attention(name, _make_attention(backend), backend)


def _make_attention(backend: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        return kvpatch_attention(backend, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"kvpatch_{backend}_attention"
    return attention


def kvpatch_attention(backend, module, query, key, value, attention_mask, **kwargs):
    backend = _current_backend(backend, module)
    original = compat.original_attention(backend, module)
    hidden = hidden_states.take(module)
    view = view_of(key)
    if isinstance(view, PrefillView):
        output = original(module, query, key, value, attention_mask, **kwargs)
        _compress_prefill(view, module, query, key, value, attention_mask, kwargs, hidden)
        return output
    if isinstance(view, (PackedView, CompressedView)):
        view.layer.remember_hidden_states(hidden)
    if isinstance(view, PackedView):
        if backend == "sdpa" and packed_attention.serves(view.store, query, kwargs):
            return _attend_packed(module, query, attention_mask, view, kwargs)
        key, value = view.store.padded_view(view.layer)
        view = view_of(key)
    if isinstance(view, CompressedView):
        output, weights = _attend_compressed(
            backend, original, module, query, key, value, attention_mask, view, kwargs
        )
        return output, None if weights is None else logical_weights(weights, view)
    if isinstance(view, ReplayView):
        scaling, softcap = _scaling(module, query, kwargs), kwargs.get("softcap")
        if view.chunk.local is None:
            return replay_attention.attend(module, query, key, value, view, scaling, softcap)
        output = original(module, query, key, value, attention_mask, **kwargs)
        replay_attention.score_locally(module, query, key, value, view, scaling, softcap)
        return output
    return original(module, query, key, value, attention_mask, **kwargs)


def _current_backend(registered: str, module: torch.nn.Module) -> str:
    """The backend the model's config names now, else the one ``module`` was dispatched to: the
    masks are built for the former, so the kernel must be its (a config switched from eager to
    sdpa after ``enable`` gives no causal mask when it can be skipped)."""
    shared = compat.shared_config(module)
    current = backend_of(shared._attn_implementation) if shared is not None else None
    return current or registered


def _scaling(module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> float:
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    return float(scaling)


def _compress_prefill(view, module, query, key, value, attention_mask, kwargs, hidden) -> None:
    policy = view.policy if view.policy is not None else _module_policies.get(module)
    if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None):
        policy = None  # a sliding layer already bounds its cache
    if policy is None or not policy.needs_hidden_states:
        hidden = None
    valid = valid_tokens(attention_mask, key)
    candidates = None
    if view.prompt_tokens is not None:  # assisted decoding: its candidates are not compressed
        tokens = view.prompt_tokens
        query, key, value = (t[..., :tokens, :] for t in (query, key, value))
        valid = valid[:, :tokens]
        if hidden is not None:
            hidden, candidates = hidden[:, :tokens], hidden[:, tokens:]
    inputs = LayerInputs(
        queries=query,
        keys=key,
        values=value,
        valid=valid,
        scaling=_scaling(module, query, kwargs),
        layer_idx=getattr(module, "layer_idx", 0) or 0,
        rotary=_module_rotary.get(module),
        sink_tokens=view.sink_tokens,
        keep_tokens=view.keep_tokens,
        hidden_states=hidden,
    )
    if policy is not None and policy.needs_all_layers:
        view.layer.defer(policy, inputs, view.decode_budget)
    else:
        view.layer.compress(policy, inputs, view.decode_budget)
    if candidates is not None and candidates.shape[1]:
        view.layer.remember_hidden_states(candidates)


def valid_tokens(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """Which prefill tokens are real (not padding), ``[batch, tokens]``, from any backend's mask."""
    batch, _, tokens, _ = key.shape
    if attention_mask is None:
        return torch.ones(batch, tokens, dtype=torch.bool, device=key.device)
    if attention_mask.dim() == 2:  # flash attention: the 2-D padding mask
        return attention_mask[:, -tokens:].bool()
    # 4-D mask: the last query of a causal prefill sees every real token
    last_row = attention_mask[:, 0, -1, -tokens:]
    if last_row.dtype == torch.bool:
        return last_row.clone()
    return last_row == 0


def _attend_packed(module, query, attention_mask, view: PackedView, kwargs):
    view.layer.remember_queries(query)
    store = view.store
    visible = packed_attention.tail_visibility(attention_mask, store.tail_start, store.end, query)
    output = packed_attention.attend(store, query, visible, _scaling(module, query, kwargs))
    return output, None


def _attend_compressed(backend, original, module, query, key, value, attention_mask, view, kwargs):
    view.layer.remember_queries(query)
    batch, kv_heads, _, dim = key.shape
    q_heads, q_len = query.shape[1], query.shape[2]
    group = q_heads // kv_heads
    explicit = kwargs.get("softcap") is not None  # soft-capping bounds logits: no key can zero them
    if view.padding_slots is not None and not explicit:
        grouped = query.reshape(batch, kv_heads, group * q_len, dim)
        keys, ok = fake_keys(
            grouped, view.key_norm_bound, _scaling(module, query, kwargs), key.dtype
        )
        rows, heads, slots = view.padding_slots
        key[rows, heads, slots] = keys[rows, heads]  # only the padding slots are written
        explicit = not bool(ok.all())
    head_padding = None
    if view.padding_slots is not None and explicit:
        slots = torch.arange(view.packed_length, device=key.device)
        head_padding = slots >= view.lengths[..., None]  # [b, h, packed_length]
    if head_padding is not None and backend.startswith("flash"):
        # flash kernels take no per-head mask: compute this rare case exactly with eager math
        mask = physical_mask(attention_mask, view, query, key, head_padding, additive=True)
        return reference_attention(
            module, query, key, value, mask, _scaling(module, query, kwargs), kwargs
        )
    if backend.startswith("flash"):
        mask = physical_padding_mask(attention_mask, view, key)
    else:
        mask = physical_mask(
            attention_mask, view, query, key, head_padding, additive=backend == "eager"
        )
    return original(module, query, key, value, mask, **kwargs)


def logical_weights(weights: torch.Tensor, view: CompressedView) -> torch.Tensor:
    """Attention weights over the view's columns ``[batch, heads, queries, columns]`` laid out
    over the logical positions, as the stock cache gives them (``output_attentions``): an
    evicted token or padding gets weight 0."""
    store = view.layer.store
    batch, heads, q_len, _ = weights.shape
    group = heads // store.packed.lengths.shape[1]
    positions = store.slot_positions().masked_fill(~store.slot_valid(), store.end)  # spare: end
    index = positions.repeat_interleave(group, dim=1)[:, :, None, :].expand(-1, -1, q_len, -1)
    logical = weights.new_zeros(batch, heads, q_len, store.end + 1)
    return logical.scatter_add_(-1, index, weights)[..., : store.end]


def physical_mask(
    logical: torch.Tensor | None,
    view: CompressedView,
    query: torch.Tensor,
    key: torch.Tensor,
    head_padding: torch.Tensor | None,
    additive: bool,
) -> torch.Tensor | None:
    """Translate a logical 4-D mask (or None) to the view's columns.

    Packed columns are visible (kept tokens are real and precede every query) except the padding
    slots in ``head_padding``; tail columns take the logical mask's last columns.
    """
    if logical is None and head_padding is None:
        return None
    batch, q_heads, q_len, _ = query.shape
    end = view.tail_start + key.shape[-2] - view.packed_length  # logical length
    tail = packed_attention.tail_visibility(logical, view.tail_start, end, query)
    if tail is None:  # every tail token visible
        tail = torch.ones(1, 1, q_len, end - view.tail_start, dtype=torch.bool, device=key.device)
    tail = tail.expand(batch, -1, q_len, -1)
    if head_padding is None:
        packed = tail.new_ones(batch, 1, q_len, view.packed_length)
    else:
        group = q_heads // head_padding.shape[1]
        packed = (~head_padding).repeat_interleave(group, dim=1)[:, :, None, :]
        packed = packed.expand(-1, -1, q_len, -1)
        tail = tail.expand(-1, q_heads, -1, -1)
    visible = torch.cat([packed, tail], dim=-1)
    if not additive:
        return visible
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(visible, zero, torch.finfo(query.dtype).min)


def physical_padding_mask(
    logical: torch.Tensor | None, view: CompressedView, key: torch.Tensor
) -> torch.Tensor | None:
    """Flash attention's 2-D padding mask for the view (None when nothing is padding)."""
    if logical is None:
        return None
    tail = logical[:, view.tail_start :].bool()
    if bool(tail.all()):
        return None
    packed = tail.new_ones(tail.shape[0], view.packed_length)
    return torch.cat([packed, tail], dim=-1)


def reference_attention(module, query, key, value, additive_mask, scaling, kwargs):
    """Plain attention math with an additive mask; returns ``[batch, q_len, heads, dim]``."""
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1).float()
    values = value.repeat_interleave(group, dim=1).float()
    scores = (query.float() @ keys.transpose(-1, -2)) * scaling
    softcap = kwargs.get("softcap")
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if additive_mask is not None:
        scores = scores + additive_mask.float()
    weights = scores.softmax(dim=-1)
    output = (weights @ values).to(query.dtype)
    return output.transpose(1, 2).contiguous(), weights.to(query.dtype)
