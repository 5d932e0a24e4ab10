"""Chunked prefill: a long context goes in chunks, every layer compressed back to its budget after
each, checked against one-shot prefill, an oracle that sees each chunk's evictions, and the
budget."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, prompt
from helpers import generate, left_padded
from oracle import ORACLE, _evictions, _schedule, evictions_of, greedy_logits
from transformers import DynamicCache

import kvpatch
from kvpatch import CompressedDynamicCache, compat

STEPS = 6


def answer(model, context, question_ids):
    """Greedy logits of the question and ``STEPS`` tokens after a compressed context."""
    cache = context.copy_cache()
    return greedy_logits(model, question_ids, cache, STEPS)


@pytest.mark.parametrize(
    "policy", ["snapkv:0", "ada-snapkv:0", "think:0+knorm:0", "pyramid-tova:0"]
)
def test_nothing_evicted_equals_one_shot(policy):
    """At ratio 0 a chunked prefill holds what a one-shot prefill holds, and answers alike (the
    unpatched model's logits)."""
    model = make_model("llama")
    ids, question = prompt(700), prompt(6, seed=3)
    reference, ref_tokens = greedy_logits(
        model, torch.cat([ids, question], 1), DynamicCache(config=model.config), STEPS
    )
    with kvpatch.enabled(model, policy):
        chunked = kvpatch.prefill(model, ids, chunk_size=128)
        logits, tokens = answer(model, chunked, question)
    assert chunked.cache.get_seq_length() == 700
    assert all((n == 700).all() for n in chunked.cache.physical_lengths())
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, reference[-STEPS - 1 :], atol=1e-4, rtol=0)


def budget(seen: int, ratio: float, protected: int = 0) -> int:
    """Tokens a head keeps of ``seen``: the ratio's share, or the policy's protected tokens."""
    return max(seen - math.floor(seen * ratio), min(protected, seen))


@pytest.mark.parametrize("policy", ["snapkv:0.75", "ada-snapkv:0.75", "think:0.5+tova:0.75"])
def test_held_never_exceeds_budget_plus_a_chunk(policy):
    """After each chunk every head holds the budget of the tokens seen (on average, for head-wise
    budgets); during the next chunk's forward, that plus the chunk."""
    model = make_model("llama")
    chunk, length = 100, 730
    protected = kvpatch.parse_policy(policy).protected_tokens
    at_forward = []  # (tokens seen, most tokens a head holds) when each chunk starts

    def record(module, args, kwargs):
        cache = kwargs[compat.cache_argument(model)]
        lengths = cache.physical_lengths() if cache.get_seq_length() else []
        held = max((float(n.float().mean(-1).max()) for n in lengths), default=0.0)
        at_forward.append((cache.get_seq_length(), held))

    hook = model.model.register_forward_pre_hook(record, with_kwargs=True)
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, prompt(length), chunk_size=chunk)
    hook.remove()
    assert [seen for seen, _ in at_forward] == list(range(0, length, chunk))
    for seen, held in at_forward[1:]:
        assert held <= budget(seen, 0.75, protected), f"{held} held after {seen} tokens"
    final = [float(n.float().mean(-1).max()) for n in context.cache.physical_lengths()]
    assert max(final) <= budget(length, 0.75, protected)
    assert min(final) >= budget(length, 0.75, protected) - 1  # the whole budget is used


def test_chunked_prefill_matches_an_oracle_of_each_chunks_evictions():
    """Each chunk attends to what the previous chunks left, as the oracle does when it masks,
    chunk by chunk, the evictions made after each; then decoding sees the final evictions."""
    model = make_model("llama")
    ids, chunk = prompt(600), 150
    schedule, name = {}, compat.cache_argument(model)

    def record(module, args, kwargs):  # the evictions in force for the chunk about to run
        cache = kwargs[name]
        if cache.get_seq_length():
            schedule[cache.get_seq_length() + chunk] = evictions_of(cache)

    hook = model.model.register_forward_pre_hook(record, with_kwargs=True)
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.6"):
        context = kvpatch.prefill(model, ids, chunk_size=chunk)
        hook.remove()
        cache = context.copy_cache()
        logits, tokens = greedy_logits(model, tokens_after(context), cache, STEPS)
    expected = oracle_chunks(model, ids, chunk, schedule, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def tokens_after(context) -> torch.Tensor:
    """The greedy token after a context, to start decoding with."""
    return context.logits[:, -1].argmax(-1, keepdim=True)


def oracle_chunks(model, ids, chunk, schedule, final, tokens):
    """The oracle fed ``ids`` chunk by chunk (each masked by ``schedule``), then the greedy
    start token and ``tokens``, the final evictions in force while decoding."""
    implementation = compat.attention_implementation(model)
    _evictions.clear()
    _evictions.update(final)
    _schedule.clear()
    _schedule.update(schedule)
    compat.set_attention_implementation(model, ORACLE)
    name, cache = compat.cache_argument(model), DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[1], chunk):
                out = model(ids[:, start : start + chunk], use_cache=True, **{name: cache})
            logits, _ = greedy_logits(model, out.logits[:, -1:].argmax(-1), cache, STEPS, tokens)
    finally:
        compat.set_attention_implementation(model, implementation)
        _evictions.clear()
        _schedule.clear()
    return logits


def test_padded_rows_keep_their_own_budgets():
    """A left-padded batch: the first chunk reaches a real token of every row; each row ends with
    the budget of its own real tokens."""
    model = make_model("llama")
    lengths = [700, 260, 90]
    ids, mask = left_padded([prompt(n, seed=i)[0] for i, n in enumerate(lengths)])
    with kvpatch.enabled(model, "snapkv:0.5"):
        context = kvpatch.prefill(model, ids, mask, chunk_size=128)
    protected = kvpatch.parse_policy("snapkv").protected_tokens  # its window and sinks
    for held in context.cache.physical_lengths():
        for row, n in enumerate(lengths):  # the 90-token row keeps SnapKV's 64-token window
            assert (held[row] == budget(n, 0.5, protected=protected)).all()


@pytest.mark.parametrize("policy", ["global-knorm:0.5", "pyramid-knorm:0.5", "think-v:0.5"])
def test_policies_that_plan_every_layer_or_only_channels(policy):
    """Shared budgets are re-planned over every layer after each chunk (the uniform total);
    channel pruning alone keeps every token and moves its full-width window on."""
    model = make_model("llama")
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, prompt(500), chunk_size=128)
    total = sum(int(n.sum()) for n in context.cache.physical_lengths())
    heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    kept = 500 if policy.startswith("think") else budget(500, 0.5)
    assert abs(total - heads * kept) <= 0.02 * heads * kept  # rounding of per-layer shares
    for layer in context.cache.layers:
        assert layer.store.tail_length <= max(128, 32)


def test_generate_prefills_in_chunks():
    """``CompressedDynamicCache(prefill_chunk_size=...)`` makes generate prefill the prompt in
    chunks: at ratio 0 it gives the unpatched tokens; with eviction, what kvpatch.prefill with
    that chunk size holds."""
    model = make_model("llama")
    ids = prompt(500)
    expected, _, _ = generate(model, ids, do_sample=False)
    with kvpatch.enabled(model, "ada-snapkv:0"):
        cache = CompressedDynamicCache(config=model.config, prefill_chunk_size=100)
        tokens, _, _ = generate(model, ids, cache=cache, do_sample=False)
    assert torch.equal(tokens, expected)
    with kvpatch.enabled(model, "snapkv:0.6"):
        cache = CompressedDynamicCache(config=model.config, prefill_chunk_size=100)
        generate(model, ids, cache=cache, do_sample=False, new_tokens=1)
        alone = kvpatch.prefill(model, ids[:, :-1], chunk_size=100).cache
    # generate prefilled all but the last prompt token in chunks, then appended one token
    for held, expected_held in zip(cache.physical_lengths(), alone.physical_lengths(), strict=True):
        assert torch.equal(held, expected_held + 1)


@pytest.mark.slow
def test_long_context_benchmark_runs(tmp_path):
    """``python -m benchmarks.bench_long_context`` on a short context: chunks hold less KV
    at most."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "runs.json"
    command = [sys.executable, "-m", "benchmarks.bench_long_context", "--contexts", "2048"]
    command += ["--chunk", "128", "--json", str(out), "--threads", "1"]
    subprocess.run(command, check=True, cwd=root)
    runs = {run["mode"]: run for run in json.loads(out.read_text())}
    assert runs["dynamic"]["most_kv_mb"] == runs["dynamic"]["full_kv_mb"]
    assert runs["chunked"]["cache_mb"] == pytest.approx(runs["oneshot"]["cache_mb"], rel=0.02)
    assert (
        runs["chunked"]["most_kv_mb"]
        < runs["oneshot"]["most_kv_mb"]
        < runs["dynamic"]["most_kv_mb"]
    )


def test_chunks_of_one_token_still_compress():
    """A one-token prefill is kept as it is, so the first chunk takes two tokens at least."""
    model = make_model("llama")
    with kvpatch.enabled(model, "knorm:0.5"):
        context = kvpatch.prefill(model, prompt(40), chunk_size=1)
    assert all((n == 20).all() for n in context.cache.physical_lengths())
