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
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvpatch import attention, checks, compat
from kvpatch.attention import hidden_states
from kvpatch.cache import CompressedDynamicCache, check_chunk_size
from kvpatch.feed import keep_system_prefix, prefill_into
from kvpatch.patching import generate_args
from kvpatch.policies import Policy, parse_policy, reconstruction_of

_MISSING = object()


@dataclass
class _Patch:
    policy: Policy | None
    implementation: str
    attention_modules: list[torch.nn.Module]
    tokenizer: object = None
    instance_generate: object = field(default=_MISSING)
    hooks: list = field(default_factory=list)


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
    _check_full_attention_layers(model)
    return implementation, modules


def _check_full_attention_layers(model: torch.nn.Module) -> None:
    """kvpatch compresses full-attention layers; a model with none would gain nothing."""
    layers = DynamicCache(config=model.config).layers
    if layers and not any(type(layer) is DynamicLayer for layer in layers):
        window = getattr(model.config, "sliding_window", None)
        raise ValueError(
            f"every attention layer of {type(model).__name__} uses a sliding window "
            f"({window} tokens), which already bounds its cache; kvpatch compresses "
            "full-attention layers and would change nothing here"
        )


def enable(model: torch.nn.Module, policy: str | Policy | None = None, tokenizer=None) -> None:
    """Compress ``model``'s KV cache with ``policy`` from now on.

    Parameters
    ----------
    model : a transformers decoder-only model loaded with sdpa, eager or flash_attention_2.
    policy : a policy string (``"think+snapkv"``) or :class:`~kvpatch.policies.Policy`. With None,
        only caches that carry their own policy are compressed.
    tokenizer : the model's tokenizer, which a policy that reconstructs its context needs to ask
        for it again; found in the model's local checkpoint directory when not given.
    """
    policy = parse_policy(policy)
    if is_enabled(model):
        raise ValueError(
            "kvpatch is already enabled on this model; call kvpatch.disable(model) first"
        )
    implementation, modules = _check_supported(model)
    if policy is not None:
        policy.prepare(model)  # e.g. reads a fitted map: fails now rather than mid-generate
    attention.register()
    patch = _Patch(
        policy, implementation, modules, tokenizer, model.__dict__.get("generate", _MISSING)
    )
    rotary = compat.rotary_function(model)
    for module in modules:
        compat.dispatch_module_to(module, attention.implementation_name(implementation))
        attention.bind_policy(module, policy, rotary)
        hook = module.register_forward_pre_hook(hidden_states.record, with_kwargs=True)
        patch.hooks.append(hook)
    model.generate = wrapt.FunctionWrapper(model.generate, _generate_with_compressed_cache)
    _patches[model] = patch


def disable(model: torch.nn.Module) -> None:
    """Undo :func:`enable`: the model behaves exactly as before."""
    patch = _patches.pop(model, None)
    if patch is None:
        raise ValueError("kvpatch is not enabled on this model")
    for module in patch.attention_modules:
        compat.restore_module_dispatch(module)
        attention.unbind_policy(module)
    for hook in patch.hooks:
        hook.remove()
    if patch.instance_generate is _MISSING:
        del model.generate
    else:
        model.generate = patch.instance_generate


def policy_of(model: torch.nn.Module) -> Policy | None:
    """The policy ``model`` was enabled with (None if none, or not enabled)."""
    patch = _patches.get(model)
    return None if patch is None else patch.policy


def tokenizer_of(model: torch.nn.Module, tokenizer=None):
    """``tokenizer``, else the one given to :func:`enable`, else the one saved with the model's
    local checkpoint (never downloaded), else None."""
    if tokenizer is not None:
        return tokenizer
    patch = _patches.get(model)
    if patch is not None and patch.tokenizer is not None:
        return patch.tokenizer
    path = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        found = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no local tokenizer files: the caller says what to pass
        return None
    if patch is not None:
        patch.tokenizer = found
    return found


@contextlib.contextmanager
def enabled(
    model: torch.nn.Module, policy: str | Policy | None = None, tokenizer=None
) -> Iterator[torch.nn.Module]:
    """``with kvpatch.enabled(model, "snapkv"): model.generate(...)``"""
    enable(model, policy, tokenizer)
    try:
        yield model
    finally:
        disable(model)


@contextlib.contextmanager
def suspended(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model as transformers made it within the block (a stock cache allowed: a full
    cache's answer beside a compressed one); enabled again after, as it was."""
    patch = _patches.get(model)
    if patch is None:
        yield model
        return
    disable(model)
    try:
        yield model
    finally:
        enable(model, patch.policy, patch.tokenizer)


def _generate_with_compressed_cache(wrapped, instance, args, kwargs):
    model = wrapped.__self__
    no_cache_given = all(kwargs.get(name) is None for name in compat.CACHE_ARGUMENTS)
    if policy_of(model) is None or not no_cache_given:
        return _generate(model, wrapped, args, kwargs, no_cache_given, None)
    with generate_args.dynamic_implementation_dropped(model, kwargs) as dynamic:
        return _generate(model, wrapped, args, kwargs, no_cache_given, dynamic)


def _generate(model, wrapped, args, kwargs, no_cache_given: bool, dynamic: str | None):
    """``generate`` with a compressed cache made where none is given and a dynamic one (or
    none) is asked for; ``dynamic_full`` makes no sliding-window layers, as in transformers."""
    wants_cache = kwargs.get("use_cache", True) is not False and (
        dynamic is not None or generate_args.requested_cache_implementation(model, kwargs) is None
    )
    if wants_cache and no_cache_given:
        config = None if dynamic == "dynamic_full" else model.config
        kwargs[compat.cache_argument(model)] = CompressedDynamicCache(config=config)
    given = (kwargs.get(name) for name in compat.CACHE_ARGUMENTS)
    cache = next((c for c in given if c is not None), None)  # a cache may be falsy (empty)
    generate_args.refuse_uncompressible(model, policy_of(model) is not None, cache, kwargs)
    generate_args.refuse_another_models_cache(model, cache)
    if isinstance(cache, CompressedDynamicCache) and cache.get_seq_length() == 0:
        if isinstance(kwargs.get("attention_mask"), torch.Tensor):
            checks.no_empty_rows(kwargs["attention_mask"])
        _prepare_empty_cache(model, cache, args, kwargs)
    return wrapped(*args, **kwargs)


def _prepare_empty_cache(model, cache: CompressedDynamicCache, args, kwargs) -> None:
    """What a prompt tells the cache before its prefill: the chat template's preamble to keep
    (when a tokenizer was given, to :func:`enable` or ``generate``: none is searched for on every
    call), the prompt's length under assisted decoding; and for a reconstruction or a chunked
    prefill, the prefill itself."""
    ids = generate_args.prompt_ids(args, kwargs)
    tokenizer = kwargs.get("tokenizer") or _patches[model].tokenizer
    policy = cache.policy if cache.policy is not None else policy_of(model)
    if policy is not None:  # the question's tokens, kept beside the preamble
        cache.recent_tokens = max(cache.recent_tokens, policy.prompt_window)
    if ids is not None and tokenizer is not None:
        mask = generate_args.prompt_mask(ids, kwargs)
        keep_system_prefix(cache, tokenizer, ids, mask, policy)
    assisted = ids is not None and generate_args.assisted(model, kwargs)
    cache.prompt_tokens = ids.shape[-1] if assisted else None  # a reused cache: set anew
    check_chunk_size(cache.prefill_chunk_size, policy, "prefill_chunk_size")
    if policy is None:
        return
    policy.prepare(model)
    if reconstruction_of(policy) is not None or cache.prefill_chunk_size is not None:
        _prefill_for_generate(model, cache, ids, kwargs)


def _prefill_for_generate(model, cache: CompressedDynamicCache, input_ids, kwargs) -> None:
    """Prefill all but the last prompt token before ``generate`` runs, so that the policy can
    reconstruct the prompt, or to prefill it in chunks; ``generate`` then continues from the
    compressed cache."""
    if input_ids is None:
        why = "a chunked prefill reads" if cache.prefill_chunk_size else "the policy reconstructs"
        raise ValueError(
            f"{why} the prompt from its token ids: pass input_ids to generate "
            "(inputs_embeds alone cannot be read again)"
        )
    if input_ids.shape[1] < 2:
        return
    mask = generate_args.prompt_mask(input_ids, kwargs)
    get_tokenizer = lambda: tokenizer_of(model, kwargs.get("tokenizer"))
    ids, mask = input_ids[:, :-1], mask[:, :-1]
    prefill_into(model, cache, ids, mask, get_tokenizer, cache.prefill_chunk_size)
    expand_for_generate(model, cache, kwargs)


def expand_for_generate(model, cache: CompressedDynamicCache, kwargs: dict) -> None:
    """Repeat the rows of a filled ``cache`` as ``generate(**kwargs)`` will repeat its inputs,
    for beams and returned sequences (generate does not expand a cache it is given filled)."""
    config = kwargs.get("generation_config") or model.generation_config
    setting = lambda name: kwargs.get(name) or getattr(config, name, None) or 1
    expand = max(setting("num_beams"), setting("num_return_sequences"))
    if expand > 1:
        cache.batch_repeat_interleave(expand)
