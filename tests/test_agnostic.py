"""Question-agnostic policies: KVzip's context reconstruction, expected attention, KeyDiff and
budgets shared across layers, each against an independent computation and the masking oracle."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, prompt
from helpers import GENERATION_MODES, left_padded, prefill_and_decode
from oracle import evictions_of, greedy_logits, oracle_logits
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kvpatch
from kvpatch import CompressedDynamicCache, compat, parse_policy
from kvpatch.attention import reconstruction as reconstruction_attention
from kvpatch.feed.reconstruction import Prompts, _turn_end, reconstruct
from kvpatch.policies import ExpectedAttention, KeyDiff, KVzip, KVzipPlus, LayerInputs
from kvpatch.policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT
from kvpatch.policies.needs import reconstruction_of
from kvpatch.tools.testing import byte_tokenizer, seeded

STEPS = 8


def encode(text: str) -> list[int]:
    """The byte tokenizer's ids: one per byte."""
    return list(text.encode())


# -- KVzip against an independent eager computation --------------------------------------------


def reference_reconstruction(
    model,
    ids: torch.Tensor,
    chunk: int,
    overlap: int = 8,
    normalise: str = "context",
    sinks: int = 4,
    weighted: bool = False,
):
    """Per layer ``[kv_heads, n]``: the largest attention weight (eager, no cache, the whole
    sequence context + prompt + chunk in one forward) any reconstruction query of a KV head's
    group gives each context token, over every chunk.

    ``normalise="chunk"``: each query's weights renormalised over the sinks, the context tokens
    its chunk repeats and the chunk (a softmax restricted to a subset of keys is the full softmax
    renormalised over it); only those context tokens are scored. ``weighted`` (KVzip+): each
    weight times ``||W_o[head] v_token||`` over ``||hidden state of the query||``, head by head."""
    n = ids.shape[1]
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    best = None
    implementation = compat.attention_implementation(model)
    compat.set_attention_implementation(model, "eager")
    captured = {}

    def keep_hidden(module, args, kwargs):
        captured[("h", module.layer_idx)] = kwargs.get("hidden_states", args[0] if args else None)

    def keep_values(idx):
        return lambda module, args, out: captured.__setitem__(("v", idx), out)

    attentions = [layer.self_attn for layer in model.model.layers]
    hooks = [a.register_forward_pre_hook(keep_hidden, with_kwargs=True) for a in attentions]
    hooks += [a.v_proj.register_forward_hook(keep_values(i)) for i, a in enumerate(attentions)]
    try:
        for start in range(0, n, chunk):
            if start == 0:
                prompt_ids = encode(REPEAT_PROMPT + "\n")
            else:
                tail = ids[0, start - overlap : start].tolist()
                prompt_ids = encode(CONTINUE_PROMPT) + tail + encode("\n")
            new = torch.tensor([prompt_ids + ids[0, start : start + chunk].tolist()])
            with torch.no_grad():
                out = model(torch.cat([ids, new], 1), output_attentions=True, use_cache=False)
            local = torch.zeros(n + new.shape[1], dtype=torch.bool)
            local[: min(sinks, start)] = True
            local[start : start + chunk] = True
            local[n:] = True
            layers = []
            for idx, weights in enumerate(out.attentions):  # [1, q_heads, total, total]
                rows = weights[0, :, n:, :]  # reconstruction queries -> every key
                if normalise == "chunk":
                    rows = rows * local / (rows * local).sum(-1, keepdim=True)
                    rows = rows * local  # keys outside the subset score nothing
                rows = rows[..., :n]
                if weighted:
                    rows = plus_weighting(model, captured, idx, rows, n)
                per_kv = rows.reshape(config.num_key_value_heads, group * rows.shape[1], n)
                layers.append(per_kv.amax(1))
            best = (
                layers
                if best is None
                else [torch.maximum(a, b) for a, b in zip(best, layers, strict=True)]
            )
    finally:
        for hook in hooks:
            hook.remove()
        compat.set_attention_implementation(model, implementation)
    return best


def plus_weighting(model, captured, idx: int, rows: torch.Tensor, n: int) -> torch.Tensor:
    """KVzip+'s weighting of ``rows`` ``[q_heads, queries, n]``, one query head at a time."""
    config = model.config
    dim = config.head_dim
    group = config.num_attention_heads // config.num_key_value_heads
    hidden = captured[("h", idx)][0, n:]  # [queries, hidden]
    values = captured[("v", idx)][0, :n].view(n, config.num_key_value_heads, dim)
    o_proj = model.model.layers[idx].self_attn.o_proj.weight
    out = torch.empty_like(rows)
    for head in range(config.num_attention_heads):
        contribution = values[:, head // group] @ o_proj[:, head * dim : (head + 1) * dim].T
        out[head] = rows[head] * contribution.norm(dim=-1) / hidden.norm(dim=-1)[:, None]
    return out


def reconstruction_scores_of(model, ids: torch.Tensor, scorer: KVzip) -> tuple:
    """Each layer's ``reconstruction_scores`` after kvpatch's reconstruction of ``ids``, and the
    cache (its layers still waiting for compression)."""
    with kvpatch.enabled(model, scorer, tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, use_cache=True, **{compat.cache_argument(model): cache})
        layers = cache.deferred_layers
        assert len(layers) == model.config.num_hidden_layers
        mask = torch.ones_like(ids)
        declared = scorer.reconstruction
        prompts = Prompts(byte_tokenizer(chat_template=False), declared, ids.device, scorer.name)
        reconstruct(model, cache, ids, mask, prompts, declared)
        return [layer.reconstruction_scores[0] for layer in layers], cache


def spread_back(scores: torch.Tensor, span: int) -> torch.Tensor:
    """``scores[..., i]`` raised to the best of the ``span`` tokens after it, token by token."""
    n = scores.shape[-1]
    return torch.stack([scores[..., i : i + span + 1].amax(-1) for i in range(n)], dim=-1)


def few_queries_at_a_time(monkeypatch) -> None:
    """The whole-context scoring in blocks of a few queries, as at long contexts."""
    monkeypatch.setattr(reconstruction_attention, "ATTEND_ELEMENTS", 4096)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("normalise", ["chunk", "context", "context in blocks"])
def test_kvzip_scores_and_keep_set_match_eager_reconstruction(attn, normalise, monkeypatch):
    if normalise == "context in blocks":
        few_queries_at_a_time(monkeypatch)
        normalise = "context"
    model = make_model("llama", attn)
    ids = prompt(300)
    scorer = KVzip(ratio=0.6, chunk_size=128, normalise=normalise)
    expected = reference_reconstruction(model, ids, chunk=128, normalise=normalise)
    scores, cache = reconstruction_scores_of(model, ids, scorer)
    for got, reference in zip(scores, expected, strict=True):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-4)
    with kvpatch.enabled(model, scorer, tokenizer=byte_tokenizer(chat_template=False)):
        cache.compress_deferred()
    budget = 300 - math.floor(300 * 0.6)
    for idx, reference in enumerate(expected):
        reference = spread_back(reference, scorer.span_before)
        reference[:, :4] = math.inf  # sinks
        for head in range(reference.shape[0]):
            kept = cache.stats().layers[idx].kept_positions(0, head)
            assert kept.shape[0] == budget
            # the best: a spread score is shared by its neighbours, so ties are many
            evicted = torch.ones(300, dtype=torch.bool)
            evicted[kept] = False
            assert reference[head][kept].min() >= reference[head][evicted].max()


@pytest.mark.parametrize("normalise", ["chunk", "context", "context in blocks"])
def test_kvzip_plus_matches_a_head_by_head_reference(normalise, monkeypatch):
    if normalise == "context in blocks":
        few_queries_at_a_time(monkeypatch)
        normalise = "context"
    model = make_model("llama", "sdpa")
    ids = prompt(200)
    scorer = KVzipPlus(ratio=0.5, chunk_size=96, normalise=normalise)
    expected = reference_reconstruction(model, ids, chunk=96, normalise=normalise, weighted=True)
    scores, _ = reconstruction_scores_of(model, ids, scorer)
    for got, reference in zip(scores, expected, strict=True):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-4)
    plain, _ = reconstruction_scores_of(model, ids, KVzip(chunk_size=96, normalise=normalise))
    assert not torch.allclose(scores[0], plain[0])  # the weighting changes the scores


def test_repeat_prompt_follows_the_chat_template():
    declared = KVzip().reconstruction
    plain = Prompts(byte_tokenizer(chat_template=False), declared, "cpu", "kvzip")
    assert plain.first().tolist() == encode(REPEAT_PROMPT + "\n")
    tokenizer = byte_tokenizer()  # ChatML: a user turn ends, then the assistant's header
    assert _turn_end(tokenizer) == "<|im_end|>\n<|im_start|>assistant\n"
    end, start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    turn_end = [end, *encode("\n"), start, *encode("assistant\n")]
    chat = Prompts(tokenizer, declared, "cpu", "kvzip")
    assert chat.first().tolist() == encode(REPEAT_PROMPT) + turn_end
    before, after = chat.later()
    assert before.tolist() == encode(CONTINUE_PROMPT) and after.tolist() == turn_end


# -- every new policy under the masking oracle -------------------------------------------------

AGNOSTIC_POLICIES = [
    "kvzip:0.5",
    "ada-kvzip:0.6",
    "global-kvzip:0.5",
    "ada-span-kvzip:0.5",
    "think:0.5+kvzip:0.5",
    "think:0.25+global-kvzip:0.7",
    "expected-attention:0.5",
    "ada-expected-attention:0.6",
    "think:0.5+expected-attention:0.5",
    "keydiff:0.5",
    "ada-keydiff:0.6",
    "think:0.5+ada-keydiff:0.5",
    "global-snapkv:0.5",
]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", AGNOSTIC_POLICIES)
def test_agnostic_policy_matches_oracle(policy, attn):
    model = make_model("llama", attn)
    ids = prompt(300)
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = prefill_and_decode(model, ids, cache)
    evictions = evictions_of(cache)
    assert len(evictions) == model.config.num_hidden_layers
    assert all((~e.keep).any() for e in evictions.values())
    lengths = [n.flatten().tolist() for n in cache.physical_lengths()]
    if "ada-" in policy:
        assert any(len(set(n)) > 1 for n in lengths)
    if "global-" in policy:  # layers share one budget: their totals differ
        assert len({sum(n) for n in lengths}) > 1
    expected = oracle_logits(model, ids, evictions, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["kvzip:0.5", "global-kvzip:0.5", "expected-attention:0.5"])
def test_agnostic_policy_matches_oracle_on_gemma2(policy):
    """Sliding layers stay stock (and untouched by the reconstruction); soft-capped logits."""
    model = make_model("gemma2", "eager")
    ids = prompt(200)
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = prefill_and_decode(model, ids, cache)
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["kvzip:0.5", "think:0.5+global-kvzip:0.75", "ada-span-kvzip"])
def test_generate_reconstructs_the_prompt(policy):
    """generate() on an enabled model: all but the last prompt token are prefilled (and
    reconstructed for KVzip), compressed, then decoded; the oracle gives the same tokens."""
    model = make_model("llama")
    ids = prompt(250)
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        out = model.generate(
            ids,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            **{compat.cache_argument(model): cache},
        )
        without_cache = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, without_cache)
    evictions = evictions_of(cache)
    assert all((~e.keep).any() for e in evictions.values())
    # the oracle prefills all but the last prompt token, then is fed it and the answer
    fed = out[:, ids.shape[1] - 1 : -1]
    logits = oracle_logits(model, ids[:, :-1], evictions, fed)
    assert torch.equal(logits[1:].argmax(-1).T, out[:, ids.shape[1] :])


def prefilled_by_generate(policy: str, ids: torch.Tensor) -> int:
    """The prompt tokens ``generate`` compresses in its prefill: all of them, but under a
    reconstruction (KVzip), whose prefill leaves the last one to the first decode step."""
    return ids.shape[1] - (reconstruction_of(parse_policy(policy)) is not None)


@pytest.mark.parametrize(
    "policy",
    [
        "kvzip:0.75",
        "global-kvzip:0.75",
        "ada-kvzip:0.75",
        "think:0.5+kvzip-plus:0.75",
        "kvzap:0.75",
        "global-kvzap:0.75",
        "global-span-kvzap:0.75",
    ],
)
def test_generate_keeps_the_question_at_the_end_of_its_prompt(policy):
    """With the question in the prompt, every layer and head keeps the last ``prompt_window``
    tokens generate prefilled, within the same budget; the same tokens prefilled as a context
    for later questions (kvpatch.prefill) keep no such window and lose some of them."""
    model = make_model("llama")
    ids = prompt(300)
    window = parse_policy(policy).prompt_window
    assert window == 64
    name = compat.cache_argument(model)
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        # a second token: budgets shared across layers compress when the next step begins
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, **{name: cache})
        prefilled = prefilled_by_generate(policy, ids)
        context = kvpatch.prefill(model, ids[:, :prefilled])
    asked, alone = evictions_of(cache), evictions_of(context.cache)
    assert asked.keys() == alone.keys() and asked
    for index in asked:
        question = asked[index].keep[..., prefilled - window : prefilled]
        assert question.all(), f"layer {index} dropped some of the question's tokens"
    dropped = [(~e.keep[..., prefilled - window : prefilled]).sum() for e in alone.values()]
    assert sum(dropped) > 0
    kept = lambda evictions: sum(int(e.keep[..., :prefilled].sum()) for e in evictions.values())
    assert kept(asked) == kept(alone)  # the window is kept within the budget


@pytest.mark.parametrize("policy", ["kvzip:0.75", "global-kvzap:0.75"])
def test_a_prompt_window_of_zero_keeps_what_a_context_keeps(policy):
    model = make_model("llama")
    ids = prompt(300)
    name = compat.cache_argument(model)
    with kvpatch.enabled(
        model, f"{policy}/prompt_window=0", tokenizer=byte_tokenizer(chat_template=False)
    ):
        cache = CompressedDynamicCache(config=model.config)
        # a second token: budgets shared across layers compress when the next step begins
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, **{name: cache})
        prefilled = prefilled_by_generate(policy, ids)
        context = kvpatch.prefill(model, ids[:, :prefilled])
    asked, alone = evictions_of(cache), evictions_of(context.cache)
    assert asked.keys() == alone.keys() and asked
    for index in asked:
        assert torch.equal(asked[index].keep[..., :prefilled], alone[index].keep), index


@pytest.mark.parametrize("chunk_size", [None, 90], ids=["one-forward", "chunks"])
def test_a_cache_keeps_its_recent_tokens_in_one_forward_or_in_chunks(chunk_size):
    """``recent_tokens`` keeps the last tokens of the whole prefill, not of its first chunk, for
    any scorer, within the budget."""
    model = make_model("llama")
    ids = prompt(300)
    with kvpatch.enabled(model, "keydiff:0.75"):
        held = kvpatch.prefill(model, ids, chunk_size=chunk_size, recent_tokens=40).cache
        plain = kvpatch.prefill(model, ids, chunk_size=chunk_size).cache
    for index, eviction in evictions_of(held).items():
        assert eviction.keep[..., -40:].all(), index
    assert any(not e.keep[..., -40:].all() for e in evictions_of(plain).values())
    if chunk_size is not None:  # the first chunk's end is not the prefill's: not all kept
        assert any(not e.keep[..., 50:90].all() for e in evictions_of(held).values())
    assert [int(n.sum()) for n in held.physical_lengths() if n is not None] == [
        int(n.sum()) for n in plain.physical_lengths() if n is not None
    ]


@GENERATION_MODES
def test_generate_modes_with_kvzip_match_oracle(settings):
    """The prompt is reconstructed once, then the cache is expanded for beams or returned
    sequences; the oracle, prefilled the same way and expanded alike, picks the same tokens."""
    from oracle import ORACLE, _evictions

    model = make_model("llama")
    ids = prompt(200)
    name = compat.cache_argument(model)
    common = dict(max_new_tokens=6, pad_token_id=0, **settings)
    with kvpatch.enabled(model, "ada-kvzip:0.6", tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        torch.manual_seed(7)
        out = model.generate(ids, **common, **{name: cache})
    expand = max(settings.get("num_beams", 1), settings.get("num_return_sequences", 1))
    assert cache.physical_lengths()[0].shape[0] == expand
    implementation = compat.attention_implementation(model)
    _evictions.update(evictions_of(cache))  # rows are copies of one: the first row's stand
    for eviction in _evictions.values():
        eviction.keep = eviction.keep[:1]
    compat.set_attention_implementation(model, ORACLE)
    try:
        oracle_cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :-1], use_cache=True, **{name: oracle_cache})
        oracle_cache.batch_repeat_interleave(expand)
        torch.manual_seed(7)
        expected = model.generate(ids, **common, **{name: oracle_cache})
    finally:
        compat.set_attention_implementation(model, implementation)
        _evictions.clear()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("policy", ["global-snapkv:0.6", "think:0.5+global-expected-attention"])
def test_shared_budgets_compress_at_the_first_decoding_step(policy):
    """A plain forward leaves the layers waiting for the whole prefill; the next step compresses
    them all together, as the oracle says."""
    model = make_model("llama")
    ids = prompt(300)
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config)
        logits, tokens = greedy_logits(model, ids, cache, STEPS)
    assert not cache.deferred_layers
    evictions = evictions_of(cache)
    assert len({int(e.keep.sum()) for e in evictions.values()}) > 1
    expected = oracle_logits(model, ids, evictions, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["kvzip:0.5", "ada-kvzip:0.5", "expected-attention", "keydiff"])
def test_padded_rows_are_scored_on_their_own_tokens(policy):
    model = make_model("llama")
    prompts = [prompt(n, seed=i)[0] for i, n in enumerate([260, 190, 120])]
    ids, mask = left_padded(prompts)
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        batch = kvpatch.prefill(model, ids, mask)
        alone = [kvpatch.prefill(model, p[None]) for p in prompts]
        question = prompt(6, batch=3, seed=9)
        answers = batch.generate(question, max_new_tokens=5, do_sample=False, pad_token_id=0)
        for row, (p, context) in enumerate(zip(prompts, alone, strict=True)):
            pad = ids.shape[1] - p.shape[0]
            both = zip(batch.cache.stats().layers, context.cache.stats().layers, strict=True)
            for layer, single in both:
                for head in range(model.config.num_key_value_heads):
                    kept = layer.kept_positions(row, head)
                    kept = kept[kept < ids.shape[1]] - pad
                    assert torch.equal(kept, single.kept_positions(0, head)[: kept.shape[0]])
            single_answer = context.generate(
                question[row : row + 1], max_new_tokens=5, do_sample=False, pad_token_id=0
            )
            assert torch.equal(answers[row], single_answer[0])


def test_global_budgets_keep_the_uniform_total():
    model = make_model("llama")
    ids = prompt(400)
    sizes = {}
    with kvpatch.enabled(model, tokenizer=byte_tokenizer(chat_template=False)):
        for policy in ("kvzip:0.75", "global-kvzip:0.75", "global-snapkv:0.75"):
            cache = kvpatch.prefill(model, ids, policy=policy).cache
            lengths = cache.physical_lengths()
            sizes[policy] = cache.nbytes()
            assert sum(int(n.sum()) for n in lengths) == 2 * 2 * (400 - 300)
    full = sizes["kvzip:0.75"]
    assert sizes["global-kvzip:0.75"] == pytest.approx(full, rel=0.02)


# -- expected attention and KeyDiff against plain-torch references -----------------------------


def rotation(position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """The RoPE matrix of a position (rotate-half layout: channel i pairs with i + d/2)."""
    half = inv_freq.shape[0]
    r = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    for i, f in enumerate(inv_freq.double().tolist()):
        c, s = math.cos(position * f), math.sin(position * f)
        r[i, i], r[i, i + half], r[i + half, i], r[i + half, i + half] = c, -s, s, c
    return r


def test_expected_attention_matches_reference():
    from transformers import LlamaConfig

    t, hq, hkv, d, future = 40, 4, 2, 16, 32
    config = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, head_dim=d)
    rope = LlamaRotaryEmbedding(config=config)
    inv_freq = rope.inv_freq

    def rotary(positions):
        cos, sin = rope(torch.zeros(1), positions[None])
        return cos[0], sin[0]

    gen = seeded(0)
    pre = torch.randn(1, hq, t, d, generator=gen)
    queries = torch.stack(
        [
            torch.stack([rotation(p, inv_freq).float() @ pre[0, h, p] for p in range(t)])
            for h in range(hq)
        ]
    )[None]
    keys, values = (
        torch.randn(1, hkv, t, d, generator=gen),
        torch.randn(1, hkv, t, d, generator=gen),
    )
    inputs = LayerInputs(
        queries, keys, values, torch.ones(1, t, dtype=torch.bool), scaling=d**-0.5, rotary=rotary
    )
    scores = ExpectedAttention(future_positions=future, n_sink=4).rule_scores(inputs)

    mean_rotation = sum(rotation(p, inv_freq) for p in range(t, t + future)) / future
    reference = torch.zeros(hkv, t, dtype=torch.float64)
    for h in range(hq):
        sample = pre[0, h, 4:].double()  # the sinks' queries are left out
        mu = mean_rotation @ sample.mean(0)
        centred = sample - sample.mean(0)
        sigma = mean_rotation @ (centred.T @ centred / sample.shape[0]) @ mean_rotation.T
        k = keys[0, h // 2].double()
        logits = torch.stack([kj @ mu * d**-0.5 + 0.5 * kj @ sigma @ kj / d for kj in k])
        reference[h // 2] += torch.softmax(logits, 0) / 2
    reference *= values[0].double().norm(dim=-1)
    reference[:, :4] = math.inf
    torch.testing.assert_close(scores[0].double(), reference, atol=1e-6, rtol=1e-4)


def test_keydiff_matches_reference():
    gen = seeded(0)
    keys = torch.randn(2, 2, 30, 8, generator=gen)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :6] = False  # padding enters no anchor
    inputs = LayerInputs(torch.randn(2, 4, 30, 8), keys, keys, valid, scaling=1.0)
    scores = KeyDiff().score(inputs)
    for b in range(2):
        real = valid[b].nonzero().flatten()
        for h in range(2):
            k = keys[b, h, real].double()
            anchor = (k / k.norm(dim=-1, keepdim=True)).mean(0)
            expected = -(k @ anchor) / (k.norm(dim=-1) * anchor.norm())
            torch.testing.assert_close(scores[b, h, real].double(), expected, atol=1e-6, rtol=0)


def test_keydiff_with_a_window_keeps_each_rows_newest_tokens_and_ranks_the_rest_alike():
    """``window=w`` protects the last ``w`` real tokens of every row (left padding included) and
    leaves the other tokens' scores, hence their order, those of the published KeyDiff."""
    gen = seeded(2)
    keys = torch.randn(2, 2, 30, 8, generator=gen)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :6] = False
    inputs = LayerInputs(torch.randn(2, 4, 30, 8), keys, keys, valid, scaling=1.0)
    plain, windowed = KeyDiff().score(inputs), KeyDiff(window=5).score(inputs)
    assert torch.isinf(windowed[..., -5:]).all()
    torch.testing.assert_close(windowed[..., :-5], plain[..., :-5])
    keep = KeyDiff(ratio=0.8, window=5).plan(inputs).keep  # a budget of 6 (row 0) or 5 tokens
    assert keep[..., -5:].all()
    with pytest.raises(ValueError, match="window"):
        KeyDiff(window=-1)


# -- what cannot work says so ------------------------------------------------------------------


def test_kvzip_cannot_compress_while_decoding():
    with pytest.raises(ValueError, match="cannot compress while decoding"):
        CompressedDynamicCache(policy="kvzip", decode_budget=64)
    with pytest.raises(ValueError, match="cannot compress while decoding"):
        CompressedDynamicCache(policy="think+ada-kvzip", decode_budget=64)
    x = LayerInputs(*(torch.randn(1, 2, 10, 4) for _ in range(3)), torch.ones(1, 10).bool(), 1.0)
    with pytest.raises(ValueError, match="reconstruction"):
        KVzip().score(x)


def test_kvzip_needs_its_reconstruction():
    model = make_model("llama")
    ids = prompt(100)
    with kvpatch.enabled(model, "kvzip", tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache(config=model.config)
        with pytest.raises(ValueError, match=r"kvpatch\.prefill"):
            greedy_logits(model, ids, cache, steps=1)


def test_kvzip_without_a_tokenizer_says_what_to_pass():
    model = make_model("llama")
    with kvpatch.enabled(model, "kvzip"), pytest.raises(ValueError, match="tokenizer="):
        kvpatch.prefill(model, prompt(50))


@pytest.mark.parametrize("spec", ["kvzip:1.0", "keydiff:-0.1", "expected-attention:nan"])
def test_new_policies_reject_bad_ratios(spec):
    with pytest.raises(ValueError, match="ratio"):
        parse_policy(spec)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (KVzip, {"chunk_size": 0}),
        (KVzip, {"n_sink": -1}),
        (ExpectedAttention, {"future_positions": 0}),
    ],
)
def test_new_policies_reject_bad_parameters(cls, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        cls(**kwargs)


def test_keydiff_is_question_agnostic():
    """KeyDiff reads no query: any queries give the same plan."""
    gen = seeded(1)
    k = torch.randn(1, 2, 50, 8, generator=gen)
    plans = [
        KeyDiff(ratio=0.5).plan(
            LayerInputs(torch.randn(1, 4, n, 8), k, k, torch.ones(1, 50).bool(), 1.0)
        )
        for n in (1, 50)
    ]
    assert torch.equal(plans[0].keep, plans[1].keep)


# -- a conversation compressed turn by turn ----------------------------------------------------


def oracle_turns(model, ids, turns, steps_from, evictions, tokens):
    """The masked full-cache model fed ``ids`` in the chunks ``turns`` (end positions), each chunk
    seeing the evictions in force when it was appended (``evictions[i]`` for chunk ``i + 1``),
    then ``tokens`` one at a time with the last evictions. Returns the logits after the last
    chunk and after each fed token."""
    from oracle import ORACLE, _evictions, _schedule

    implementation = compat.attention_implementation(model)
    cache = DynamicCache(config=model.config)
    name = compat.cache_argument(model)
    logits = []
    compat.set_attention_implementation(model, ORACLE)
    try:
        with torch.no_grad():
            start = 0
            for index, end in enumerate(turns):
                _schedule.clear()
                if index:
                    _schedule[end] = evictions[index - 1]
                out = model(ids[:, start:end], use_cache=True, **{name: cache})
                start = end
            logits.append(out.logits[:, -1].float())
            _schedule.clear()
            _evictions.clear()
            _evictions.update(evictions[-1])
            for step in range(tokens.shape[1]):
                out = model(tokens[:, step : step + 1], use_cache=True, **{name: cache})
                logits.append(out.logits[:, -1].float())
    finally:
        compat.set_attention_implementation(model, implementation)
        _evictions.clear()
        _schedule.clear()
    return torch.stack(logits)


@pytest.mark.parametrize(
    "policy",
    [
        "snapkv:0.5",
        "kvzip:0.5",
        "ada-kvzip:0.6",
        "think:0.5+global-kvzip:0.5",
        "expected-attention",
    ],
)
def test_extend_compresses_each_turn_as_the_oracle_says(policy):
    model = make_model("llama")
    ids = prompt(420)
    turns = [250, 350, 420]  # the context, a second turn, the question
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        context = kvpatch.prefill(model, ids[:, : turns[0]])
        before = evictions_of(context.cache)
        extended = context.extend(ids[:, turns[0] : turns[1]])
        assert context.cache.get_seq_length() == turns[0]  # the original is untouched
        after = evictions_of(extended.cache)
        cache = extended.copy_cache()
        name = compat.cache_argument(model)
        with torch.no_grad():
            out = model(ids[:, turns[1] :], use_cache=True, **{name: cache})
            logits = [out.logits[:, -1].float()]
            fed = []
            for _ in range(STEPS):
                fed.append(logits[-1].argmax(-1, keepdim=True))
                logits.append(model(fed[-1], use_cache=True, **{name: cache}).logits[:, -1])
    tokens = torch.cat(fed, 1)
    # each turn kept (1 - ratio) of itself (at least the protected tokens), so the history held
    # is (1 - ratio) of all; a channel policy's full-width window is compressed with the next turn
    parsed = parse_policy(policy)
    token_policy = getattr(parsed, "tokens", parsed)
    ratio, protected = token_policy.ratio, parsed.protected_tokens
    budget = lambda n, protected: max(n - math.floor(n * ratio), protected)
    window = turns[0] - min(e.full_width_from for e in before.values())
    # a turn keeps no sinks of its own: they lead the whole conversation
    turn_protected = max(protected - token_policy.n_sink, window)
    per_head = budget(turns[0], protected) - window
    per_head += budget(window + turns[1] - turns[0], turn_protected)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    held = sum(int(n.sum()) for n in extended.cache.physical_lengths())
    if "global-" in policy or "ada-" in policy:
        assert held == layers * heads * per_head
    else:
        assert all((n == per_head).all() for n in extended.cache.physical_lengths())
    for layer in after.values():
        assert (~layer.keep[..., turns[0] : layer.full_width_from]).any()  # the turn lost tokens
    expected = oracle_turns(model, ids, turns, STEPS, [before, after], tokens)
    torch.testing.assert_close(torch.stack(logits).float(), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        ("kvzip:0.75", 0.25),
        ("ada-kvzip:0.75", 0.25),
        ("global-kvzip:0.75", 0.25),
        ("think:0.5+global-kvzip:0.5", 0.375),
        ("expected-attention:0.75", 0.25),
        ("think:0.5+ada-keydiff:0.5", 0.375),
    ],
)
def test_agnostic_bytes_after_prefill(policy, kept, dtype):
    """After ``kvpatch.prefill`` of 1,024 tokens, every tensor held counts, (1 - r) of full."""
    from helpers import PROMPT, SLACK, held_bytes

    model = make_model("llama").to(dtype)
    ids = prompt(PROMPT)
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{compat.cache_argument(model): full})
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        cache = kvpatch.prefill(model, ids).cache
    held, full_bytes = held_bytes(cache.layers), held_bytes(full.layers)
    assert cache.nbytes() == held, "nbytes() must count every tensor the cache holds"
    assert kept - SLACK <= held / full_bytes <= kept + SLACK, f"{held / full_bytes:.4f}"


def test_generate_reconstructs_into_a_cache_built_without_config():
    """A cache made without the model's config has no layers yet (it is falsy): still filled."""
    model = make_model("llama")
    ids = prompt(120)
    with kvpatch.enabled(model, "kvzip:0.5", tokenizer=byte_tokenizer(chat_template=False)):
        cache = CompressedDynamicCache()
        model.generate(
            ids,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            **{compat.cache_argument(model): cache},
        )
    heads = model.config.num_key_value_heads
    # 119 prompt tokens compressed to 60 per head, raised to the 4 sinks and the prompt's last 64
    # tokens, then the last prompt token and 2 generated
    assert [int(n.sum()) for n in cache.physical_lengths()] == [heads * (4 + 64 + 3)] * 2
