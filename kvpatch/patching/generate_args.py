"""What an enabled model's ``generate(*args, **kwargs)`` is asked for, read before transformers
runs it: the prompt, the cache given or to be made, assisted decoding; and the refusals of what
kvpatch cannot compress (another kind of cache, a cache filled by another model)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from kvpatch import compat
from kvpatch.cache import CompressedDynamicCache


def prompt_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The prompt's ``[batch, tokens]`` ids, or None (given as ``inputs_embeds``)."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def prompt_mask(ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    mask = kwargs.get("attention_mask")
    return torch.ones_like(ids) if mask is None else mask


def assisted(model, kwargs: dict) -> bool:
    """Whether ``generate`` verifies candidate tokens (a draft model, prompt lookup): its first
    forward then holds the prompt and candidates, of which only the prompt is compressed."""
    if kwargs.get("assistant_model") is not None:
        return True
    config = kwargs.get("generation_config") or model.generation_config
    return any(
        kwargs.get(name, getattr(config, name, None)) is not None
        for name in ("prompt_lookup_num_tokens", "assistant_early_exit")
    )


def requested_cache_implementation(model, kwargs: dict) -> str | None:
    """The ``cache_implementation`` ``generate`` would use: its argument, else the
    ``generation_config`` given, else the model's (transformers fills a given config's unset
    fields from the model's)."""
    if kwargs.get("cache_implementation") is not None:
        return kwargs["cache_implementation"]
    given = getattr(kwargs.get("generation_config"), "cache_implementation", None)
    if given is not None:
        return given
    return getattr(getattr(model, "generation_config", None), "cache_implementation", None)


@contextlib.contextmanager
def dynamic_implementation_dropped(model, kwargs: dict) -> Iterator[str | None]:
    """While the block runs, ``generate`` is asked for no dynamic ``cache_implementation``, so
    that kvpatch's cache replaces it: the argument is removed, a ``generation_config`` given is
    replaced by a copy without it, the model's loses it until the block ends. Yields what was
    asked for, or None (then nothing is changed)."""
    implementation = requested_cache_implementation(model, kwargs)
    if implementation not in compat.DYNAMIC_CACHE_IMPLEMENTATIONS:
        yield None
        return
    kwargs.pop("cache_implementation", None)
    given = kwargs.get("generation_config")
    if getattr(given, "cache_implementation", None) is not None:
        kwargs["generation_config"] = given = copy.deepcopy(given)
        given.cache_implementation = None
    own = getattr(model, "generation_config", None)
    saved = getattr(own, "cache_implementation", None)
    if saved is not None:
        own.cache_implementation = None
    try:
        yield implementation
    finally:
        if saved is not None:
            own.cache_implementation = saved


def refuse_uncompressible(model, compresses: bool, cache, kwargs: dict) -> None:
    """A model that ``compresses`` (enabled with a policy) compresses every generation, or says
    why it cannot: another kind of cache (a DynamicCache, StaticCache, QuantizedCache...) would
    hold everything."""
    if not compresses:
        return  # enabled without a policy: only CompressedDynamicCaches compress
    kind = fix = None
    if cache is not None and not isinstance(cache, CompressedDynamicCache):
        kind = f"a {type(cache).__name__}"
        fix = "pass no cache (one is made), or CompressedDynamicCache(config=model.config)"
    elif (implementation := requested_cache_implementation(model, kwargs)) is not None:
        kind = f"cache_implementation={implementation!r}"
        fix = (
            f"drop it, or ask for one of {compat.DYNAMIC_CACHE_IMPLEMENTATIONS} (kvpatch's cache "
            "stands in for them), in generate's arguments or the generation_config given (on "
            "the model: model.generation_config.cache_implementation = None)"
        )
    if kind is not None:
        raise ValueError(
            f"generate() on a model kvpatch compresses was given {kind}, which would hold the "
            f"whole cache uncompressed: {fix}; to use another cache, kvpatch.disable(model) first"
        )


def refuse_another_models_cache(model, cache) -> None:
    """A filled cache with more layers than the model was filled by another model (one with
    fewer layers is refused at its first missing layer, by the cache itself)."""
    if not isinstance(cache, CompressedDynamicCache) or cache.get_seq_length() == 0:
        return
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if layers is not None and len(cache.layers) > layers:
        raise ValueError(
            f"this cache holds {len(cache.layers)} layers but the model has {layers}: a cache is "
            "filled by one model; make a new CompressedDynamicCache(config=model.config) for "
            "this one"
        )
