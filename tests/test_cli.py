"""The ``kvpatch`` command: generate, chat (driven through stdin), eval and bench, on a tiny
checkpoint with a byte-level chat tokenizer saved to disk."""

from __future__ import annotations

import io
import re
from importlib.metadata import entry_points

import pytest
import torch
from conftest import unpatched_chat_reply
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpatch.tools import cli
from kvpatch.tools.terminal import TimedStream, prefill_bar
from kvpatch.tools.testing import save_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-cli")))


def unpatched_reply(checkpoint, messages, new_tokens) -> str:
    """The unpatched model's greedy reply to ``messages`` (the whole conversation at once)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return unpatched_chat_reply(model, tokenizer, messages, new_tokens)


def test_generate_streams_the_answer_and_reports_the_cache(checkpoint, capsys):
    """At ratio 0 the streamed text is the unpatched model's answer; stderr tells the bytes."""
    argv = ["generate", "Where is the key?", "--model", checkpoint, "--policy", "snapkv:0"]
    assert cli.main([*argv, "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    expected = unpatched_reply(checkpoint, [{"role": "user", "content": "Where is the key?"}], 12)
    assert out.rstrip("\n") == expected
    assert "KV cache:" in err and "MiB uncompressed" in err and "tokens/s" in err


def test_generate_continues_the_prompt_of_a_model_without_a_chat_template(tmp_path, capsys):
    """A base model gets the prompt as written (completion), not a made-up chat frame."""
    chat = save_tiny_checkpoint(tmp_path / "chat")
    model = AutoModelForCausalLM.from_pretrained(chat).eval()
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = None
    path = tmp_path / "base"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert not AutoTokenizer.from_pretrained(path).chat_template
    prompt = "The key is under the"
    assert (
        cli.main(
            [
                "generate",
                prompt,
                "--model",
                str(path),
                "--policy",
                "snapkv:0",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_generate_from_a_file_in_chunks(checkpoint, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a long document. " * 40)
    argv = ["generate", "--prompt-file", str(prompt), "--model", checkpoint]
    argv += ["--policy", "knorm:0.5", "--prefill-chunk", "128", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    saved = float(re.search(r"\(([-\d.]+)% saved\)", err).group(1))
    assert 40 < saved < 55  # about half of the cache


DOCUMENT = "The key is under the blue mat. The boat leaves at noon."


def test_compress_once_then_ask_in_another_command(checkpoint, tmp_path, capsys):
    """At ratio 0 each answer from the saved file is the unpatched model's answer to the document
    and the question in one user turn; ``ask`` finds the model in the file."""
    document, saved = tmp_path / "doc.txt", tmp_path / "doc.kvz"
    document.write_text(DOCUMENT)
    argv = ["compress", str(document), "--out", str(saved), "--model", checkpoint]
    assert cli.main([*argv, "--policy", "snapkv:0"]) == 0
    assert "wrote" in capsys.readouterr().err and saved.exists()
    questions = ["Where is the key?", "When does the boat leave?"]
    assert cli.main(["ask", str(saved), *questions, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    for question in questions:
        turn = [{"role": "user", "content": f"{DOCUMENT}\n\n{question}"}]
        assert f"Q: {question}\nA: {unpatched_reply(checkpoint, turn, 6).strip()}\n" in out


def test_compress_warns_when_the_preamble_fills_a_short_documents_budget(
    checkpoint, tmp_path, capsys
):
    """Two sentences at 0.9: the template's preamble is most of what is kept, and the command
    says so on stderr, in its own words, with a ratio that keeps more; at 0.1 it says nothing."""
    document, saved = tmp_path / "doc.txt", tmp_path / "doc.kvz"
    document.write_text(DOCUMENT)
    argv = ["compress", str(document), "--out", str(saved), "--model", checkpoint]
    assert cli.main([*argv, "--policy", "knorm:0.9"]) == 0
    err = capsys.readouterr().err
    assert re.search(
        r"kvpatch compress: warning: the chat template's preamble .* ratio 0\.\d+ or less", err
    )
    assert "UserWarning" not in err and "wrote" in err
    assert cli.main([*argv, "--policy", "knorm:0.1"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_pipeline_answers_from_a_loaded_context(checkpoint, tmp_path):
    from transformers import pipeline

    import kvpatch

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer)
    questions = ["Where is the key?", "When?"]
    with kvpatch.enabled(model, "ada-snapkv:0.5", tokenizer=tokenizer):
        from_text = ask(context=DOCUMENT, questions=questions, max_new_tokens=5)
        before, _ = kvpatch.pipeline.context_text(tokenizer, DOCUMENT)
        ids = tokenizer(before, return_tensors="pt", add_special_tokens=False).input_ids
        kvpatch.prefill(model, ids, tokenizer=tokenizer).save(tmp_path / "doc.kvz")
        loaded = kvpatch.load_context(model, tmp_path / "doc.kvz")
        from_file = ask(context=loaded, questions=questions, max_new_tokens=5)
        with pytest.raises(ValueError, match="keeps its own policy"):
            ask(context=loaded, question="Who?", policy="snapkv:0.5")
    answers = lambda results: [r["generated_text"] for r in results]
    assert answers(from_file) == answers(from_text)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["ask", "/no/such.kvz", "Who?"], "No such file"),
        (["compress", "/no/such.txt", "--out", "x.kvz"], "No such file"),
        (["generate", "--model", "MODEL"], "as an argument or with --prompt-file"),
        (["generate", "x", "--prompt-file", "f", "--model", "MODEL"], "one of them"),
        (["generate", "x", "--policy", "snapvk", "--model", "MODEL"], "Did you mean 'snapkv'"),
        (["generate", "x", "--model", "/no/such/model"], "no such directory: /no/such/model"),
        (["generate", "x", "--model", "TMP"], "holds no checkpoint (no config.json)"),
        (["generate", "x", "--model", "nobody/no-such-model"], "not in the Hugging Face cache"),
        (["chat", "--policy", "nonsense", "--model", "MODEL"], "unknown policy 'nonsense'"),
        (["chat", "--policy", "think:0.5", "--model", "/no/such/model"], "only prunes channels"),
        (["chat", "--policy", "kvzip:0.5", "--model", "/no/such/model"], "reconstructing"),
        (["chat", "--max-kv-tokens", "-3", "--model", "/no/such/model"], "integer >= 1"),
    ],
    ids=[
        "ask-no-file",
        "compress-no-file",
        "no-prompt",
        "two-prompts",
        "bad-policy",
        "missing-directory",
        "directory-without-checkpoint",
        "name-not-cached",
        "chat-bad-policy",
        "chat-channels-only",
        "chat-kvzip",
        "chat-negative-budget",
    ],
)
def test_bad_arguments_say_what_to_give(checkpoint, tmp_path, capsys, argv, says):
    argv = [{"MODEL": checkpoint, "TMP": str(tmp_path)}.get(a, a) for a in argv]
    assert cli.main(argv) == 2
    assert says in capsys.readouterr().err


def run_chat(
    checkpoint, monkeypatch, capsys, lines: list[str], policy: str, budget: int = 0
) -> list[str]:
    """``kvpatch chat`` on ``lines``; ``budget`` 0 compresses each turn at the policy's ratio."""
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    argv = ["chat", "--model", checkpoint, "--policy", policy, "--max-new-tokens", "8"]
    argv += ["--max-kv-tokens", str(budget)]
    assert cli.main(argv) == 0
    return capsys.readouterr().out.split("\n")  # replies may hold other line breaks (\x0b)


def test_chat_at_ratio_zero_answers_as_the_whole_conversation(checkpoint, monkeypatch, capsys):
    """Two turns on one cache, each appended and compressed (here: nothing removed): every reply
    is the unpatched model's reply to the whole conversation so far."""
    out = run_chat(checkpoint, monkeypatch, capsys, ["hi there", "and then?", "/quit"], "knorm:0")
    replies = [line.removeprefix("assistant: ") for line in out if line.startswith("assistant: ")]
    first = unpatched_reply(checkpoint, [{"role": "user", "content": "hi there"}], 8)
    history = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and then?"},
    ]
    assert replies == [first, unpatched_reply(checkpoint, history, 8)]


def test_chat_within_a_budget_keeps_short_turns_whole(checkpoint, monkeypatch, capsys):
    """With a history budget larger than the conversation, nothing is removed: the replies are
    the unpatched model's to the whole conversation, although the policy's ratio is 0.5."""
    lines = ["hi there", "and then?", "/stats", "/quit"]
    out = run_chat(checkpoint, monkeypatch, capsys, lines, "keydiff:0.5", budget=2048)
    replies = [line.removeprefix("assistant: ") for line in out if line.startswith("assistant: ")]
    first = unpatched_reply(checkpoint, [{"role": "user", "content": "hi there"}], 8)
    assert replies[0] == first
    stats = next(line for line in out if line.startswith("KV cache"))
    assert "(0.0% saved)" in stats


def test_chat_commands(checkpoint, monkeypatch, capsys):
    lines = ["a first turn " * 10, "/stats", "/policy snapkv:0.25", "/stats", "/reset", "/stats"]
    out = run_chat(checkpoint, monkeypatch, capsys, [*lines, "/nonsense"], "knorm:0.75")
    stats = [line for line in out if line.startswith("KV cache")]
    assert len(stats) == 3
    saved = [float(re.search(r"\(([-\d.]+)% saved\)", s).group(1)) for s in stats[:2]]
    assert saved[0] > 60 and 15 < saved[1] < 40  # knorm:0.75, then snapkv:0.25 on the history
    assert "policy: snapkv" in out and "history cleared" in out
    assert stats[2].startswith("KV cache: empty")
    assert out[-2].startswith("/stats:")  # an unknown command prints the help


def test_eval_and_bench_subcommands(checkpoint, tmp_path, capsys):
    argv = ["eval", "--model", "tiny", "--samples", "1", "--ratios", "0.5", "--policies", "knorm"]
    argv += ["--context-tokens", "100", "--digits", "3", "--no-plot", "--no-progress"]
    assert cli.main([*argv, "--output", str(tmp_path)]) == 0
    assert (tmp_path / "manifest.json").exists() and (tmp_path / "records.jsonl.gz").exists()
    capsys.readouterr()
    argv = ["bench", "--model", checkpoint, "--context", "300", "--tokens", "4", "--rounds", "1"]
    assert cli.main([*argv, "--policies", "knorm:0.75", "snapkv:0.5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| full", "| knorm:0.75", "| snapkv:0.5"]
    assert out.rstrip().endswith("stock sdpa as dispatched")  # which kernels served


def test_the_console_script_is_declared():
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("kvpatch") == "kvpatch.tools.cli:main"


@pytest.mark.parametrize("chunk", [None, 16])
def test_the_prefill_bar_counts_the_prompt_and_closes_before_the_answer(chunk):
    """The bar reaches the prompt's length (in one forward or chunk by chunk) and is closed by
    the time the first decode step runs, so the streamed answer starts on a clean line."""
    import torch

    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    model, ids = tiny_model(), random_prompt(50)
    seen_by_the_answer = []  # (prefill bar's count, closed) when the first new token is shown
    with kvpatch.enabled(model, "snapkv:0.5"), prefill_bar(model, ids) as bars:

        def first_token():
            seen_by_the_answer.append((bars.prefill.n, bars.prefill.disable))
            bars.close()

        cache = kvpatch.CompressedDynamicCache(config=model.config, prefill_chunk_size=chunk)
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            streamer=TimedStream(before_first_token=first_token),
            **{kvpatch.compat.cache_argument(model): cache},
        )
    # tqdm disables a closed bar: the prefill's was done, at the prompt's length, before
    assert seen_by_the_answer == [(ids.shape[1], True)]
    assert bars.reconstruction is None  # no second pass for SnapKV


def _options(parser):
    """Every (command, option) of a parser and its subcommands."""
    import argparse

    from kvpatch.tools.cli import bench, fit_scorer
    from kvpatch.tools.eval import cli as eval_cli

    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(name, a) for a in sub._actions]
    for name, module in (("bench", bench), ("fit-scorer", fit_scorer), ("eval", eval_cli)):
        found += [(name, a) for a in module.parser()._actions]
    return [(name, a) for name, a in found if a.option_strings and a.dest != "help"]


def test_every_flag_says_what_it_does_and_its_default():
    for command, action in _options(cli.parser()):
        flag = action.option_strings[0]
        assert action.help, f"kvpatch {command} {flag} has no help text"
        if action.default not in (None, False, True) and not action.required:
            assert "default" in action.help, f"kvpatch {command} {flag} does not state its default"
    assert "``" not in cli.parser().format_help()


def test_bench_takes_one_flag_per_setting():
    from kvpatch.tools.cli import bench

    flags = {a.option_strings[0] for a in bench.parser()._actions if a.option_strings}
    assert "--policy" not in flags and "--max-new-tokens" not in flags
    assert {"--policies", "--tokens"} <= flags


def test_generate_compare_puts_the_full_caches_answer_first(checkpoint, capsys):
    """``--compare``: the full cache's answer is the unpatched model's, whatever the policy;
    the compressed answer follows under the policy's name."""
    argv = ["generate", "Where is the key?", "--model", checkpoint, "--max-new-tokens", "10"]
    assert cli.main([*argv, "--policy", "knorm:0.9", "--compare"]) == 0
    out = capsys.readouterr().out
    expected = unpatched_reply(checkpoint, [{"role": "user", "content": "Where is the key?"}], 10)
    full, _, compressed = out.partition("\nknorm:0.9: ")
    assert full == f"full cache: {expected}"
    assert compressed.strip()


def test_ask_compare_answers_from_the_documents_tokens_too(checkpoint, tmp_path, capsys):
    """The file keeps the document's tokens: ``--compare`` prefills them again into a cache that
    keeps everything, and that answer is the unpatched model's, however hard the file was
    compressed; every answer is printed before the next question is asked."""
    document, saved = tmp_path / "doc.txt", tmp_path / "doc.kvz"
    document.write_text(DOCUMENT)
    argv = ["compress", str(document), "--out", str(saved), "--model", checkpoint]
    assert cli.main([*argv, "--policy", "knorm:0.9"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"kept \d+ of \d+ tokens per head on average \(\d+%\)", err)
    questions = ["Where is the key?", "When does the boat leave?"]
    printed_before_each_call = []
    from kvpatch.pipeline import CompressedQAPipeline

    original = CompressedQAPipeline.__call__

    def recording(self, *args, **kwargs):
        printed_before_each_call.append(capsys.readouterr().out)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompressedQAPipeline, "__call__", recording)
        assert cli.main(["ask", str(saved), *questions, "--max-new-tokens", "6", "--compare"]) == 0
    printed_before_each_call.append(capsys.readouterr().out)
    out = "".join(printed_before_each_call)
    for question in questions:
        turn = [{"role": "user", "content": f"{DOCUMENT}\n\n{question}"}]
        full = unpatched_reply(checkpoint, turn, 6).strip()
        assert f"Q: {question}\nA (full cache): {full}\nA (knorm): " in out
    # two calls per question (full, compressed); the first question's answers were out before
    # the second question's first call
    assert len(printed_before_each_call) == 5
    assert "A (knorm)" in printed_before_each_call[2] and questions[1] not in out.split("\n\n")[0]


def test_ask_with_another_model_says_which_model_made_the_file(checkpoint, tmp_path, capsys):
    document, saved = tmp_path / "doc.txt", tmp_path / "doc.kvz"
    document.write_text(DOCUMENT)
    argv = ["compress", str(document), "--out", str(saved), "--model", checkpoint]
    assert cli.main([*argv, "--policy", "knorm:0.5"]) == 0
    other = save_tiny_checkpoint(tmp_path / "other", seed=1)
    capsys.readouterr()
    assert cli.main(["ask", str(saved), "Who?", "--model", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"compressed with --model {checkpoint}: leave --model out" in err
    assert f"compress the document again with --model {other}" in err


def test_chat_compare_answers_each_turn_with_the_full_cache_too(checkpoint, monkeypatch, capsys):
    """Each turn's full-cache reply is the unpatched model's reply to the conversation so far
    (whose earlier replies are the compressed cache's, the ones the conversation kept)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\nand then?\n/quit\n"))
    argv = ["chat", "--model", checkpoint, "--policy", "knorm:0.75", "--max-new-tokens", "8"]
    assert cli.main([*argv, "--max-kv-tokens", "0", "--compare"]) == 0
    out = capsys.readouterr().out.split("\n")
    full = [line.removeprefix("full cache: ") for line in out if line.startswith("full cache: ")]
    said = [line.removeprefix("assistant: ") for line in out if line.startswith("assistant: ")]
    history = [{"role": "user", "content": "hi there"}]
    assert full[0] == unpatched_reply(checkpoint, history, 8)
    history += [{"role": "assistant", "content": said[0]}, {"role": "user", "content": "and then?"}]
    assert full[1] == unpatched_reply(checkpoint, history, 8)


def test_a_prompt_within_the_window_is_kept_whole_without_a_warning(checkpoint, capsys):
    """A question shorter than the policy's window loses nothing: no warning about the chat
    template's preamble, one line saying everything was kept, and the decode speed apart from
    the prefill; the answer is not preceded by what clearing a bar leaves."""
    argv = ["generate", "Where is the key?", "--model", checkpoint, "--max-new-tokens", "6"]
    assert cli.main([*argv, "--policy", "keydiff:0.5/window=64"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err
    assert re.search(r"kept all \d+ tokens seen: nothing to drop", err)
    assert re.search(r"6 tokens, decode [\d.]+ tokens/s \(prompt \d+ tokens\)", err)
    assert not out.startswith(" ") and "\r" not in out


def test_the_prefill_bar_moves_during_one_forward_and_shows_kvzips_second_pass():
    """One forward over the whole prompt advances the bar layer by layer; KVzip's reconstruction
    gets a bar of its own, after the prefill's reached the prompt's length."""
    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    tokenizer = kvpatch.tools.testing.byte_tokenizer()  # KVzip's prompt to repeat the context
    model, ids = tiny_model(vocab_size=len(tokenizer)), random_prompt(60, vocab=256)
    layers = list(model.get_decoder().layers)
    with kvpatch.enabled(model, "kvzip:0.5", tokenizer), prefill_bar(model, ids) as bars:
        after_each_layer = []
        hooks = [
            layer.register_forward_hook(lambda *_: after_each_layer.append(bars.prefill.n))
            for layer in layers
        ]  # registered after the bar's own: they see its count once the layer is done
        kvpatch.prefill(model, ids)
        for hook in hooks:
            hook.remove()
    tokens = ids.shape[1]
    first_forward = after_each_layer[: len(layers)]
    assert first_forward == [round(tokens * (i + 1) / len(layers)) for i in range(len(layers))]
    assert bars.prefill.n == tokens and bars.reconstruction is not None
    assert bars.reconstruction.n > tokens  # the repeated context and its prompt


def test_writing_training_text_says_how_far_it_got():
    from kvpatch.tools.testing import byte_tokenizer, tiny_model
    from kvpatch.tools.training_text import sample_texts

    tokenizer = byte_tokenizer()
    said: list[str] = []
    texts = sample_texts(
        tiny_model(vocab_size=len(tokenizer)), tokenizer, 2, 16, progress=said.append
    )
    assert len(texts) == 2
    assert said[0].startswith("writing 2 training texts of up to 16 tokens")
    assert [line.split()[0] for line in said[1:]] == [f"{n}/16" for n in range(2, 16, 2)]


def test_a_fresh_process_answers_from_a_file_of_any_policy(checkpoint, tmp_path, capsys):
    """``kvpatch ask`` in a new process, where nothing but the command is imported yet: the
    saved policy's class (imported on first use) is found, and the answers are the ones this
    process gives."""
    import subprocess
    import sys

    document, saved = tmp_path / "doc.txt", tmp_path / "doc.kvz"
    document.write_text(DOCUMENT)
    argv = ["compress", str(document), "--out", str(saved), "--model", checkpoint]
    assert cli.main([*argv, "--policy", "think:0.25+global-span-knorm:0.5"]) == 0
    ask = ["ask", str(saved), "Where is the key?", "--max-new-tokens", "5"]
    capsys.readouterr()
    assert cli.main(ask) == 0
    here = capsys.readouterr().out
    done = subprocess.run(
        [sys.executable, "-m", "kvpatch.tools.cli", *ask],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == here
