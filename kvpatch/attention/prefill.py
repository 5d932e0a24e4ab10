"""A layer's first forward: the stock kernel attends over the whole prefill, then the layer is
compressed with its policy, from the queries, keys and values that forward computed."""

from __future__ import annotations

import torch

from kvpatch.attention.modules import policy_of, rotary_of, scaling
from kvpatch.cache import PrefillRequest
from kvpatch.policies import LayerInputs


def compress_prefill(
    request: PrefillRequest, module, query, key, value, attention_mask, kwargs, hidden
) -> None:
    """Compress ``request.layer`` (or have it wait for every layer, for shared budgets) with the
    cache's policy, else the module's; a sliding layer is left whole."""
    policy = request.policy if request.policy is not None else policy_of(module)
    if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None):
        policy = None  # a sliding layer already bounds its cache
    if policy is None or not policy.needs_hidden_states:
        hidden = None
    valid = valid_tokens(attention_mask, key)
    candidates = None
    if request.prompt_tokens is not None:  # assisted decoding: its candidates are not compressed
        tokens = request.prompt_tokens
        query, key, value = (t[..., :tokens, :] for t in (query, key, value))
        valid = valid[:, :tokens]
        if hidden is not None:
            hidden, candidates = hidden[:, :tokens], hidden[:, tokens:]
    inputs = LayerInputs(
        queries=query,
        keys=key,
        values=value,
        valid=valid,
        scaling=scaling(module, query, kwargs),
        layer_idx=getattr(module, "layer_idx", 0) or 0,
        rotary=rotary_of(module),
        sink_tokens=request.sink_tokens,
        recent_tokens=request.recent_tokens,
        keep_tokens=request.keep_tokens,
        hidden_states=hidden,
    )
    if policy is not None and policy.needs_all_layers:
        request.layer.defer(policy, inputs, request.decode_budget)
    else:
        request.layer.compress(policy, inputs, request.decode_budget)
    if candidates is not None and candidates.shape[1]:
        request.layer.remember_hidden_states(candidates)


def valid_tokens(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """Which prefill tokens are real (not padding), ``[batch, tokens]``, from any backend's mask."""
    batch, _, tokens, _ = key.shape
    if attention_mask is None:
        return torch.ones(batch, tokens, dtype=torch.bool, device=key.device)
    if attention_mask.dim() == 2:  # flash attention: the 2-D padding mask
        return attention_mask[:, -tokens:].bool()
    # 4-D mask: the last query of a causal prefill sees every real token
    last_row = attention_mask[:, 0, -1, -tokens:]
    if last_row.dtype == torch.bool:
        return last_row.clone()
    return last_row == 0
