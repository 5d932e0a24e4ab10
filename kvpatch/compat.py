"""Every difference between the supported transformers releases, in one place.

The rest of kvpatch calls these helpers instead of testing versions itself.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
import transformers
from packaging.version import Version
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

TRANSFORMERS_VERSION = Version(transformers.__version__)


def query_length(query) -> int:
    """``get_mask_sizes`` gets the query length (5.4+) or the query's ``cache_position``."""
    if isinstance(query, torch.Tensor):
        return query.shape[0]
    return int(query)


# From 5.15 ``crop`` takes only ``-n`` (remove n tokens; 0 removes nothing); before, a
# non-negative argument was the length to keep.
_CROP_TAKES_ONLY_NEGATIVE = TRANSFORMERS_VERSION >= Version("5.15")


def tokens_to_remove(argument: int, seen: int) -> int:
    """How many tokens ``crop(argument)`` removes from a layer that has seen ``seen``."""
    if argument < 0:
        return min(-argument, seen)
    if _CROP_TAKES_ONLY_NEGATIVE:
        if argument > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {argument}")
        return 0
    return max(seen - argument, 0)


def clear_layer(layer) -> None:
    """Make a cache layer empty and uninitialized.

    ``is_initialized`` exists from 4.57 (4.56's layers only test ``keys is None``), and before 5.24
    ``CacheLayerMixin.reset`` zeroes the tensors in place instead of dropping them, which would leave
    a stale tail in a layer whose ``update`` concatenates.
    """
    layer.keys = layer.values = None
    layer.is_initialized = False


def layer_is_initialized(layer) -> bool:
    """Whether a stock cache layer holds tensors (4.56's layers have no ``is_initialized``)."""
    flag = getattr(layer, "is_initialized", None)
    if flag is None:
        return getattr(layer, "keys", None) is not None
    return bool(flag)


def original_attention(backend: str, module: torch.nn.Module) -> Callable:
    """The stock attention function for ``backend`` as the model's own code would call it.

    ``eager`` is not registered with transformers: each model file defines its own
    ``eager_attention_forward`` (some add soft-capping or sinks), which is the one to wrap.
    """
    if backend == "eager":
        model_file = sys.modules[type(module).__module__]
        function = getattr(model_file, "eager_attention_forward", None)
        if function is None:
            raise ValueError(
                f"{type(module).__name__} has no eager_attention_forward in its model file; "
                "use attn_implementation='sdpa' with kvpatch"
            )
        return function
    return AttentionInterface._global_mapping[backend]


def register_attention(name: str, function: Callable, backend: str) -> None:
    """Register ``function`` as attention implementation ``name``, with ``backend``'s mask builder.

    Since 4.53 an implementation without a mask builder receives ``attention_mask=None``, so the
    original backend's builder is registered under the new name too.
    """
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[backend])


def is_registered(name: str) -> bool:
    return name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS


def attention_implementation(model: torch.nn.Module) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def set_attention_implementation(model: torch.nn.Module, name: str) -> None:
    model.set_attn_implementation(name)


def cache_argument(model: torch.nn.Module) -> str:
    """The model forward's cache argument: ``cache`` (5.24+) or ``past_key_values``."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_of(output) -> object | None:
    """The cache a model or ``generate`` output carries (``cache`` from 5.24, else
    ``past_key_values``)."""
    for name in CACHE_ARGUMENTS:
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    return None
