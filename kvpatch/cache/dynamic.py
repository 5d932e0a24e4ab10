"""The cache users pass to ``generate``: a ``DynamicCache`` whose full-attention layers are
:class:`~kvpatch.cache.layer.CompressedLayer`."""

from __future__ import annotations

import dataclasses
import functools

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvpatch.cache.layer import CompressedLayer
from kvpatch.cache.quantized import Quantization
from kvpatch.cache.recompress import (
    DecodeBudget,
    check_decode_budget,
    check_max_kv_tokens,
)
from kvpatch.cache.requests import PrefillRequest, peek
from kvpatch.cache.stats import CacheStats, layer_stats
from kvpatch.policies import Policy, parse_policy, reconstruction_of


class CompressedDynamicCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are compressed after the prefill.

    Parameters
    ----------
    config : PretrainedConfig, optional
        The model's config; sliding-window layers found there stay uncompressed ``DynamicCache``
        layers. Without it every layer is a :class:`CompressedLayer`.
    policy : str or Policy, optional
        What to keep; overrides the policy given to :func:`kvpatch.enable`. Without either, nothing
        is compressed.
    decode_budget : int, optional
        Bound the cache while decoding too: once a layer's heads hold ``decode_budget +
        decode_interval`` tokens on average, the layer is compressed back to ``decode_budget``
        tokens per head with the same (token) policy. Without it, every generated token is kept.
    decode_interval : int, default 64
        How many tokens are appended between two decoding-time compressions.
    prefill_chunk_size : int, optional
        ``generate`` prefills a longer prompt in chunks of this many tokens, compressing every
        layer back to its budget after each (see :func:`kvpatch.prefill`), so that the KV held
        never exceeds the budget plus one chunk.
    quantize : {None, "int8", "int4"} or Quantization
        Store the kept tokens as 8- or 4-bit integers, KIVI-style: keys per channel (in groups of
        a head's tokens: 128 at int8, 32 at int4), values per token, scales in the model's dtype;
        the newest tokens (a channel policy's window, else the newest prefill tokens every head
        keeps, up to 32 at int8 and 128 at int4, and every token appended since the last
        compression) stay at full precision. None: the model's dtype.
    max_kv_tokens : int, optional
        A bounded history (a chat at constant memory, :meth:`~kvpatch.CompressedContext.extend`):
        the prefill keeps up to this many tokens per head (all of a shorter one) instead of the
        policy's ratio, and each appended turn is kept whole, the older tokens compressed back
        with the policy so that a head holds this many on average. ``generate`` decodes on top.
    sink_tokens : int, default 0
        Leading real tokens of each row every token policy keeps, on top of its own ``n_sink``:
        a chat template's system prefix (:func:`kvpatch.prefill` and the pipeline set it).
    recent_tokens : int, default 0
        Trailing real tokens of each row's prefill every token policy keeps: the question at the
        end of a prompt (``generate`` on an enabled model sets the policy's
        :attr:`~kvpatch.policies.Policy.prompt_window`).
    """

    def __init__(
        self,
        config=None,
        policy: str | Policy | None = None,
        decode_budget: int | None = None,
        decode_interval: int = 64,
        prefill_chunk_size: int | None = None,
        quantize: str | int | Quantization | None = None,
        max_kv_tokens: int | None = None,
        sink_tokens: int = 0,
        recent_tokens: int = 0,
        **kwargs,
    ):
        if config is not None and not isinstance(config, PretrainedConfig):
            raise TypeError(
                f"config must be the model's PretrainedConfig (model.config), got "
                f"{type(config).__name__}"
            )
        super().__init__(config=config, **kwargs)
        self.policy = parse_policy(policy)
        self.decode_budget = (
            None if decode_budget is None else DecodeBudget(decode_budget, decode_interval)
        )
        if self.policy is not None and self.decode_budget is not None:
            check_decode_budget(self.policy, self.decode_budget)
        check_chunk_size(prefill_chunk_size, self.policy, "prefill_chunk_size")
        self.prefill_chunk_size = prefill_chunk_size
        for name, count in (("sink_tokens", sink_tokens), ("recent_tokens", recent_tokens)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {count!r}")
        self.sink_tokens, self.recent_tokens = sink_tokens, recent_tokens
        self.max_kv_tokens = check_max_kv_tokens(max_kv_tokens, self.policy)
        #: set by ``generate`` for assisted decoding: the first forward's tokens that are the
        #: prompt, compressed alone (the candidates after them stay in the tail, to be cropped)
        self.prompt_tokens: int | None = None
        self.quantization = Quantization.parse(quantize)
        new_layer = functools.partial(CompressedLayer, quantization=self.quantization)
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = new_layer
        self.layers = [
            new_layer() if type(layer) is DynamicLayer else layer for layer in self.layers
        ]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx >= len(self.layers) and self.layer_class_to_replicate is None:
            raise ValueError(
                f"this cache has {len(self.layers)} layers (it was made for a model with that "
                f"many), but the model gives layer {layer_idx}: a cache is filled by one model; "
                "make a new CompressedDynamicCache(config=model.config) for this one"
            )
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        deferred = isinstance(layer, CompressedLayer) and layer.deferred is not None
        if (
            deferred
            and layer.reconstructing is None
            and not reconstruction_of(layer.deferred.policy)
        ):
            self.compress_deferred()  # every layer's prefill is known by now
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] > 1 and not isinstance(self.layers[layer_idx], CompressedLayer):
            _keep_own_storage(self.layers[layer_idx])  # a prefill or chunk: not each decode step
        request = peek(keys)
        if isinstance(request, PrefillRequest):  # what the cache adds to its layer's request
            request.policy, request.decode_budget = self.policy, self.decode_budget
            request.sink_tokens, request.prompt_tokens = self.sink_tokens, self.prompt_tokens
            request.recent_tokens = self.recent_tokens
            request.keep_tokens = self.max_kv_tokens
        return keys, values

    @property
    def deferred_layers(self) -> list[CompressedLayer]:
        """Layers holding their whole prefill until :meth:`compress_deferred`."""
        return [layer for layer in self.compressed_layers if layer.deferred is not None]

    @property
    def stored_layers(self) -> list[CompressedLayer]:
        """Layers whose store holds what their policy kept (not waiting, not kept dense)."""
        return [layer for layer in self.compressed_layers if layer.is_compressed]

    def crop(self, max_length: int) -> None:
        # Layers that wait for every layer's prefill (shared budgets) are compressed first, as
        # the next forward would: their plan must cover the tokens they hold (transformers crops
        # a draft model's cache right after its prefill).
        waiting = self.deferred_layers
        if waiting and not reconstruction_of(waiting[0].deferred.policy):
            self.compress_deferred()
        super().crop(max_length)

    def compress_deferred(self) -> None:
        """Compress the layers whose policy plans every layer at once (shared budgets, or the
        scores of a reconstruction in ``layer.reconstruction_scores``)."""
        layers = self.deferred_layers
        if not layers:
            return
        policy = layers[0].deferred.policy
        inputs = [
            dataclasses.replace(
                layer.deferred.inputs, reconstruction_scores=layer.reconstruction_scores
            )
            for layer in layers
        ]
        plans = policy.plan_layers(inputs)
        for layer, layer_inputs, plan in zip(layers, inputs, plans, strict=True):
            layer.compress(policy, layer_inputs, layer.deferred.decode_budget, plan=plan)

    @property
    def compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def nbytes(self) -> int:
        """Bytes held by every layer's tensors (their storages), compressed or not."""
        return self.stats().nbytes

    def stats(self) -> CacheStats:
        """Tokens held per layer and head, which positions, and bytes against an uncompressed
        ``DynamicCache`` holding the same tokens."""
        return CacheStats([layer_stats(layer) for layer in self.layers])

    def physical_lengths(self) -> list[torch.Tensor | None]:
        """Per layer, the tokens held by each (batch row, KV head); None for other layer kinds."""
        return [
            layer.physical_lengths() if isinstance(layer, CompressedLayer) else None
            for layer in self.layers
        ]


def _keep_own_storage(layer) -> None:
    """A sliding-window layer keeps a view of the whole prefill it was given (the last window of
    it): copy the window out, so that the prefill's storage is freed once attention is done."""
    for name in ("keys", "values"):
        held = getattr(layer, name, None)
        if held is not None and held.numel():
            stored = held.untyped_storage().nbytes()
            if stored > 2 * held.numel() * held.element_size():
                setattr(layer, name, held.clone())


def check_chunk_size(
    chunk_size: int | None, policy: Policy | None, name: str = "chunk_size"
) -> None:
    """Reject a chunk size that is not a positive integer, or a policy that cannot re-score
    what is held after each chunk."""
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name} must be a positive integer (tokens), got {chunk_size!r}")
    if policy is not None and policy.reconstruction is not None:
        raise ValueError(
            f"{policy.name!r} scores tokens by reconstructing the whole context, which a chunked "
            f"prefill does not have until its end; drop {name}, or use a policy that scores "
            "from queries or keys (snapkv, ada-snapkv, knorm, keydiff, ...)"
        )
