"""What several test modules share: how they run a model (left-padded batches, generate with
its logits, the oracle's generate, decoding against a decode budget, a compressed run, the
memory tests' prefill) and a tokenizer stand-in. Tests import from here, never from each other."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import prompt
from oracle import ORACLE, _evictions, evictions_of, greedy_logits

import kvpatch
from kvpatch import CompressedDynamicCache, compat
from kvpatch.feed import prefill_into
from kvpatch.patching import tokenizer_of


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    return ids, mask


def generate(model, ids, mask=None, new_tokens=8, cache=None, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    if cache is not None:
        kwargs[compat.cache_argument(model)] = cache
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1), compat.cache_of(out)


def run_oracle_generate(model, ids, cache, **kwargs):
    """The same generate() call on the oracle (masked full cache) with ``cache``'s evictions."""
    implementation = compat.attention_implementation(model)
    _evictions.update(evictions_of(cache))
    compat.set_attention_implementation(model, ORACLE)
    try:
        return generate(model, ids, **kwargs)
    finally:
        compat.set_attention_implementation(model, implementation)
        _evictions.clear()


#: beams, beams with several returned sequences, sampling with several returned sequences
GENERATION_MODES = pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=3, do_sample=False),
        dict(num_beams=3, num_return_sequences=2, do_sample=False),
        dict(do_sample=True, num_return_sequences=3, top_k=20),
    ],
    ids=["beams", "beams-return-2", "sampling-return-3"],
)


def held_per_head(cache):
    """Per layer, tokens held per KV head on average (the largest batch row)."""
    return [float(n.float().mean(-1).max()) for n in cache.physical_lengths()]


def decode_against_schedule(model, ids, policy, budget, interval, steps):
    """Greedy decoding one forward a step on a budgeted cache; returns the logits of every step,
    the tokens fed, the evictions in force at each key length, the bytes after each step and the
    most tokens a head held."""
    name = compat.cache_argument(model)
    schedule, logits, fed, held_bytes, most = {}, [], [], [], 0
    with kvpatch.enabled(model, policy), torch.no_grad():
        cache = CompressedDynamicCache(
            config=model.config, decode_budget=budget, decode_interval=interval
        )
        out = model(ids, **{name: cache})
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            fed.append(logits[-1].argmax(-1, keepdim=True))
            out = model(fed[-1], **{name: cache})
            schedule[cache.get_seq_length()] = evictions_of(cache)
            most = max(most, *held_per_head(cache))
            held_bytes.append(cache.nbytes())
        logits.append(out.logits[:, -1])
    return torch.stack(logits), torch.cat(fed, 1), schedule, held_bytes, most


PROMPT = 1024


SLACK = 0.02


def prefill(model, cache):
    with torch.no_grad():
        model(prompt(PROMPT), use_cache=True, **{compat.cache_argument(model): cache})
    return cache


STEPS = 10


def compressed_run(model, policy: str, ids: torch.Tensor):
    kvpatch.enable(model, policy)
    try:
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = greedy_logits(model, ids, cache, STEPS)
    finally:
        kvpatch.disable(model)
    return logits, tokens, cache


def held_bytes(obj, seen=None, visited=None) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj``'s attributes (through
    containers, dataclasses and kvpatch's own objects)."""
    seen = {} if seen is None else seen
    visited = set() if visited is None else visited
    if id(obj) in visited:
        return sum(seen.values())
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            held_bytes(item, seen, visited)
    elif hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            if _may_hold_tensors(value):
                held_bytes(value, seen, visited)
    return sum(seen.values())


def _may_hold_tensors(value) -> bool:
    if isinstance(value, (torch.Tensor, list, tuple)) or dataclasses.is_dataclass(value):
        return True
    return type(value).__module__.startswith("kvpatch.")


def prefill_and_decode(model, ids, cache, steps: int = 8):
    """``kvpatch.prefill``'s path (prefill, reconstruction, compression), then greedy steps."""
    get_tokenizer = lambda: tokenizer_of(model)  # the one given to enable
    logits = [prefill_into(model, cache, ids, torch.ones_like(ids), get_tokenizer)[:, -1].float()]
    fed = []
    name = compat.cache_argument(model)
    with torch.no_grad():
        for _ in range(steps):
            fed.append(logits[-1].argmax(-1, keepdim=True))
            out = model(fed[-1], use_cache=True, **{name: cache})
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits), torch.cat(fed, 1)
