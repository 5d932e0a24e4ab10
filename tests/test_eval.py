"""The evaluation harness end to end on a tiny random model (no download)."""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import platform
import random
import re
import shlex
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from kvpatch.tools.eval import (
    TASKS,
    ByteCodec,
    EvalConfig,
    make_context,
    make_sample,
    make_samples,
    run_eval,
    summarize,
    with_ratio,
)
from kvpatch.tools.eval.cli import main, parser
from kvpatch.tools.eval.scoring import wilson_interval
from kvpatch.tools.eval.tasks import _shaped_needles

ROOT = Path(__file__).resolve().parents[1]


def published(output: Path) -> tuple[dict, list[dict]]:
    """A finished run's manifest and records, read as any reader would: JSON and gzipped JSON
    lines."""
    manifest = json.loads((output / "manifest.json").read_text())
    with gzip.open(output / manifest["records_file"], "rt") as f:
        return manifest, [json.loads(line) for line in f]


def test_tasks_hide_their_answers_where_they_say():
    codec = ByteCodec()
    for task in (t for t in TASKS if t != "chat"):
        sample = make_sample(task, codec, 600, random.Random(0))
        ids = sample.input_ids.tolist()
        assert abs(len(ids) - 600) <= 30
        assert len(sample.answers) == {"multivalue": 4}.get(task, 1)
        for answer, span in zip(sample.answers, sample.needle_spans, strict=True):
            assert codec.decode([ids[i] for i in span]) == answer
        text = codec.decode(ids)
        needles = {"single": 1, "multiquestion": 3, "multifact": 0}.get(task, 4)
        assert text.count("One of the special magic numbers for") == needles
        assert sample.score(" ".join(sample.answers)) == 1.0 and sample.score("nothing") == 0.0


@pytest.mark.parametrize("task", ["multiquestion", "multifact"])
def test_multiquestion_asks_each_fact_of_one_context(task):
    codec = ByteCodec()
    samples = make_context(task, codec, 600, random.Random(0), questions=3)
    assert len(samples) == 3
    context = samples[0].context_ids
    assert all(s.context_ids is context for s in samples)  # one context, three questions
    assert len({s.answers[0] for s in samples}) == 3
    assert len({codec.decode(s.question_ids.tolist()) for s in samples}) == 3
    for sample in samples:
        ids = sample.input_ids.tolist()
        (span,) = sample.needle_spans
        assert codec.decode([ids[i] for i in span]) == sample.answers[0]
    numbered = make_samples(["single", "multiquestion"], codec, 300, samples=2)
    assert [s.context for s in numbered] == [0, 1, 2, 2, 2, 3, 3, 3]


def test_multifact_asks_each_kind_of_fact_in_its_own_words():
    codec = ByteCodec()
    samples = make_context("multifact", codec, 900, random.Random(1), questions=3)
    text = codec.decode(samples[0].context_ids.tolist())
    kinds = []
    for sample in samples:
        question = codec.decode(sample.question_ids.tolist())
        (key,) = set(re.findall(r"\b[a-z]+-[a-z]+\b", question))
        kind = next(n for n in ("vault", "hotel", "card") if n in question)
        # the words from the sentence's start to the answer name the asked key and kind
        (answer,) = sample.answers
        leading = text[: text.index(answer)].rsplit(".", 1)[-1]
        assert key in leading and kind in leading, (question, leading)
        # the answer is complete when its value's shape is, and has room for it
        assert re.fullmatch(sample.answer_pattern(6), answer)
        assert not re.search(sample.answer_pattern(6), answer[:-1])
        assert sample.answer_width(6) == len(answer)
        kinds.append(kind)
    assert sorted(kinds) == ["card", "hotel", "vault"]
    # no value holds another (an answer with another fact's value never scores), even for
    # shapes where a random draw often would
    rng = random.Random(2)
    for _ in range(50):
        drawn = _shaped_needles(rng, [("a", ""), ("b", "")], ["#", "##"])
        assert drawn[0][1] not in drawn[1][1] and len(drawn[1][1]) == 2


def test_an_answer_is_complete_when_its_value_is():
    """Generation stops once the answer holds a whole value of the asked shape and the value has
    ended; the token budget leaves room for the shape's every character."""
    from kvpatch.tools.eval.answering import AnswerComplete, new_tokens_for

    codec = ByteCodec()
    phone = next(
        s
        for s in make_context("multifact", codec, 900, random.Random(1), questions=3)
        if s.shape == "###-####"
    )
    magic = make_sample("single", codec, 600, random.Random(0))

    def complete(sample, text):
        ids = codec.encode(text)[0]
        stop = AnswerComplete(codec, 0, len(sample.answers), sample.answer_pattern(6))
        return bool(stop(torch.tensor([ids]))[0])

    assert complete(phone, " 583-0241.") and complete(magic, " 123456.")
    assert not complete(phone, " 583-02") and not complete(phone, " 583-0241")
    assert not complete(phone, " 583024.")  # a number, but not a phone number
    assert not complete(magic, " 12345.")
    assert new_tokens_for(phone, 6) > new_tokens_for(magic, 6) >= 6 + 1


def test_chat_asks_for_an_earlier_turn():
    codec = ByteCodec()
    sample = make_context("chat", codec, 900, random.Random(3), questions=3)[0]
    ids = sample.context_ids.tolist()
    assert len(sample.turns) == 3 and sample.turns[-1] == len(ids)
    assert abs(len(ids) + len(sample.question_ids) - 900) <= 60
    turns = [codec.decode(ids[a:b]) for a, b in zip([0, *sample.turns], sample.turns, strict=False)]
    for turn in turns:  # each turn: one needle, then the assistant's acknowledgement
        assert turn.startswith("User: ") and turn.endswith("Assistant: Noted.\n")
        assert turn.count("One of the special magic numbers for") == 1
    (span,) = sample.needle_spans
    asked = next(i for i, end in enumerate(sample.turns) if span[0] < end)
    assert asked < 2  # an earlier turn than the last
    assert codec.decode([ids[i] for i in span]) == sample.answers[0]
    question = codec.decode(sample.question_ids.tolist())
    assert question.startswith("User: What is the special magic number for")
    assert question.endswith("is:") and "Assistant: The special" in question


def test_policy_sweep_fills_missing_ratios():
    assert with_ratio("snapkv", 0.75) == "snapkv:0.75"
    assert with_ratio("think:0.5+snapkv", 0.25) == "think:0.5+snapkv:0.25"
    with pytest.raises(ValueError, match="unknown policy"):
        EvalConfig(policies=["snapvk"], model="tiny")


def test_end_to_end_on_a_tiny_model(tmp_path, capsys):
    output = tmp_path / "out"
    code = main(
        [
            "--model",
            "tiny",
            "--policies",
            "snapkv",
            "--ratios",
            "0.5",
            "--samples",
            "1",
            "--context-tokens",
            "200",
            "--output",
            str(output),
            "--no-progress",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| single | prefill | full | 0 |" in printed
    assert "| single | agnostic | snapkv | 0.5 |" in printed
    with open(output / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["policy"]) for r in rows] == [
        ("prefill", "full"),
        ("prefill", "snapkv"),
        ("agnostic", "full"),
        ("agnostic", "snapkv"),
    ]
    for row in rows:
        assert 0.0 <= float(row["accuracy"]) <= 1.0 and float(row["prefill_s"]) > 0
        share, n = float(row["accuracy"]), int(row["samples"])
        low, high = wilson_interval(share, n)
        assert (float(row["accuracy_low"]), float(row["accuracy_high"])) == (low, high)
        assert f"| {share:.2f} [{low:.2f}, {high:.2f}] |" in printed
    full, snap = float(rows[0]["kv_mb"]), float(rows[1]["kv_mb"])
    assert snap < 0.6 * full
    manifest, records = published(output)
    assert len(records) == 4 and manifest["config"]["model"] == "tiny"
    # the data and its renderings; the journal is gone once the records are compressed
    assert sorted(p.name for p in output.iterdir() if p.name != "results.png") == [
        "manifest.json",
        "records.jsonl.gz",
        "results.csv",
        "results.md",
    ]
    table = (output / "results.md").read_text()
    assert table.startswith("| task |")
    # which of the needle's tokens survive, per compressed run: one column per digit (bytes here)
    record = next(r for r in records if (r["mode"], r["policy"]) == ("prefill", "snapkv"))
    by_token = [float(v) for v in rows[1]["needle_kept_by_token"].split(";")]
    assert by_token == pytest.approx(record["needle_survival"], abs=1e-4) and len(by_token) == 6
    # each layer's kept share: snapkv keeps half of the prompt (or its window and sinks) in every
    # layer, with the question in the prefill
    n = record["prompt_tokens"]
    kept = max(n - n // 2, min(n, 64 + 4)) / n
    assert record["layer_kept"] == [pytest.approx(kept, abs=1e-4)] * len(record["layer_kept"])
    assert len(record["layer_kept"]) >= 2
    assert next(r for r in records if r["policy"] == "full")["layer_kept"] is None
    assert "| token 1 | token 2 | token 3 | token 4 | token 5 | token 6 |" in table
    assert f"| single | prefill | snapkv | 0.5 | {by_token[0]:.0%} |" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: no plot")
    assert (output / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_prefill_matches_separate_prefills(tmp_path):
    """One recorded prefill per sample gives every policy the cache its own prefill would."""
    common = dict(
        model="tiny",
        ratios=[0.75],
        samples=1,
        context_tokens=160,
        digits=3,
        plot=False,
        policies=[
            "snapkv",
            "think:0.5+ada-snapkv",
            "kvzip",
            "global-kvzip",
            "kvzip-plus",
            "expected-attention",
        ],
        tasks=["single", "multiquestion"],
        progress=False,
    )
    shared = run_eval(EvalConfig(**common, output=str(tmp_path / "a")))
    separate = run_eval(EvalConfig(**common, shared_prefill=False, output=str(tmp_path / "b")))
    key = lambda r: (r["task"], r["mode"], r["spec"], r["sample"])
    a = {key(r): r for r in shared["records"]}
    b = {key(r): r for r in separate["records"]}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k]["answer"] == b[k]["answer"], k
        assert a[k]["kv_bytes"] == b[k]["kv_bytes"], k
        assert a[k]["needle_survival"] == b[k]["needle_survival"], k
    # the three questions of a context: one compressed context, the same bytes for each question
    for spec in ("kvzip:0.75", "snapkv:0.75"):
        group = [r for r in shared["records"] if r["task"] == "multiquestion" and r["spec"] == spec]
        agnostic = [r for r in group if r["mode"] == "agnostic"]
        assert len(agnostic) == 3 and len({r["context"] for r in agnostic}) == 1
        assert len({r["kv_bytes"] for r in agnostic}) == 1
        assert len({r["expected"] for r in agnostic}) == 3


def test_needle_kept_by_token_averages_over_samples():
    def record(survival):
        return dict(
            task="single",
            mode="prefill",
            policy="snapkv",
            ratio=0.5,
            score=1.0,
            kv_bytes=1,
            prefill_s=0.1,
            decode_s=0.1,
            new_tokens=1,
            needle_survival=survival,
        )

    (row,) = summarize([record([1.0, 0.5]), record([0.0, 0.5, 1.0]), record(None)])
    assert row["needle_kept_by_token"] == pytest.approx([0.5, 0.5, 1.0])
    assert row["needle_kept"] == pytest.approx(3.0 / 5.0)
    assert row["needle_min_kept"] == pytest.approx(0.25)


def test_chat_history_is_compressed_turn_by_turn(tmp_path):
    result = run_eval(
        EvalConfig(
            model="tiny",
            policies=["kvzip", "snapkv"],
            ratios=[0.5],
            tasks=["chat"],
            samples=1,
            context_tokens=600,
            digits=3,
            modes=["agnostic"],
            plot=False,
            progress=False,
            output=str(tmp_path),
        )
    )
    by_spec = {r["spec"]: r for r in result["records"]}
    full = by_spec["full"]["kv_bytes"]
    # every turn keeps half of itself: about half of the history (the question comes after)
    assert by_spec["kvzip:0.5"]["kv_bytes"] == pytest.approx(0.5 * full, rel=0.05)
    assert by_spec["snapkv:0.5"]["kv_bytes"] < 0.7 * full  # its 64-token window per turn
    assert all(0.0 <= s <= 1.0 for s in by_spec["kvzip:0.5"]["needle_survival"])


def test_prefill_in_chunks(tmp_path):
    """``prefill_chunk`` prefills every compressed cache in chunks: at ratio 0 the answers are
    the one-shot ones; with eviction, the bytes are the one-shot policy's (the same budget)."""
    common = dict(
        model="tiny",
        samples=1,
        context_tokens=300,
        digits=3,
        plot=False,
        progress=False,
        policies=["snapkv", "think:0.5+ada-snapkv"],
        tasks=["single"],
    )
    one_shot = run_eval(EvalConfig(**common, ratios=[0.0, 0.5], output=str(tmp_path / "a")))
    config = EvalConfig(**common, ratios=[0.0, 0.5], prefill_chunk=64, output=str(tmp_path / "b"))
    assert not config.shared_prefill
    chunked = run_eval(config)
    key = lambda r: (r["mode"], r["spec"])
    a = {key(r): r for r in one_shot["records"]}
    b = {key(r): r for r in chunked["records"]}
    assert a.keys() == b.keys()
    for k in a:
        if k[1] == "full" or all(term.endswith(":0") for term in k[1].split("+")):
            assert a[k]["answer"] == b[k]["answer"], k
        assert b[k]["kv_bytes"] == pytest.approx(a[k]["kv_bytes"], rel=0.03), k
    with pytest.raises(ValueError, match="cannot be prefilled in chunks"):
        EvalConfig(model="tiny", policies=["kvzip"], prefill_chunk=64)
    with pytest.raises(ValueError, match="positive integer"):
        EvalConfig(model="tiny", prefill_chunk=0)


TIMINGS = ("prefill_s", "decode_s", "decode_tok_s", "compress_s")


def _answers(records: list[dict]) -> list[tuple]:
    """What a run measured, without its timings (which differ from run to run)."""
    return [
        tuple(
            sorted(
                (k, json.dumps(v))
                for k, v in r.items()
                if not k.endswith("_s") and k not in TIMINGS
            )
        )
        for r in records
    ]


def test_a_stopped_run_leaves_what_it_finished_and_resumes_to_the_same_results(
    tmp_path, monkeypatch, capsys
):
    from kvpatch.tools.eval import journal

    args = [
        "--model",
        "tiny",
        "--policies",
        "snapkv",
        "knorm",
        "--ratios",
        "0.5",
        "--samples",
        "2",
        "--context-tokens",
        "200",
        "--no-progress",
        "--no-plot",
    ]
    assert main([*args, "--output", str(tmp_path / "whole")]) == 0
    whole = published(tmp_path / "whole")[1]
    assert len(whole) == 2 * 2 * 3  # samples x modes x (full, snapkv, knorm)
    capsys.readouterr()

    stopped = tmp_path / "stopped"
    original, added = journal.Journal.add, []

    def stop_after_seven(self, record):
        if len(added) == 7:
            raise KeyboardInterrupt
        added.append(record)
        original(self, record)

    monkeypatch.setattr(journal.Journal, "add", stop_after_seven)
    assert main([*args, "--output", str(stopped)]) == 130  # Ctrl-C's exit status
    monkeypatch.setattr(journal.Journal, "add", original)
    said = capsys.readouterr().err
    # the estimate after the first context, then one line with the command that continues
    assert "should take about" in said and "Traceback" not in said
    again = said.strip().splitlines()[-1]
    assert again.endswith(
        f"{shlex.join(['kvpatch-eval', *args, '--output', str(stopped)])} --resume"
    )
    lines = (stopped / "records.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 7  # the settings, then every answer as it finished
    journaled = [json.loads(line) for line in lines[1:]]
    assert _answers(journaled[:6]) == _answers([r for r in whole if r["sample"] == 0])
    # the first context (6 answers) was done: its tables were written; no manifest yet
    with open(stopped / "results.csv") as f:
        assert [int(row["samples"]) for row in csv.DictReader(f)] == [1] * 6
    assert not (stopped / "manifest.json").exists()

    assert main([*args, "--output", str(stopped), "--resume"]) == 0
    manifest, resumed = published(stopped)
    assert _answers(resumed) == _answers(whole)
    assert not (stopped / "records.jsonl").exists()
    # the two parts of the run, each with the answers it made
    assert [part["records"] for part in manifest["provenance"]] == [7, len(whole) - 7]


def test_resuming_with_other_settings_is_refused(tmp_path, capsys):
    args = [
        "--model",
        "tiny",
        "--policies",
        "snapkv",
        "--ratios",
        "0.5",
        "--samples",
        "1",
        "--context-tokens",
        "200",
        "--no-progress",
        "--no-plot",
        "--output",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert main([*args, "--resume", "--seed", "3"]) == 2
    error = capsys.readouterr().err
    assert "cannot resume" in error and "seed: 0 there, 3 now" in error
    (tmp_path / "records.jsonl").write_text("not json\n")
    assert main([*args, "--resume"]) == 2
    assert "not an evaluation journal" in capsys.readouterr().err


@pytest.mark.parametrize(
    "successes, samples, interval",
    [  # textbook values of the 95% Wilson score interval
        (10, 20, (0.2993, 0.7007)),
        (0, 20, (0.0, 0.1611)),
        (20, 20, (0.8389, 1.0)),
        (18, 20, (0.6990, 0.9721)),
        (1, 10, (0.0179, 0.4042)),
    ],
)
def test_the_wilson_interval(successes, samples, interval):
    low, high = wilson_interval(successes / samples, samples)
    assert (round(low, 4), round(high, 4)) == interval


def wilson_bounds(successes: float, n: int) -> tuple[float, float]:
    """The 95% Wilson interval from its definition: the proportions p not rejected by the score
    test, the roots of (p̂ - p)² = z² p (1 - p) / n (z the normal's 97.5% quantile)."""
    z = 1.959963984540054
    share = successes / n
    a, b, c = 1 + z * z / n, -(2 * share + z * z / n), share * share
    root = math.sqrt(b * b - 4 * a * c)
    return (max(0.0, (-b - root) / (2 * a)), min(1.0, (-b + root) / (2 * a)))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A small finished run on the tiny model: two tasks (one asking three questions of each
    context), both placements, two policies."""
    output = tmp_path_factory.mktemp("run")
    config = EvalConfig(
        model="tiny",
        policies=["snapkv", "knorm"],
        ratios=[0.5, 0.75],
        tasks=["single", "multiquestion"],
        samples=2,
        context_tokens=160,
        digits=3,
        plot=False,
        progress=False,
        output=str(output),
    )
    return config, run_eval(config), output


def test_the_manifest_names_the_command_commit_versions_and_hardware(finished_run):
    import torch
    import transformers

    import kvpatch

    config, result, output = finished_run
    manifest, records = published(output)
    assert manifest == result["manifest"]
    assert manifest["samples"] == 2 and manifest["records"] == len(records) == 2 * 5 * 2 + 6 * 5 * 2
    assert manifest["config"]["model"] == "tiny" and manifest["config"]["policies"] == [
        "snapkv",
        "knorm",
    ]
    (part,) = manifest["provenance"]  # one part: the run was not resumed
    assert part["records"] == len(records)
    assert part["versions"] == {
        "python": platform.python_version(),
        "kvpatch": kvpatch.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    hardware = part["hardware"]
    assert hardware["device"] == "cpu" and hardware["gpu"] is None
    assert hardware["cores"] == os.cpu_count() and hardware["threads"] == torch.get_num_threads()
    if (ROOT / ".git").exists():  # run from this checkout: its commit
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        assert part["commit"] == head and isinstance(part["changed"], list)
    # the command parses back to the run's settings
    words = shlex.split(manifest["command"])
    assert words[:3] == ["python", "-m", "kvpatch.tools.eval"]
    again = asdict(EvalConfig(**vars(parser().parse_args(words[3:]))))
    # (the tiny model's byte codec lays prompts out as completions: the command says so)
    assert again == {**asdict(config), "prompt_format": "completion"}


def test_every_accuracy_in_the_manifest_carries_its_wilson_interval(finished_run):
    manifest, records = published(finished_run[2])
    assert len(manifest["summary"]) == 2 * 2 * 5  # task x placement x (full + 2 x 2)
    for row in manifest["summary"]:
        cell = [
            r["score"]
            for r in records
            if (r["task"], r["mode"], r["policy"], r["ratio"])
            == (row["task"], row["mode"], row["policy"], row["ratio"])
        ]
        assert row["samples"] == len(cell) == (6 if row["task"] == "multiquestion" else 2)
        assert row["accuracy"] == pytest.approx(sum(cell) / len(cell))
        low, high = wilson_bounds(sum(cell), len(cell))
        assert row["accuracy_low"] == pytest.approx(low, abs=1e-12)
        assert row["accuracy_high"] == pytest.approx(high, abs=1e-12)


def test_the_records_compress_to_the_same_bytes():
    """A rewritten run changes in git only where its answers do: no timestamp in the gzip."""
    from kvpatch.tools.eval.manifest import compress_records

    records = [{"sample": i, "answer": str(i)} for i in range(3)]
    assert compress_records(records) == compress_records([dict(r) for r in records])
    assert gzip.decompress(compress_records(records)).decode().splitlines() == [
        json.dumps(r) for r in records
    ]


def test_a_finished_run_resumes_from_its_manifest_and_records(tmp_path, capsys):
    """``--resume`` on a finished run (no journal left) reads its compressed records: nothing is
    run again and the manifest is unchanged; other settings are refused, naming them."""
    args = ["--model", "tiny", "--policies", "snapkv", "--ratios", "0.5", "--samples", "1"]
    args += ["--context-tokens", "200", "--no-progress", "--no-plot", "--output", str(tmp_path)]
    assert main(args) == 0
    before = (tmp_path / "manifest.json").read_text()
    records = (tmp_path / "records.jsonl.gz").read_bytes()
    assert not (tmp_path / "records.jsonl").exists()
    assert main([*args, "--resume"]) == 0
    assert (tmp_path / "manifest.json").read_text() == before
    assert (tmp_path / "records.jsonl.gz").read_bytes() == records
    capsys.readouterr()
    assert main([*args, "--resume", "--digits", "4"]) == 2
    assert "digits: 6 there, 4 now" in capsys.readouterr().err
