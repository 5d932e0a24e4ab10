"""The attention functions kvpatch registers with transformers: ``kvpatch_<backend>``.

Each wraps the stock implementation of its backend (sdpa, eager, flash_attention_2) and serves
the request (:mod:`kvpatch.cache.requests`) a compressed layer posted with the keys it returned,
in one dispatch (:func:`kvpatch_attention`):

- no request (a plain cache, a sliding layer): the stock function runs unchanged;
- ``PrefillRequest``: the stock function attends over the full prefill, then the layer is
  compressed with the policy (:mod:`~kvpatch.attention.prefill`);
- ``PackedRequest`` (a layer whose packed tokens are not stored dense): on the CPU and CUDA with
  sdpa, :mod:`~kvpatch.attention.packed` reads them in place; otherwise the store lays them out
  as a padded view, posted with a ``PaddedRequest``;
- ``PaddedRequest``: padding slots of short heads get fake keys, the logical attention mask is
  translated to the view's columns (:mod:`~kvpatch.attention.masks`), and the stock function
  runs on the view (:mod:`~kvpatch.attention.padded`). Where fake keys cannot be guaranteed
  (soft-capped logits, queries no hyperplane separates), the padding slots are masked explicitly,
  with plain math (:mod:`~kvpatch.attention.reference`) under flash attention;
- ``ReconstructionRequest`` (a chunk of a context reconstruction): the weights are needed, so
  :mod:`~kvpatch.attention.reconstruction` computes them, whatever the backend (the stock kernel
  still gives the output where the scores are normalised over the chunk alone).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpatch import compat
from kvpatch.attention import hidden_states, packed, reconstruction
from kvpatch.attention.kernels import stock_kernels
from kvpatch.attention.modules import bind_policy, scaling, unbind_policy
from kvpatch.attention.padded import attend_padded, logical_weights
from kvpatch.attention.prefill import compress_prefill
from kvpatch.cache import PackedRequest, PaddedRequest, PrefillRequest, ReconstructionRequest, take

BACKENDS = ("sdpa", "eager", "flash_attention_2")
PREFIX = "kvpatch_"

__all__ = [
    "BACKENDS",
    "PREFIX",
    "backend_of",
    "bind_policy",
    "implementation_name",
    "kvpatch_attention",
    "register",
    "unbind_policy",
]


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
    """Serve the request posted with ``key``, if any, with ``backend``'s stock function."""
    backend = _current_backend(backend, module)
    stock = compat.original_attention(backend, module)
    if backend == "sdpa" and query.device.type == "cuda":
        original = _with_kernels(stock, query.device)
    else:
        original = stock
    hidden = hidden_states.take(module)
    request = take(key)
    if isinstance(request, (PackedRequest, PaddedRequest)):
        request.layer.remember_hidden_states(hidden)
    if isinstance(request, PackedRequest):
        if backend == "sdpa" and packed.serves(request.store, query, kwargs):
            return _attend_packed(module, query, attention_mask, request, kwargs)
        key, value = request.store.padded_view(request.layer)
        request = take(key)
    match request:
        case PrefillRequest():
            output = original(module, query, key, value, attention_mask, **kwargs)
            compress_prefill(request, module, query, key, value, attention_mask, kwargs, hidden)
            return output
        case PaddedRequest():
            output, weights = attend_padded(
                backend, original, module, query, key, value, attention_mask, request, kwargs
            )
            return output, None if weights is None else logical_weights(weights, request)
        case ReconstructionRequest():
            return _attend_reconstruction(
                original, module, query, key, value, attention_mask, request, kwargs
            )
        case _:
            return original(module, query, key, value, attention_mask, **kwargs)


def _with_kernels(stock: Callable, device: torch.device) -> Callable:
    """``stock`` run with the sdpa backends kvpatch chooses (:mod:`~kvpatch.attention.kernels`)."""

    def run(*args, **kwargs):
        with stock_kernels(device):
            return stock(*args, **kwargs)

    return run


def _current_backend(registered: str, module: torch.nn.Module) -> str:
    """The backend the model's config names now, else the one ``module`` was dispatched to: the
    masks are built for the former, so the kernel must be its (a config switched from eager to
    sdpa after ``enable`` gives no causal mask when it can be skipped)."""
    shared = compat.shared_config(module)
    current = backend_of(shared._attn_implementation) if shared is not None else None
    return current or registered


def _attend_packed(module, query, attention_mask, request: PackedRequest, kwargs):
    request.layer.remember_queries(query)
    store = request.store
    visible = packed.tail_visibility(attention_mask, store.tail_start, store.end, query)
    output = packed.attend(store, query, visible, scaling(module, query, kwargs))
    return output, None


def _attend_reconstruction(original, module, query, key, value, attention_mask, request, kwargs):
    scale, softcap = scaling(module, query, kwargs), kwargs.get("softcap")
    if request.chunk.local is None:
        return reconstruction.attend(module, query, key, value, request, scale, softcap)
    output = original(module, query, key, value, attention_mask, **kwargs)
    reconstruction.score_locally(module, query, key, value, request, scale, softcap)
    return output
