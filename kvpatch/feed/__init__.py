"""How tokens go into a compressed cache.

- :func:`prefill_into`: a context in one forward, compressed right after each layer's attention
  (the policy's reconstruction included), or in chunks (``chunk_size``): after each chunk every
  layer is compressed back to its budget, the policy's share of the tokens seen so far, scored with
  that chunk's queries, so the KV held never exceeds the budget plus one chunk;
- :func:`compress_appended`: a segment appended to a compressed context (a chat turn), of
  which ``1 - ratio`` is kept, scored with its own queries.

``get_tokenizer`` returns the tokenizer; it is called only when a reconstruction needs its
prompt (finding a tokenizer may read the model's checkpoint directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable

import torch

from kvpatch import compat
from kvpatch.cache import (
    CompressedDynamicCache,
    CompressedLayer,
    bounded_history_policy,
    token_part,
    token_policy_of,
)
from kvpatch.feed import reconstruction
from kvpatch.policies import LayerInputs, Policy, reconstruction_of

TokenizerSource = Callable[[], object]


def _no_tokenizer() -> None:
    return None


class ShortContextWarning(UserWarning):
    """A context so short at its ratio that the always-kept preamble takes most of its budget."""


def keep_system_prefix(
    cache: CompressedDynamicCache,
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    policy: Policy | None = None,
) -> None:
    """Have every token policy keep the chat template's preamble (system prompt, user header)
    that the context starts with: its first tokens are where attention sinks. Warns when that
    preamble would take most of what ``policy`` (the one in force) keeps at its ratio (not under
    ``max_kv_tokens``, a budget in tokens that keeps each turn whole)."""
    found = reconstruction.system_prefix_length(tokenizer, input_ids, attention_mask)
    cache.sink_tokens = max(cache.sink_tokens, found)
    if cache.max_kv_tokens is None:
        warn_if_preamble_fills_budget(
            policy, cache.sink_tokens, attention_mask, cache.recent_tokens
        )


def warn_if_preamble_fills_budget(
    policy: Policy | None, preamble: int, attention_mask: torch.Tensor, recent: int = 0
) -> None:
    """Warn when the always-kept preamble is at least half of the tokens a head keeps of the
    shortest row: a short document compressed at a high ratio then keeps little of its own text
    (the budget counts the preamble), and answers about it go wrong without an error. The
    ``recent`` last tokens (a question window) are kept beside the preamble."""
    tokens = token_part(policy) if policy is not None else None
    ratio = getattr(tokens, "ratio", 0.0)
    if not preamble or not ratio:
        return
    shortest = int(attention_mask.sum(-1).min())
    budget = shortest - math.floor(shortest * ratio + 1e-9)
    kept = min(shortest, max(budget, tokens.protected_tokens, preamble + recent))
    if 2 * preamble <= kept or kept == shortest:  # or a context kept whole: nothing is lost
        return
    # (1 - r) * n >= 2 * preamble keeps at least as many of the context's own tokens
    safe = math.floor(100 * (1 - 2 * preamble / shortest)) / 100
    advice = (
        f"ratio {safe:g} or less keeps at least as many of its own tokens"
        if safe > 0
        else "a context this short is better kept whole (ratio 0)"
    )
    warnings.warn(
        f"the chat template's preamble ({preamble} tokens, always kept) takes {preamble}"
        f" of the {kept} tokens a head keeps of this {shortest}-token context at ratio {ratio:g}:"
        f" little of the context itself is kept; {advice}",
        ShortContextWarning,
        stacklevel=4,
    )


@torch.no_grad()
def prefill_into(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    get_tokenizer: TokenizerSource = _no_tokenizer,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Prefill ``input_ids`` into ``cache``, compressed as its policy says, in one forward or in
    chunks of ``chunk_size`` tokens; returns the logits of the last position."""
    if cache.policy is not None:
        cache.policy.prepare(model)
    if chunk_size is not None and input_ids.shape[1] > chunk_size:
        return _prefill_in_chunks(
            model, cache, input_ids, attention_mask, get_tokenizer, chunk_size
        )
    out = model(
        input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.long().cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
        **{compat.cache_argument(model): cache},
    )
    deferred = cache.deferred_layers
    if deferred:
        tokenizer = get_tokenizer() if reconstruction_of(deferred[0].policy) else None
        reconstruction.finish_prefill(model, cache, input_ids, attention_mask, tokenizer)
    return out.logits


def _prefill_in_chunks(model, cache, input_ids, attention_mask, get_tokenizer, chunk_size):
    """The first chunk as a plain prefill (reaching one real token of every left-padded row, and
    two tokens at least: a one-token prefill is not compressed), then each next chunk appended
    and every layer compressed back to its budget. The cache's ``recent_tokens`` are the last
    of the whole prefill: each compression keeps those it has seen."""
    padding = int((attention_mask == 0).sum(-1).max())
    end, length = max(chunk_size, padding + 1, 2), input_ids.shape[1]
    recent = cache.recent_tokens
    # left padding: the last columns of a prefix that are among the prefill's last tokens
    seen_of_recent = lambda end: max(0, recent - (length - end))
    try:
        cache.recent_tokens = seen_of_recent(end)
        logits = prefill_into(
            model, cache, input_ids[:, :end], attention_mask[:, :end], get_tokenizer
        )
        while end < length:
            start, end = end, min(end + chunk_size, length)
            logits, layers = forward_appended(
                model, cache, input_ids[:, :end], attention_mask[:, :end], start
            )
            _compress_held(layers, attention_mask[:, :end], seen_of_recent(end))
    finally:
        cache.recent_tokens = recent
    return logits


def _compress_held(
    layers: list[CompressedLayer], attention_mask: torch.Tensor, recent_tokens: int = 0
) -> None:
    """Every layer back to the policy's share of the real tokens seen, scored with the queries
    of the chunk just appended (all layers planned at once, for shared budgets), keeping the
    last ``recent_tokens``."""
    if not layers:
        return
    seen = attention_mask.sum(-1)
    tokens = token_part(layers[0].policy)
    ratio = tokens.ratio if tokens is not None else 0.0
    budget = seen - torch.floor(seen.double() * ratio + 1e-9).long()
    inputs = [
        dataclasses.replace(layer.held_inputs(budget), recent_tokens=recent_tokens)
        for layer in layers
    ]
    if tokens is None:  # channels only: every token stays, the window moves on
        keeps = [x.head_valid for x in inputs]
    else:
        keeps = [plan.keep for plan in tokens.plan_layers(inputs, _windows(layers, inputs))]
    for layer, x, keep in zip(layers, inputs, keeps, strict=True):
        layer.keep_held(x, keep)


@torch.no_grad()
def append_within_budget(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Run ``input_ids[:, start:]`` into ``cache`` whole; then, if a layer's heads hold more
    than ``cache.max_kv_tokens`` tokens on average, compress every layer back to that many with
    its policy, scored with these tokens' queries, which are all kept. Returns the logits after
    the last token."""
    logits, layers = forward_appended(model, cache, input_ids, attention_mask, start)
    budget, newest = cache.max_kv_tokens, input_ids.shape[1] - start
    if layers and any(layer.store.held_per_head() > budget for layer in layers):
        tokens = bounded_history_policy(layers[0].policy)
        inputs = [layer.held_inputs(max(budget, newest)) for layer in layers]
        windows = _windows(layers, inputs)
        windows = [_with_newest(w, x, newest) for w, x in zip(windows, inputs, strict=True)]
        plans = tokens.plan_layers(inputs, windows)
        for layer, x, plan in zip(layers, inputs, plans, strict=True):
            layer.keep_held(x, plan.keep)
    for layer in layers:
        layer.segment_queries = None
    return logits


def _with_newest(window: torch.Tensor | None, inputs: LayerInputs, newest: int) -> torch.Tensor:
    """``window`` (or nothing) and the last ``newest`` of ``inputs``' tokens: always kept."""
    keep = torch.zeros(
        inputs.keys.shape[0], inputs.num_tokens, dtype=torch.bool, device=inputs.keys.device
    )
    keep[:, inputs.num_tokens - newest :] = True
    return keep if window is None else keep | window


def _windows(layers: list[CompressedLayer], inputs: list[LayerInputs]) -> list:
    """Per layer, which of its ``inputs``' tokens stay full width (always kept), or None."""
    return [
        layer.setup.full_width_window(layer.store, x.num_tokens)
        for layer, x in zip(layers, inputs, strict=True)
    ]


def forward_appended(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, list[CompressedLayer]]:
    """Run ``input_ids[:, start:]`` into ``cache`` (which holds the tokens before ``start``),
    recording the queries of every compressed layer. Returns the logits after the last token
    and those layers."""
    layers = cache.stored_layers
    lengths = attention_mask[:, :start].sum(-1, keepdim=True)
    new = input_ids[:, start:]
    positions = lengths + torch.arange(new.shape[1], device=new.device)
    with contextlib.ExitStack() as appending:
        for layer in layers:
            appending.enter_context(layer.appending())
        logits = model(
            new,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{compat.cache_argument(model): cache},
        ).logits
    return logits, layers


@torch.no_grad()
def compress_appended(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
    get_tokenizer: TokenizerSource = _no_tokenizer,
) -> torch.Tensor:
    """Run ``input_ids[:, start:]`` into ``cache`` (which holds the tokens before ``start``), then
    compress each layer's tail, these tokens included, with the layer's own policy. Returns the
    logits after the last token."""
    logits, layers = forward_appended(model, cache, input_ids, attention_mask, start)
    if not layers:
        return logits
    policy = layers[0].policy
    declared = reconstruction_of(token_policy_of(policy))
    if declared is not None:
        tail = layers[0].store.tail_start
        prompts = reconstruction.Prompts(get_tokenizer(), declared, input_ids.device, policy.name)
        reconstruction.reconstruct(model, cache, input_ids, attention_mask, prompts, declared, tail)
    inputs = [layer.segment_inputs() for layer in layers]
    plans = token_policy_of(policy).plan_layers(inputs, _windows(layers, inputs))
    for layer, plan in zip(layers, plans, strict=True):
        layer.compress_segment(plan.keep)
    return logits
