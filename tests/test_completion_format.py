"""The eval harness's completion prompt format (base models): plain text, the question last and
ending in the start of the answer, chosen when the tokenizer has no chat template."""

from __future__ import annotations

import random

import pytest
import torch

import kvpatch
from kvpatch.tools.eval import answering as answer_module
from kvpatch.tools.eval import cli as eval_cli
from kvpatch.tools.eval.codecs import PROMPT_FORMATS, ByteCodec, HFCodec
from kvpatch.tools.eval.config import EvalConfig, load_model
from kvpatch.tools.eval.run import run_eval
from kvpatch.tools.eval.tasks import INSTRUCTION, TASKS, make_context, make_sample
from kvpatch.tools.testing import SPECIAL_TOKENS, byte_tokenizer, tiny_model


def plain_tokenizer():
    """The byte tokenizer without its chat template (adds no BOS)."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def decode(codec, ids) -> str:
    return codec.tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def test_the_format_follows_the_chat_template_unless_asked():
    assert HFCodec(byte_tokenizer()).prompt_format == "chat"
    assert HFCodec(plain_tokenizer()).prompt_format == "completion"
    assert HFCodec(byte_tokenizer(), "completion").prompt_format == "completion"
    assert ByteCodec().prompt_format == "completion"
    with pytest.raises(ValueError, match=r"no chat template.*'completion'"):
        HFCodec(plain_tokenizer(), "chat")
    with pytest.raises(ValueError, match="prompt formats: chat, completion"):
        HFCodec(byte_tokenizer(), "base")
    with pytest.raises(ValueError, match="prompt formats: chat, completion"):
        EvalConfig(prompt_format="instruct")
    assert PROMPT_FORMATS == ("chat", "completion")


@pytest.mark.parametrize("tokenizer", [plain_tokenizer, byte_tokenizer], ids=["plain", "chat"])
def test_a_completion_prompt_is_the_text_then_the_question_and_the_answers_start(tokenizer):
    """Forced on a tokenizer with a chat template too: no turn markers anywhere."""
    codec = HFCodec(tokenizer(), "completion")
    sample = make_sample("single", codec, 300, random.Random(0))
    context, question = decode(codec, sample.context_ids), decode(codec, sample.question_ids)
    key = question.split("special magic number for ")[1].split(" ")[0]
    assert context.startswith(INSTRUCTION)
    assert f"One of the special magic numbers for {key} is: {sample.answers[0]}." in context
    assert question == (
        f"\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"Answer with the number only.\nThe special magic number for {key} is:"
    )
    assert not any(marker in context + question for marker in SPECIAL_TOKENS)


def test_the_chat_format_wraps_the_same_prompt_in_turns():
    codec = HFCodec(byte_tokenizer())
    sample = make_sample("single", codec, 300, random.Random(0))
    context, question = decode(codec, sample.context_ids), decode(codec, sample.question_ids)
    assert context.startswith("<|im_start|>user\n" + INSTRUCTION)
    assert "<|im_end|>\n<|im_start|>assistant\nThe special magic number for" in question


@pytest.mark.parametrize("task", TASKS)
def test_every_task_has_a_completion_prompt(task):
    codec = HFCodec(byte_tokenizer(), "completion")
    samples = make_context(task, codec, 400, random.Random(1), questions=3)
    for sample in samples:
        text = decode(codec, sample.input_ids)
        assert not any(marker in text for marker in SPECIAL_TOKENS)
        assert text.rstrip().endswith(("is:", "are:"))
        for answer, span in zip(sample.answers, sample.needle_spans, strict=True):
            assert decode(codec, sample.input_ids[span]).strip() == answer
    if task == "chat":  # plain turns: the question is the last user turn, then the answer's start
        assert "\nUser: What is the special magic number" in text
        assert "Assistant: The special magic number for" in text


def test_agnostic_mode_compresses_the_context_then_appends_the_question(monkeypatch):
    """The context alone goes through kvpatch.prefill; the question, ending in the completion
    prefix, is fed on top of the compressed cache."""
    codec = ByteCodec()
    model = tiny_model(max_position_embeddings=1024)
    sample = make_sample("single", codec, 200, random.Random(2), digits=3)
    prefilled, finished = [], []
    real_prefill, real_finish = kvpatch.prefill, answer_module._finish

    def prefill(model, ids, **kwargs):
        prefilled.append(ids)
        return real_prefill(model, ids, **kwargs)

    monkeypatch.setattr(kvpatch, "prefill", prefill)

    def finish(model, ids, split, *args):
        finished.append((ids, split))
        return real_finish(model, ids, split, *args)

    monkeypatch.setattr(answer_module, "_finish", finish)
    with kvpatch.enabled(model):
        answer_module.answer(model, sample, "snapkv:0.5", "agnostic", 4)
    assert torch.equal(prefilled[0][0], sample.context_ids)
    ids, split = finished[0]
    assert torch.equal(ids[0, split:], sample.question_ids)
    question = codec.decode(ids[0, split:].tolist())
    assert "\nThe special magic number for " in question and question.endswith(" is:")
    assert "What is the special magic number" not in codec.decode(prefilled[0][0].tolist())


def test_run_eval_records_the_format_it_used(tmp_path):
    config = EvalConfig(
        policies=["knorm"],
        ratios=[0.5],
        samples=1,
        context_tokens=120,
        digits=3,
        model="tiny",
        output=str(tmp_path),
        plot=False,
        progress=False,
        modes=["agnostic"],
    )
    result = run_eval(config)
    assert result["config"]["prompt_format"] == "completion"
    with pytest.raises(ValueError, match="tiny model has no chat template"):
        load_model("tiny", prompt_format="chat")


def test_the_flag(tmp_path, capsys):
    argv = ["--model", "tiny", "--samples", "1", "--ratios", "0.5", "--policies", "knorm"]
    argv += ["--context-tokens", "100", "--digits", "3", "--no-plot", "--no-progress"]
    assert eval_cli.main([*argv, "--output", str(tmp_path), "--prompt-format", "chat"]) == 1
    assert "no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_cli.parser().parse_args(["--prompt-format", "instruct"])
    assert "invalid choice: 'instruct' (choose from" in capsys.readouterr().err
    assert eval_cli.main([*argv, "--output", str(tmp_path), "--prompt-format", "completion"]) == 0
