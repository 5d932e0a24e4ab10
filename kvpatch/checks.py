"""Checks of what users pass in, with errors that say what is expected."""

from __future__ import annotations

import torch


def token_batch(
    input_ids, attention_mask=None, name: str = "input_ids"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` as a ``[batch, tokens]`` integer tensor (a 1-D one is a batch of one) and
    its padding mask (all ones by default), or a ValueError saying what is wrong."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of token ids, got {type(input_ids).__name__}; "
            "e.g. tokenizer(text, return_tensors='pt').input_ids"
        )
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"{name} must be [batch, tokens] (or 1-D), got {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise ValueError(f"{name} is empty: give at least one token")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}"
        )
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but {name} has "
            f"{tuple(input_ids.shape)}; they must match"
        )
    return input_ids, attention_mask


def no_empty_rows(attention_mask: torch.Tensor) -> None:
    """A row with no real token has nothing to compress (nor to attend to): refuse it."""
    empty = (attention_mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"rows {empty} of attention_mask are all padding: every row needs at least one "
            "real token (drop those rows)"
        )


def same_kind_of_keys(held: torch.Tensor, new: torch.Tensor) -> None:
    """Refuse keys of another batch, head count, width or dtype than a cache layer holds: a cache
    filled by another model (or in another dtype) would fail deep in attention, or mix silently."""
    same_shape = held.shape[:2] == new.shape[:2] and held.shape[-1] == new.shape[-1]
    if same_shape and held.dtype == new.dtype:
        return
    raise ValueError(
        f"this cache layer holds keys [batch={held.shape[0]}, kv_heads={held.shape[1]}, "
        f"head_dim={held.shape[-1]}] in {held.dtype}, but the model gives [batch={new.shape[0]}, "
        f"kv_heads={new.shape[1]}, head_dim={new.shape[-1]}] in {new.dtype}: a cache is filled "
        "by one model, in one dtype and batch; make a new CompressedDynamicCache for this one"
    )
