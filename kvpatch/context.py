"""Compress once, ask many: prefill a long context once, then answer questions on copies of it.

>>> kvpatch.enable(model, "snapkv:0.75")
>>> context = kvpatch.prefill(model, context_ids)          # one forward over the context
>>> for question_ids in questions:
...     answer = context.generate(question_ids, max_new_tokens=32)

The context is compressed *before* any question is seen (question-agnostic compression). Each
question runs on its own copy of the compressed cache; the question's tokens are appended as one
causal chunk after the compressed context.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvpatch import compat
from kvpatch.cache import CompressedDynamicCache
from kvpatch.patching import is_enabled, prefill_into
from kvpatch.policies import Policy


@dataclass
class CompressedContext:
    """A context prefilled into a compressed cache.

    Attributes
    ----------
    model : the (enabled) model that prefilled it.
    input_ids : ``[batch, context_tokens]`` context token ids.
    attention_mask : ``[batch, context_tokens]`` padding mask (1 for real tokens).
    cache : the compressed cache after the context; never modified by :meth:`generate`.
    """

    model: torch.nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    cache: CompressedDynamicCache

    def copy_cache(self) -> CompressedDynamicCache:
        """An independent copy of the compressed cache, to continue from."""
        return copy.deepcopy(self.cache)

    def generate(self, question_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """``model.generate`` on context + question, reusing a copy of the compressed cache.

        ``question_ids`` is ``[batch, question_tokens]`` (or 1-D for a batch of one). Returns the
        generated tokens only, ``[batch, new_tokens]``.
        """
        if question_ids.dim() == 1:
            question_ids = question_ids[None]
        question_ids = question_ids.to(self.input_ids.device)
        if question_ids.shape[0] != self.input_ids.shape[0]:
            raise ValueError(
                f"the context has batch size {self.input_ids.shape[0]} but the question has "
                f"{question_ids.shape[0]}"
            )
        ids = torch.cat([self.input_ids, question_ids], dim=-1)
        mask = torch.cat([self.attention_mask, torch.ones_like(question_ids)], dim=-1)
        cache_kwarg = {compat.cache_argument(self.model): self.copy_cache()}
        output = self.model.generate(ids, attention_mask=mask, **cache_kwarg, **generate_kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        return sequences[:, ids.shape[-1] :]


def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    policy: str | Policy | None = None,
    tokenizer=None,
    **cache_kwargs,
) -> CompressedContext:
    """Run the context through ``model`` once and compress its cache.

    Parameters
    ----------
    model : a model on which :func:`kvpatch.enable` was called.
    input_ids : ``[batch, tokens]`` context (left-padded for a batch).
    attention_mask : its padding mask; all ones by default.
    policy : overrides the model's policy for this context.
    tokenizer : for ``kvzip``, which asks the model to repeat the context (defaults to the one
        given to :func:`kvpatch.enable`, or found in the model's checkpoint directory).
    cache_kwargs : passed to :class:`~kvpatch.CompressedDynamicCache` (e.g. ``decode_budget``).
    """
    if not is_enabled(model):
        raise ValueError("kvpatch.prefill needs kvpatch.enable(model, policy) first")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = CompressedDynamicCache(config=model.config, policy=policy, **cache_kwargs)
    prefill_into(model, cache, input_ids, attention_mask, tokenizer)
    return CompressedContext(model, input_ids, attention_mask, cache)
