"""Turning kvpatch on and off for a model, reversibly.

``enable`` switches the model's attention implementation to the matching ``kvpatch_<backend>``
function, binds the policy to its attention modules and wraps the instance's ``generate`` (with
``wrapt``) so that a call without a cache gets a :class:`~kvpatch.cache.CompressedDynamicCache`.
``disable`` undoes all three.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import wrapt

from kvpatch import attention, compat
from kvpatch.cache import CompressedDynamicCache
from kvpatch.policies import Policy, parse_policy

_MISSING = object()


@dataclass
class _Patch:
    policy: Policy | None
    implementation: str
    attention_modules: list[torch.nn.Module]
    instance_generate: object = field(default=_MISSING)


_patches: weakref.WeakKeyDictionary[torch.nn.Module, _Patch] = weakref.WeakKeyDictionary()


def is_enabled(model: torch.nn.Module) -> bool:
    return model in _patches


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Attention modules that dispatch through transformers' attention interface."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "layer_idx")
        and type(module).__name__.endswith("Attention")
        and hasattr(sys.modules[type(module).__module__], "ALL_ATTENTION_FUNCTIONS")
    ]


def _check_supported(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise ValueError(
            f"kvpatch.enable needs a transformers causal LM (a PreTrainedModel with generate), "
            f"got {type(model).__name__}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; kvpatch supports decoder-only "
            "models (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, ...)"
        )
    implementation = compat.attention_implementation(model)
    if implementation not in attention.BACKENDS:
        raise ValueError(
            f"attention implementation {implementation!r} is not supported; kvpatch wraps "
            f"{', '.join(attention.BACKENDS)} (load the model with attn_implementation=...)"
        )
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention module using transformers' attention "
            "interface; kvpatch supports decoder-only models such as Llama, Mistral, Qwen2, "
            "Qwen3 and Gemma 2/3"
        )
    return implementation, modules


def enable(model: torch.nn.Module, policy: str | Policy | None = None) -> None:
    """Compress ``model``'s KV cache with ``policy`` from now on.

    Parameters
    ----------
    model : a transformers decoder-only model loaded with sdpa, eager or flash_attention_2.
    policy : a policy string (``"think+snapkv"``) or :class:`~kvpatch.policies.Policy`. With None,
        only caches that carry their own policy are compressed.
    """
    policy = parse_policy(policy)
    if is_enabled(model):
        raise ValueError(
            "kvpatch is already enabled on this model; call kvpatch.disable(model) first"
        )
    implementation, modules = _check_supported(model)
    attention.register()
    patch = _Patch(policy, implementation, modules, model.__dict__.get("generate", _MISSING))
    compat.set_attention_implementation(model, attention.implementation_name(implementation))
    for module in modules:
        attention.bind_policy(module, policy)
    model.generate = wrapt.FunctionWrapper(model.generate, _generate_with_compressed_cache)
    _patches[model] = patch


def disable(model: torch.nn.Module) -> None:
    """Undo :func:`enable`: the model behaves exactly as before."""
    patch = _patches.pop(model, None)
    if patch is None:
        raise ValueError("kvpatch is not enabled on this model")
    compat.set_attention_implementation(model, patch.implementation)
    for module in patch.attention_modules:
        attention.unbind_policy(module)
    if patch.instance_generate is _MISSING:
        del model.generate
    else:
        model.generate = patch.instance_generate


@contextlib.contextmanager
def enabled(
    model: torch.nn.Module, policy: str | Policy | None = None
) -> Iterator[torch.nn.Module]:
    """``with kvpatch.enabled(model, "snapkv"): model.generate(...)``"""
    enable(model, policy)
    try:
        yield model
    finally:
        disable(model)


def _generate_with_compressed_cache(wrapped, instance, args, kwargs):
    model = wrapped.__self__
    wants_cache = (
        kwargs.get("use_cache", True) is not False and "cache_implementation" not in kwargs
    )
    if wants_cache and all(kwargs.get(name) is None for name in compat.CACHE_ARGUMENTS):
        kwargs[compat.cache_argument(model)] = CompressedDynamicCache(config=model.config)
    return wrapped(*args, **kwargs)
