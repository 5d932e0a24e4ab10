"""Many questions about one compressed context, answered in one batch: the same answers as each
question alone and as the oracle, with the context stored once."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from oracle import ORACLE, _evictions, evictions_of
from transformers import DynamicCache

import kvpatch
from kvpatch import compat
from kvpatch.attention import packed as packed_attention
from kvpatch.cache.buffer import CHUNK
from kvpatch.cache.shared_context import SharedContextStore, share_context

POLICIES = [
    "snapkv:0.5",  # uniform heads, stored dense
    "ada-snapkv:0.6",  # variable-length heads
    "think:0.5+snapkv:0.5",  # pruned key channels, a full-width window in the context's tail
    "think-v:0.5+ada-knorm:0.5",  # pruned value channels, variable-length heads
    "think-v:0.5+snapkv:0.5",  # pruned value channels, uniform heads
    "snapkv:0",  # nothing evicted
]
LENGTHS = (3, 9, 1, 14)  # questions of different lengths: the batch pads them


def questions(lengths=LENGTHS, seed: int = 11) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (n,), generator=generator) for n in lengths]


class Collected:
    """A streamer that keeps what it is given (transformers streams one batch row only)."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value)

    def end(self):
        pass


def answer_alone_and_together(policy: str, **generate_kwargs):
    model = make_model("llama")
    asked = questions()
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, **generate_kwargs)
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, prompt(300))
        alone = [context.generate(q, **options) for q in asked]
        together = context.generate_many(asked, **options)
    return model, context, alone, together


@pytest.mark.parametrize("policy", POLICIES)
def test_each_answer_equals_the_question_alone(policy):
    _, _, alone, together = answer_alone_and_together(policy)
    assert len(together) == len(alone)
    for one, batched in zip(alone, together, strict=True):
        assert torch.equal(one, batched)


@pytest.mark.parametrize("policy", ["ada-snapkv:0.6", "think:0.5+snapkv:0.5"])
def test_the_batch_matches_the_oracle(policy):
    """The oracle masks the context's evictions in a full cache, repeats it per question and
    generates the same padded batch with stock transformers."""
    model = make_model("llama")
    context_ids, asked = prompt(300), questions()
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, context_ids)
        together = context.generate_many(asked, **options)
        ids, mask = context._question_batch(asked, pad_id=0)
    name = compat.cache_argument(model)
    implementation = compat.attention_implementation(model)
    _evictions.update(evictions_of(context.cache))
    model.set_attn_implementation(ORACLE)
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(context_ids, use_cache=True, **{name: cache})
        cache.batch_repeat_interleave(len(asked))
        output = model.generate(ids, attention_mask=mask, **options, **{name: cache})
    finally:
        model.set_attn_implementation(implementation)
        _evictions.clear()
    for row, answer in enumerate(together):
        assert torch.equal(answer[0], output[row, ids.shape[1] :])


@pytest.mark.parametrize("policy", POLICIES)
def test_logits_of_a_shared_context_equal_a_copy_per_question(policy):
    """One teacher-forced forward of the padded questions on the shared cache gives each row the
    logits of its question on a copy of the context."""
    model = make_model("llama")
    asked = questions()
    with kvpatch.enabled(model, policy), torch.no_grad():
        context = kvpatch.prefill(model, prompt(300))
        ids, mask = context._question_batch(asked, pad_id=0)
        shared = share_context(context.cache, len(asked))
        name = compat.cache_argument(model)
        n = context.input_ids.shape[1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, n:]  # as generate counts them
        batch = model(ids[:, n:], attention_mask=mask, position_ids=positions, **{name: shared})
        batch = batch.logits[:, -1]
        for row, question in enumerate(asked):
            ids_alone = question[None]
            mask_alone = torch.ones(1, n + len(question), dtype=torch.long)
            cache = context.copy_cache()
            alone = model(ids_alone, attention_mask=mask_alone, **{name: cache}).logits[:, -1]
            torch.testing.assert_close(batch[row], alone[0], atol=2e-5, rtol=0)


def test_the_context_is_stored_once_and_left_unchanged(attend_calls):
    model = make_model("llama")
    asked = questions()
    with kvpatch.enabled(model, "ada-snapkv:0.6"), torch.no_grad():
        context = kvpatch.prefill(model, prompt(300))
        before = context.cache.stats()
        shared = share_context(context.cache, len(asked))
        own_layers = context.cache.compressed_layers
        for layer, own in zip(shared.compressed_layers, own_layers, strict=True):
            assert isinstance(layer.store, SharedContextStore)
            assert layer.store.context is own.store  # the same tensors, not a copy
        ids, mask = context._question_batch(asked, pad_id=0)
        n = context.input_ids.shape[1]
        model(ids[:, n:], attention_mask=mask, **{compat.cache_argument(model): shared})
        assert attend_calls  # each KV head's context read in place, for every row's queries
        held = shared.stats()
        tails = sum(
            layer.store.keys.data.nbytes + layer.store.values.data.nbytes
            for layer in shared.compressed_layers
        )
        assert held.kv_nbytes == before.kv_nbytes + tails
        for layer in shared.compressed_layers:  # each tail: its row's tokens, little spare room
            assert layer.store.keys.data.shape[2] <= layer.store.tail_length + CHUNK
        after = context.cache.stats()
    assert after.nbytes == before.nbytes
    for old, new in zip(before.layers, after.layers, strict=True):
        assert old.seen == new.seen and torch.equal(old.kept, new.kept)


@pytest.mark.parametrize("attn", ["eager", "padded"])
def test_backends_reading_a_padded_copy_answer_alike(monkeypatch, attn):
    if attn == "padded":
        monkeypatch.setattr(packed_attention, "DEVICES", ())  # as on another accelerator
    model = make_model("llama", attn="eager" if attn == "eager" else "sdpa")
    asked = questions()
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.6"):
        context = kvpatch.prefill(model, prompt(300))
        alone = [context.generate(q, **options) for q in asked]
        together = context.generate_many(asked, **options)
    for one, batched in zip(alone, together, strict=True):
        assert torch.equal(one, batched)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantized_context_answers_alike(quantize):
    model = make_model("llama")
    asked = questions()
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        context = kvpatch.prefill(model, prompt(300), quantize=quantize)
        alone = [context.generate(q, **options) for q in asked]
        together = context.generate_many(asked, **options)
    for one, batched in zip(alone, together, strict=True):
        assert torch.equal(one, batched)


def test_beams_and_returned_sequences_per_question():
    _, _, alone, together = answer_alone_and_together(
        "ada-snapkv:0.6", num_beams=3, num_return_sequences=2
    )
    for one, batched in zip(alone, together, strict=True):
        assert batched.shape[0] == 2
        assert torch.equal(one, batched)


def test_sampling_is_reproducible_per_seed():
    model = make_model("llama")
    asked = questions()
    options = dict(max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        context = kvpatch.prefill(model, prompt(300))
        runs = []
        for _ in range(2):
            torch.manual_seed(5)
            runs.append(context.generate_many(asked, **options))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_answers_stop_where_the_question_alone_stops():
    """A question whose answer ends early is cut after its end token, as generate alone stops
    there; the others run on."""
    model = make_model("llama")
    asked = questions()
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        context = kvpatch.prefill(model, prompt(300))
        first = context.generate(asked[0], **options)
        end = int(first[0, 2])  # the third token of the first answer ends it
        options["eos_token_id"] = end
        alone = [context.generate(q, **options) for q in asked]
        together = context.generate_many(asked, **options)
    assert alone[0].shape[-1] == 3
    for one, batched in zip(alone, together, strict=True):
        assert torch.equal(one, batched)


@pytest.mark.parametrize(
    "settings",
    [
        dict(output_attentions=True, return_dict_in_generate=True),  # the padded view's weights
        # assisted: one question after another (4.56's prompt lookup needs an end token)
        dict(prompt_lookup_num_tokens=3, eos_token_id=127),
        dict(streamer=Collected()),  # streamed: one question after another
    ],
)
def test_other_generate_settings_answer_alike(settings):
    _, _, alone, together = answer_alone_and_together("think:0.5+ada-snapkv:0.6", **settings)
    for one, batched in zip(alone, together, strict=True):
        assert torch.equal(one, batched)


def test_a_decode_budget_answers_one_question_after_another():
    model = make_model("llama")
    asked = questions(lengths=(4, 7))
    options = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model, "snapkv:0.5"):
        context = kvpatch.prefill(model, prompt(300), decode_budget=100, decode_interval=8)
        alone = [context.generate(q, **options) for q in asked]
        together = context.generate_many(asked, **options)
    for one, batched in zip(alone, together, strict=True):
        assert torch.equal(one, batched)


def test_bad_questions_are_named():
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.5"):
        context = kvpatch.prefill(model, prompt(100))
        assert context.generate_many([]) == []
        with pytest.raises(ValueError, match="question 1 is empty"):
            context.generate_many([prompt(3)[0], prompt(0)[0]])
        with pytest.raises(ValueError, match="question 0 must be the token ids of one question"):
            context.generate_many([prompt(3, batch=2)])
        with pytest.raises(TypeError, match=r"question 0 must be a torch\.Tensor"):
            context.generate_many(["What?"])
        two_rows = kvpatch.prefill(model, prompt(100, batch=2))
        with pytest.raises(ValueError, match="context of one batch row; this one has 2"):
            two_rows.generate_many([prompt(3)[0]])
