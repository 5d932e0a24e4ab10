"""Every difference between the supported transformers releases, in one place.

The rest of kvpatch calls these helpers instead of testing versions itself
(:mod:`kvpatch.compat.flash`: where transformers keeps its flash-attention functions).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from kvpatch.compat.flash import flash_functions, flash_functions_installed  # noqa: F401

TRANSFORMERS_VERSION = Version(transformers.__version__)


def query_length(query) -> int:
    """``get_mask_sizes`` gets the query length (5.4+) or the query's ``cache_position``."""
    if isinstance(query, torch.Tensor):
        return query.shape[0]
    return int(query)


# ``crop(n)`` on a dynamic layer, read in each release's cache_utils.py:
#   4.56-5.13  n < 0 removes -n tokens; n >= 0 is the length to keep (crop(0) empties the layer)
#   5.14       the same, except that crop(0) removes nothing
#   5.15-5.19  the argument is renamed tokens_to_remove; n > 0 (the length to keep) is deprecated
#   5.20+      n > 0 raises ValueError; only n <= 0 (remove -n tokens) is accepted
_CROP_ZERO_REMOVES_NOTHING = Version("5.14") <= TRANSFORMERS_VERSION
_CROP_REJECTS_POSITIVE = Version("5.20") <= TRANSFORMERS_VERSION


def tokens_to_remove(argument: int, seen: int) -> int:
    """How many tokens ``crop(argument)`` removes from a layer that has seen ``seen``, following
    the installed release's convention (see above)."""
    if argument < 0:
        return min(-argument, seen)
    if argument == 0 and _CROP_ZERO_REMOVES_NOTHING:
        return 0
    if argument > 0 and _CROP_REJECTS_POSITIVE:
        raise ValueError(
            f"crop takes a negative number of tokens to remove, got {argument} (a positive "
            "length to keep is not accepted from transformers 5.20)"
        )
    return max(seen - argument, 0)


def clear_layer(layer) -> None:
    """Make a cache layer empty and uninitialized.

    ``is_initialized`` exists from 4.57 (4.56's layers only test ``keys is None``), and the stock
    ``reset`` of 4.56-5.15 zeroes the tensors in place instead of dropping them (5.18 drops them),
    which would leave a stale tail of zeros in a layer whose ``update`` concatenates.
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
    if uses_flash_attention(backend):
        return _flash_attention_as_stock(backend)
    return AttentionInterface._global_mapping[backend]


def uses_flash_attention(implementation: str | None) -> bool:
    """Whether transformers treats ``implementation`` as flash attention (it looks for "flash")."""
    return implementation is not None and "flash" in implementation


class _ConfigNamed:
    """A model config that reads like ``config`` except that it names another implementation."""

    def __init__(self, config, implementation: str):
        self.__dict__.update(_config=config, _attn_implementation=implementation)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_config"], name)


class _ModuleWithStockName:
    """The attention module as the stock function sees it: its config names the stock backend."""

    def __init__(self, module: torch.nn.Module, backend: str):
        self.__dict__.update(_module=module, config=_ConfigNamed(module.config, backend))

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


_flash_wrappers: dict[str, Callable] = {}


def _flash_attention_as_stock(backend: str) -> Callable:
    """The stock flash function, called with a module whose config names ``backend``.

    The stock flash function picks its kernel by the exact name in
    ``module.config._attn_implementation`` in 5.x (checked in 5.3, 5.4, 5.15 and 5.24; 4.56-4.57
    pass no name and pick by environment): given ``kvpatch_flash_attention_2`` it would look for a
    Hub kernel of that name and fail.
    """
    if backend not in _flash_wrappers:
        stock = AttentionInterface._global_mapping[backend]

        def flash_attention(module, *args, **kwargs):
            return stock(_ModuleWithStockName(module, backend), *args, **kwargs)

        flash_attention.__wrapped__ = stock
        flash_attention.__name__ = f"{backend}_as_stock"
        _flash_wrappers[backend] = flash_attention
    return _flash_wrappers[backend]


def register_attention(name: str, function: Callable, backend: str) -> None:
    """Register ``function`` as attention implementation ``name`` with ``backend``'s mask builder
    (since 4.53 an implementation without a mask builder receives ``attention_mask=None``)."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[backend])


def is_registered(name: str) -> bool:
    return name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS


def attention_implementation(model: torch.nn.Module) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def set_attention_implementation(model: torch.nn.Module, name: str) -> None:
    """Switch ``model`` (and its sub-models) to attention implementation ``name`` (the tests'
    models; :func:`kvpatch.enable` changes only the attention modules, :func:`dispatch_module_to`).

    Between two flash implementations, or inside :func:`flash_functions` (the kernel is given),
    only the name changes: ``set_attn_implementation`` would look for the flash-attn package and
    a GPU, and in 5.x (checked in 5.3, 5.15 and 5.24) preload an unknown flash name from the Hub.
    """
    current = attention_implementation(model)
    renamed = uses_flash_attention(current) or flash_functions_installed()
    if name != current and uses_flash_attention(name) and renamed:
        configs = [model.config] + [
            module.config
            for module in model.modules()
            if isinstance(module, transformers.PreTrainedModel)
            and attention_implementation(module) == current
        ]
        for config in configs:
            config._attn_implementation = name  # the setter updates the sub-configs too
        return
    model.set_attn_implementation(name)


def dispatch_module_to(module: torch.nn.Module, name: str) -> None:
    """Have one attention module call the function registered as ``name``, through a shallow
    copy of its config naming it (every line reads ``self.config._attn_implementation`` at each
    forward); the model's config, which others may share and which decides the masks and checks
    such as ``output_attentions``, stays as it is. :func:`restore_module_dispatch` undoes it."""
    own = copy.copy(module.config)
    own._attn_implementation_internal = name  # not the setter: it would reach shared sub-configs
    module._kvpatch_config = module.config
    module.config = own


def shared_config(module: torch.nn.Module):
    """The config ``module`` had before :func:`dispatch_module_to` (None if not dispatched)."""
    return module.__dict__.get("_kvpatch_config")


def restore_module_dispatch(module: torch.nn.Module) -> None:
    module.config = module.__dict__.pop("_kvpatch_config")  # the one it had before dispatch


def cache_argument(model: torch.nn.Module) -> str:
    """The model forward's cache argument: ``cache`` (5.24+) or ``past_key_values``."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


CACHE_ARGUMENTS = ("cache", "past_key_values")


def _dynamic_cache_implementations() -> tuple[str, ...]:
    """The ``cache_implementation`` names of growing caches that a compressed cache stands in
    for: ``dynamic``, and ``dynamic_full`` (every layer full attention) where this transformers
    has it."""
    from transformers.generation import configuration_utils

    accepted = getattr(configuration_utils, "DYNAMIC_CACHE_IMPLEMENTATIONS", ("dynamic",))
    return tuple(name for name in ("dynamic", "dynamic_full") if name in accepted)


DYNAMIC_CACHE_IMPLEMENTATIONS = _dynamic_cache_implementations()


def cache_of(output) -> object | None:
    """The cache a model or ``generate`` output carries (``cache`` from 5.24, else
    ``past_key_values``)."""
    for name in CACHE_ARGUMENTS:
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    return None


def rotary_function(model: torch.nn.Module) -> RotaryEmbedding | None:
    """The rotary embedding of the model's full-attention layers as ``positions [n] -> (cos, sin)``
    (each ``[n, head_dim]``, float32), or None for a model without one.

    It is the decoder's ``rotary_emb`` module in every supported release; Gemma 3's takes the
    layer type from 5.x (``forward(x, position_ids, layer_type)``) and had a separate
    ``rotary_emb_local`` for sliding layers before.
    """
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None
    key = _rotary_keys.setdefault(rotary, next(_next_rotary_key))
    _rotary_modules[key] = rotary
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    return RotaryEmbedding(key, takes_layer_type)


#: the rotary modules :class:`RotaryEmbedding` refers to, by key, and their keys (never reused);
#: held weakly, so that they go with their model
_rotary_modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_rotary_keys: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
_next_rotary_key = itertools.count()


@dataclass(frozen=True)
class RotaryEmbedding:
    """A model's rotary embedding, called as ``positions [n] -> (cos, sin)``.

    It refers to the module by a key instead of holding it or a closure over it, so that a cache
    that remembers it is plain data: ``torch.export`` flattens the cache's state and rebuilds it
    from its attributes, which a module's methods or a closure do not survive.
    """

    key: int
    takes_layer_type: bool

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = _rotary_modules.get(self.key)
        if rotary is None:
            raise RuntimeError("the model this rotary embedding belongs to no longer exists")
        anchor = torch.zeros(1, device=positions.device, dtype=torch.float32)
        extra = {"layer_type": "full_attention"} if self.takes_layer_type else {}
        with torch.no_grad():
            cos, sin = rotary(anchor, positions[None], **extra)
        return cos[0].float(), sin[0].float()


def tensor_parallel_kwargs(world_size: int) -> dict:
    """``from_pretrained`` arguments that shard a model's heads over ``world_size`` processes
    (run under ``torchrun``): ``tp_plan="auto"`` up to 5.14; from 5.15 a ``DistributedConfig``
    with ``tp_size`` (5.18 removes the ``tp_plan`` argument)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    if "tp_size" not in inspect.signature(DistributedConfig).parameters:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_size=world_size)}


_CONFIGS_KEEP_ROPE_PARAMETERS = Version("5") <= TRANSFORMERS_VERSION


def read_rope_parameters(config) -> None:
    """A ``config.json`` written by transformers 5 keeps RoPE's settings in ``rope_parameters``
    alone; 4.x reads ``rope_theta`` (Gemma 3: and ``rope_local_base_freq``) and ``rope_scaling``
    and would silently use its defaults: set them from it (nothing to do on 5.x)."""
    params = getattr(config, "rope_parameters", None)
    if _CONFIGS_KEEP_ROPE_PARAMETERS or not isinstance(params, dict):
        return
    full = params.get("full_attention", params)  # Gemma 3 nests them by layer type
    if "rope_theta" in full:
        config.rope_theta = full["rope_theta"]
    sliding = params.get("sliding_attention")
    if isinstance(sliding, dict) and "rope_theta" in sliding:
        config.rope_local_base_freq = sliding["rope_theta"]
    scaling = {key: value for key, value in full.items() if key != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        config.rope_scaling = scaling


def load_tokenizer(path):
    """The tokenizer saved in ``path``; one saved by another transformers line may name a class
    this one lacks (5.x writes ``TokenizersBackend``, which 4.x does not know): its
    ``tokenizer.json`` is then read as a plain fast tokenizer, the same token ids."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging

    try:
        return AutoTokenizer.from_pretrained(path)
    except ValueError as error:
        if "does not exist or is not currently imported" not in str(error):
            raise
    said = logging.get_verbosity()
    logging.set_verbosity_error()  # not a warning here: the class named is the one 4.x lacks
    try:
        return PreTrainedTokenizerFast.from_pretrained(path)
    finally:
        logging.set_verbosity(said)
