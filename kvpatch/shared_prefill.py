"""One exact prefill, compressed afterwards with any policy: comparing policies on one context.

The prefill of a causal model does not depend on what is evicted after it, so every policy's
cache can be built from one forward that records each layer's queries, keys and values.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvpatch import compat
from kvpatch.cache import CompressedDynamicCache, CompressedLayer
from kvpatch.feed import reconstruction
from kvpatch.patching import disable, enable, is_enabled
from kvpatch.policies import LayerInputs, Plan, Policy, Reconstruction, reconstruction_of


class _Recorder(Policy):
    """Records each layer's prefill inputs and keeps everything."""

    ratio = 0.0
    name = "record"

    def __init__(self, hidden_states: bool = False):
        self.inputs: dict[int, LayerInputs] = {}
        self.hidden_states = hidden_states

    @property
    def needs_hidden_states(self) -> bool:
        return self.hidden_states

    def plan(self, inputs: LayerInputs, must_keep=None) -> Plan:
        self.inputs[inputs.layer_idx] = inputs
        # everything packed: the recorded inputs are what later plans see
        everything = inputs.head_valid.clone()
        return Plan(keep=everything, channels=None, full_width_from=inputs.num_tokens)


class _RecordingCache(CompressedDynamicCache):
    """Also records what each layer the policy does not compress (a sliding window) is given:
    it keeps only its window, and a shorter prefix needs another one."""

    def __init__(self, config, policy: Policy):
        super().__init__(config=config, policy=policy)
        self.uncompressed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not isinstance(self.layers[layer_idx], CompressedLayer):
            self.uncompressed[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@dataclass
class SharedPrefill:
    """One exact prefill of a context: every layer's queries, keys and values, and the logits of
    its last token; :meth:`cache` builds any policy's cache from it, for the whole context or any
    prefix of it, as that policy's own prefill would have.

    >>> shared = kvpatch.SharedPrefill.run(model, ids)
    >>> caches = {p: shared.cache(model, p) for p in ("snapkv:0.75", "ada-snapkv:0.75")}
    """

    #: per compressed layer, its prefill inputs
    inputs: dict[int, LayerInputs]
    #: per other layer (sliding windows), the keys and values its prefill gave it
    uncompressed: dict[int, tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor
    seconds: float
    input_ids: torch.Tensor
    #: per (prefix length, reconstruction), each layer's reconstruction scores
    reconstructions: dict[tuple[int, Reconstruction], list[torch.Tensor]] = field(
        default_factory=dict
    )
    reconstruction_seconds: dict[tuple[int, Reconstruction], float] = field(default_factory=dict)
    #: seconds of reconstruction the last :meth:`cache` reused instead of running
    reused_reconstruction_s: float = 0.0

    @classmethod
    @torch.no_grad()
    def run(cls, model, ids: torch.Tensor, hidden_states: bool = False) -> SharedPrefill:
        """The prefill of ``ids``; with ``hidden_states``, each layer's hidden states are
        recorded too (for a hidden-state scorer; as many bytes again as the queries)."""
        recorder = _Recorder(hidden_states)
        was_enabled = is_enabled(model)
        if not was_enabled:
            enable(model)
        try:
            cache = _RecordingCache(model.config, recorder)
            start = time.perf_counter()
            argument = compat.cache_argument(model)
            out = model(ids, use_cache=True, logits_to_keep=1, **{argument: cache})
            seconds = time.perf_counter() - start
        finally:
            if not was_enabled:
                disable(model)
        return cls(recorder.inputs, cache.uncompressed, out.logits, seconds, ids)

    def cache(
        self,
        model,
        policy: str | None,
        length: int | None = None,
        tokenizer=None,
        recent_tokens: int = 0,
    ):
        """A cache holding the first ``length`` tokens, compressed with ``policy`` (None: a stock
        ``DynamicCache``), as a prefill of those tokens would have left it, the last
        ``recent_tokens`` of them kept (:class:`~kvpatch.CompressedDynamicCache`'s). A policy that
        reconstructs its context does so once per prefix and reconstruction (``tokenizer`` gives
        its prompt); other ratios reuse it."""
        if policy is None:
            cache = DynamicCache(config=model.config)
        else:
            cache = CompressedDynamicCache(
                config=model.config, policy=policy, recent_tokens=recent_tokens
            )
            cache.policy.prepare(model)
        length = length or self.input_ids.shape[1]
        self.reused_reconstruction_s = 0.0
        deferred = policy is not None and cache.policy.needs_all_layers
        for index, layer in enumerate(cache.layers):
            if index in self.uncompressed:  # a sliding window: as a prefill of the prefix keeps it
                keys, values = self.uncompressed[index]
                cache.update(keys[:, :, :length], values[:, :, :length], index)
                continue
            inputs = self.inputs[index]
            if length < inputs.num_tokens:
                inputs = dataclasses.replace(
                    inputs,
                    queries=inputs.queries[:, :, :length],
                    keys=inputs.keys[:, :, :length],
                    values=inputs.values[:, :, :length],
                    valid=inputs.valid[..., :length],
                    hidden_states=None
                    if inputs.hidden_states is None
                    else inputs.hidden_states[:, :length],
                )
            inputs = dataclasses.replace(inputs, recent_tokens=recent_tokens)
            layer.update(inputs.keys, inputs.values)
            if isinstance(layer, CompressedLayer):
                if deferred:
                    layer.defer(cache.policy, inputs)
                else:
                    layer.compress(cache.policy, inputs)
        declared = reconstruction_of(cache.policy) if deferred else None
        if declared is not None:
            self._reconstruct(model, cache, length, tokenizer, declared)
        if deferred:
            cache.compress_deferred()
        return cache

    def _reconstruct(
        self,
        model,
        cache: CompressedDynamicCache,
        length: int,
        tokenizer,
        declared: Reconstruction,
    ) -> None:
        key = (length, declared)  # the ratio is not part of it: every ratio shares the scores
        if key not in self.reconstructions:
            ids = self.input_ids[:, :length]
            start = time.perf_counter()
            prompts = reconstruction.Prompts(tokenizer, declared, ids.device, cache.policy.name)
            reconstruction.reconstruct(model, cache, ids, torch.ones_like(ids), prompts, declared)
            self.reconstruction_seconds[key] = time.perf_counter() - start
            scores = [layer.reconstruction_scores for layer in cache.deferred_layers]
            self.reconstructions[key] = scores
        else:
            self.reused_reconstruction_s = self.reconstruction_seconds[key]
        for layer, scores in zip(cache.deferred_layers, self.reconstructions[key], strict=True):
            layer.reconstruction_scores = scores
