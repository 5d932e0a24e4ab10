"""Answering one sample: build its (compressed) cache, ask, decode greedily, and measure."""

from __future__ import annotations

import copy
import itertools
import re
import time

import torch
from transformers import DynamicCache

import kvpatch
from kvpatch import compat
from kvpatch.tools.eval.codecs import Codec
from kvpatch.tools.eval.tasks import Sample


def layer_shares(cache) -> list[float | None] | None:
    """Per layer, the share of the context a head of it holds after compression (None for a
    sliding-window layer); None for an uncompressed cache."""
    if not isinstance(cache, kvpatch.CompressedDynamicCache):
        return None
    stats = cache.stats()
    return [
        None if layer.sliding or share is None else round(share, 4)
        for layer, share in zip(stats.layers, stats.kept_shares, strict=True)
    ]


def needle_survival(cache, spans: list[list[int]]) -> list[float] | None:
    """For each token of the first expected value, the fraction of (layer, KV head) pairs that
    hold it; None for an uncompressed cache."""
    if not isinstance(cache, kvpatch.CompressedDynamicCache) or not spans:
        return None
    kept = [layer.kept[0] for layer in cache.stats().layers if layer.compressed]
    if not kept:
        return None
    span = torch.tensor(spans[0], device=kept[0].device)
    held = torch.cat([heads[:, span] for heads in kept]).float()  # [layers x heads, span]
    return held.mean(0).cpu().tolist()


def new_tokens_for(sample: Sample, digits: int) -> int:
    """Enough tokens for every value (a character may be one token) and some punctuation."""
    return (sample.answer_width(digits) + 4) * len(sample.answers) + 4


class AnswerComplete:
    """Stops generation once the text holds as many values as expected (each matching
    ``pattern``, :meth:`Sample.answer_pattern`) and does not end in a digit."""

    def __init__(self, codec: Codec, start: int, numbers: int, pattern: str):
        self.codec, self.start, self.numbers = codec, start, numbers
        self.pattern = re.compile(pattern)

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        text = self.codec.decode(input_ids[0, self.start :].tolist())
        done = len(self.pattern.findall(text)) >= self.numbers and not text[-1:].isdigit()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _finish(model, ids, split, cache, logits, max_new_tokens, stop) -> list[int]:
    """Ask the question (if not in the cache yet) and decode greedily; returns the new tokens."""
    argument = compat.cache_argument(model)
    if split < ids.shape[1]:  # the question, on the (compressed) context
        logits = model(ids[:, split:], use_cache=True, logits_to_keep=1, **{argument: cache}).logits
    first = logits[:, -1].argmax(-1, keepdim=True)
    tokens = first
    eos = _eos_ids(model)
    if max_new_tokens > 1 and int(first) not in eos:
        from transformers import StoppingCriteriaList

        prompt = torch.cat([ids, first], dim=-1)
        criteria = StoppingCriteriaList([stop]) if stop is not None else None
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens - 1,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=model.generation_config.pad_token_id or 0,
            stopping_criteria=criteria,
            **{argument: cache},
        )
        tokens = generated[:, ids.shape[1] :]
    return [t for t in tokens[0].tolist() if t not in eos]


@torch.no_grad()
def answer(
    model,
    sample: Sample,
    policy: str | None,
    mode: str,
    max_new_tokens: int,
    stop=None,
    tokenizer=None,
    context_cache=None,
    prefill_options: dict | None = None,
) -> dict:
    """Answer one sample with its own prefill; ``policy`` None is the full cache on the unpatched
    model. In ``agnostic`` mode the context goes through :func:`kvpatch.prefill` first, or is
    ``context_cache``, a context already compressed (a copy of it is used).
    ``prefill_options``: more arguments of :func:`kvpatch.prefill` for compressed caches
    (``chunk_size``, ``quantize``)."""
    argument = compat.cache_argument(model)
    ids = sample.input_ids[None].to(model.device)
    split = sample.context_ids.shape[0] if mode == "agnostic" else ids.shape[1]
    logits = None
    start = time.perf_counter()
    if context_cache is not None:
        cache = copy.deepcopy(context_cache)
    elif policy is None:
        cache = DynamicCache(config=model.config)
        out = model(ids[:, :split], use_cache=True, logits_to_keep=1, **{argument: cache})
        logits = out.logits
    else:
        options = dict(policy=policy, tokenizer=tokenizer, **(prefill_options or {}))
        recent = _question_window(policy, mode)
        context = kvpatch.prefill(model, ids[:, :split], recent_tokens=recent, **options)
        cache, logits = context.cache, (context.logits if mode == "prefill" else None)
    prefill_s = time.perf_counter() - start
    return _answer_from(model, sample, ids, split, cache, logits, prefill_s, max_new_tokens, stop)


def _question_window(policy: str | None, mode: str) -> int:
    """The last prompt tokens ``generate`` keeps under ``policy`` with the question in the prompt
    (its :attr:`~kvpatch.policies.Policy.prompt_window`); none for a context alone."""
    if policy is None or mode != "prefill":
        return 0
    return kvpatch.parse_policy(policy).prompt_window


def _answer_from(model, sample, ids, split, cache, logits, prefill_s, max_new_tokens, stop):
    kv_bytes = kvpatch.cache_nbytes(cache)
    survival = needle_survival(cache, sample.needle_spans)
    layer_kept = layer_shares(cache)
    start = time.perf_counter()
    tokens = _finish(model, ids, split, cache, logits, max_new_tokens, stop)
    return {
        "tokens": tokens,
        "prefill_s": prefill_s,
        "decode_s": time.perf_counter() - start,
        "new_tokens": len(tokens),
        "kv_bytes": kv_bytes,
        "needle_survival": survival,
        "layer_kept": layer_kept,
    }


@torch.no_grad()
def answer_shared(
    model,
    sample: Sample,
    prefill: kvpatch.SharedPrefill,
    policy: str | None,
    mode: str,
    max_new_tokens: int,
    stop=None,
    tokenizer=None,
    context_cache=None,
) -> dict:
    """Like :func:`answer`, with the cache built from a :class:`~kvpatch.SharedPrefill` of the
    prompt (or a copy of ``context_cache``, built from it before)."""
    ids = sample.input_ids[None].to(model.device)
    split = sample.context_ids.shape[0] if mode == "agnostic" else ids.shape[1]
    start, reused = time.perf_counter(), 0.0
    if context_cache is not None:
        cache = copy.deepcopy(context_cache)
    else:
        cache = prefill.cache(model, policy, split, tokenizer, _question_window(policy, mode))
        reused = prefill.reused_reconstruction_s  # a reconstruction shared with another ratio
    compress_s = time.perf_counter() - start + reused
    logits = prefill.logits if split == ids.shape[1] else None
    if policy is not None and not kvpatch.is_enabled(model):
        kvpatch.enable(model)
    # the prefill's forward is shared: its time (scaled to this prefix) plus compression
    prefill_s = prefill.seconds * split / ids.shape[1] + compress_s
    return _answer_from(model, sample, ids, split, cache, logits, prefill_s, max_new_tokens, stop)


@torch.no_grad()
def build_context(
    model, sample: Sample, policy: str | None, tokenizer=None, prefill_options: dict | None = None
):
    """The cache of ``sample``'s context alone: compressed with ``policy`` (:func:`kvpatch.prefill`,
    with ``prefill_options``) or, for None, a full ``DynamicCache``."""
    ids = sample.context_ids[None].to(model.device)
    if policy is not None:
        options = dict(policy=policy, tokenizer=tokenizer, **(prefill_options or {}))
        return kvpatch.prefill(model, ids, **options).cache
    cache = DynamicCache(config=model.config)
    model(ids, use_cache=True, logits_to_keep=1, **{compat.cache_argument(model): cache})
    return cache


def build_context_cache(
    model,
    sample: Sample,
    spec,
    prefill: kvpatch.SharedPrefill | None,
    tokenizer,
    prefill_options: dict | None = None,
):
    """The (compressed) cache of ``sample``'s context, built once for every question about it,
    and the seconds it took (a reconstruction reused from another ratio included)."""
    start = time.perf_counter()
    reused = 0.0
    if sample.turns:
        cache = build_chat(model, sample, spec, tokenizer, prefill_options)
    elif prefill is not None:
        cache = prefill.cache(model, spec, sample.context_ids.shape[0], tokenizer)
        reused = prefill.reused_reconstruction_s
    else:
        cache = build_context(model, sample, spec, tokenizer, prefill_options)
    return cache, time.perf_counter() - start + reused


@torch.no_grad()
def build_chat(
    model, sample: Sample, policy: str | None, tokenizer=None, prefill_options: dict | None = None
):
    """The cache of a conversation's history, compressed with ``policy`` turn by turn: the first
    turn by :func:`kvpatch.prefill`, each later one by :meth:`~kvpatch.CompressedContext.extend`
    (None: a full ``DynamicCache``)."""
    if policy is None:
        return build_context(model, sample, None)
    ids = sample.context_ids[None].to(model.device)
    options = dict(policy=policy, tokenizer=tokenizer, **(prefill_options or {}))
    context = kvpatch.prefill(model, ids[:, : sample.turns[0]], **options)
    for start, end in itertools.pairwise(sample.turns):
        context = context.extend(ids[:, start:end], tokenizer=tokenizer)
    return context.cache
