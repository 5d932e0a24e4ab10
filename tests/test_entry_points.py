"""Where users meet kvpatch: pipelines and streaming, on a tiny checkpoint with a real (byte-level,
chat-templated) tokenizer saved to disk."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import unpatched_chat_reply
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)

import kvpatch
from kvpatch import DEFAULT_POLICY
from kvpatch.tools.testing import save_tiny_checkpoint

CONTEXT = "The report says the code word is 'amber lake'. " + "Nothing else happens here. " * 12
QUESTIONS = ["What is the code word?", "What happens here?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture
def loaded(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return model, AutoTokenizer.from_pretrained(checkpoint)


def full_cache_answer(model, tokenizer, question: str, new_tokens: int) -> str:
    """The unpatched model on the whole chat-templated prompt: context and question together."""
    messages = [{"role": "user", "content": CONTEXT + "\n\n" + question}]
    return unpatched_chat_reply(model, tokenizer, messages, new_tokens)


def test_pipeline_at_ratio_zero_answers_as_the_full_model(loaded):
    """The context is prefilled once in the template's user turn and each question appended:
    at ratio 0 every answer is the unpatched model's on the whole prompt."""
    model, tokenizer = loaded
    expected = [full_cache_answer(model, tokenizer, q, 8) for q in QUESTIONS]
    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer, policy="snapkv:0")
    answers = ask(context=CONTEXT, questions=QUESTIONS, max_new_tokens=8)
    assert [a["generated_text"] for a in answers] == expected
    assert [a["question"] for a in answers] == QUESTIONS
    assert not kvpatch.is_enabled(model), "a model the pipeline enabled is disabled after"


def test_pipeline_reports_the_compressed_bytes(loaded):
    model, tokenizer = loaded
    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer)
    with kvpatch.enabled(model, "knorm:0.75"):
        one = ask(context=CONTEXT, question=QUESTIONS[0], max_new_tokens=4)
        assert kvpatch.is_enabled(model), "an enabled model stays enabled"
        other = ask(context=CONTEXT, question=QUESTIONS[0], max_new_tokens=4, policy="knorm:0.5")
    assert one["kv_bytes"] < 0.27 * one["uncompressed_kv_bytes"]
    assert one["ratio"] == pytest.approx(1 - one["kv_bytes"] / one["uncompressed_kv_bytes"])
    assert other["kv_bytes"] == pytest.approx(0.5 * other["uncompressed_kv_bytes"], rel=0.05)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda ask: ask(context=CONTEXT), "question= or questions="),
        (lambda ask: ask(context=CONTEXT, question="a", questions=["b"]), "one of them"),
        (lambda ask: ask(context="", question="a"), "non-empty text"),
        (lambda ask: ask(context=CONTEXT, questions=[]), "non-empty strings"),
        (lambda ask: ask(context=CONTEXT, question="a", policy="snapvk"), "Did you mean"),
    ],
    ids=["no-question", "both", "no-context", "empty-questions", "bad-policy"],
)
def test_pipeline_rejects_bad_calls(loaded, call, error):
    model, tokenizer = loaded
    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=error):
        call(ask)


def test_the_pipeline_without_a_policy_compresses_with_the_default_one(loaded):
    """Given no policy and a model not enabled, the pipeline uses kvpatch.DEFAULT_POLICY (the
    commands' default) for that call: the same answers and bytes as naming it."""
    model, tokenizer = loaded
    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer)
    plain = ask(context=CONTEXT, question=QUESTIONS[0], max_new_tokens=4)
    named = ask(context=CONTEXT, question=QUESTIONS[0], max_new_tokens=4, policy=DEFAULT_POLICY)
    assert not kvpatch.is_enabled(model)
    assert plain == named
    assert plain["kv_bytes"] < 0.6 * plain["uncompressed_kv_bytes"]  # keydiff:0.5


def test_text_generation_pipeline_compresses(loaded):
    """transformers' own text-generation pipeline on an enabled model runs on a compressed cache
    and returns what generate returns."""
    model, tokenizer = loaded
    caches = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(
            type(kwargs.get("past_key_values") or kwargs.get("cache"))
        ),
        with_kwargs=True,
    )
    prompt_text = CONTEXT + QUESTIONS[0]
    with kvpatch.enabled(model, "snapkv:0.5"):
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        out = generator(prompt_text, max_new_tokens=6, do_sample=False, return_full_text=False)
        ids = tokenizer(prompt_text, return_tensors="pt").input_ids
        direct = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    hook.remove()
    assert caches and all(c is kvpatch.CompressedDynamicCache for c in caches)
    expected = tokenizer.decode(direct[0, ids.shape[1] :], skip_special_tokens=True)
    assert out[0]["generated_text"] == expected


def test_streamers_see_the_compressed_generation(loaded):
    """TextStreamer and TextIteratorStreamer print what the compressed generate returns."""
    model, tokenizer = loaded
    ids = tokenizer(CONTEXT, return_tensors="pt").input_ids
    options = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        printed = []
        streamer = TextStreamer(tokenizer, skip_prompt=True)
        streamer.on_finalized_text = lambda text, stream_end=False: printed.append(text)
        out = model.generate(ids, streamer=streamer, **options)
        expected = tokenizer.decode(out[0, ids.shape[1] :])
        assert "".join(printed) == expected

        iterator = TextIteratorStreamer(tokenizer, skip_prompt=True)
        worker = threading.Thread(
            target=model.generate, args=(ids,), kwargs=dict(streamer=iterator, **options)
        )
        worker.start()
        assert "".join(iterator) == expected
        worker.join()
