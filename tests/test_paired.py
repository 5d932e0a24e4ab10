"""Two policies of a run compared sample by sample (McNemar's exact test)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpatch.tools.eval.manifest import read_manifest, read_records
from kvpatch.tools.eval.paired import PairedCounts, check_same_samples, compare, mcnemar_exact
from kvpatch.tools.eval.published import main

RESULTS = Path(__file__).resolve().parents[1] / "results"


def exact_by_definition(first_only: int, second_only: int) -> float:
    """The p-value as its definition reads: the total probability, under a fair coin for each
    discordant sample, of every split no more likely than the observed one."""
    n = first_only + second_only
    probability = [math.comb(n, k) / 2**n for k in range(n + 1)]
    observed = probability[first_only]
    return min(1.0, sum(p for p in probability if p <= observed * (1 + 1e-12)))


@pytest.mark.parametrize("split", [(0, 0), (1, 6), (6, 1), (3, 3), (0, 9), (4, 1), (12, 30)])
def test_mcnemars_exact_p_value_is_its_definition(split):
    assert mcnemar_exact(*split) == pytest.approx(exact_by_definition(*split), rel=1e-12)


def test_mcnemars_exact_p_value_at_textbook_splits():
    assert mcnemar_exact(1, 6) == pytest.approx(0.125)  # 2 * (1 + 7) / 128
    assert mcnemar_exact(0, 5) == pytest.approx(0.0625)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0


def record(policy, ratio, sample, score, task="single", mode="agnostic"):
    return dict(task=task, mode=mode, policy=policy, ratio=ratio, sample=sample, score=score)


def test_compare_counts_the_samples_each_answers_alone():
    scores_a = [1, 1, 0, 0, 1, 0.5]  # a partial answer (one value of two) counts as missed
    scores_b = [1, 0, 1, 0, 0, 1]
    full = [1, 1, 1, 0, 1, 1]
    records = [record("full", 0.0, s, x) for s, x in enumerate(full)]
    for ratio in (0.5, 0.9):
        records += [record("a", ratio, s, x) for s, x in enumerate(scores_a)]
        records += [record("b", ratio, s, x) for s, x in enumerate(scores_b)]
    ab = compare(records, "a", "b")
    assert [c.ratio for c in ab] == [0.5, 0.9]
    assert ab[0] == PairedCounts("single", "agnostic", 0.5, 1, 2, 2, 1)
    # the full cache is compared at each ratio of the other policy
    full_a = compare(records, "full", "a")
    assert [c.ratio for c in full_a] == [0.5, 0.9]
    assert full_a[1] == PairedCounts("single", "agnostic", 0.9, 3, 2, 0, 1)


def test_compare_keeps_tasks_and_placements_apart():
    records = [
        record("a", 0.5, 0, 1, task="single"),
        record("b", 0.5, 0, 0, task="single"),
        record("a", 0.5, 0, 0, task="multifact", mode="prefill"),
        record("b", 0.5, 0, 1, task="multifact", mode="prefill"),
    ]
    counts = {(c.task, c.mode): c for c in compare(records, "a", "b")}
    assert counts["single", "agnostic"].first_only == 1
    assert counts["multifact", "prefill"].second_only == 1


def test_compare_names_the_runs_policies_when_one_is_missing():
    records = [record("full", 0.0, 0, 1), record("snapkv", 0.5, 0, 1)]
    with pytest.raises(ValueError, match=r"no records of 'tova'.*its policies: full, snapkv"):
        compare(records, "snapkv", "tova")
    with pytest.raises(ValueError, match="no samples of a task, placement and ratio in common"):
        compare(records, "full", "full")


def asking(record: dict, expected: str) -> dict:
    """``record`` of the sample that asks for ``expected`` (at the same depth)."""
    return {**record, "expected": expected, "depth": 0.5}


def test_two_runs_are_paired_by_what_their_samples_ask():
    """Another run numbers the same samples differently (more samples, other tasks first): they
    are matched by their expected values, and a sample only one run asked is left out."""
    ours = [asking(record("a", 0.5, s, x), e) for s, x, e in [(0, 1, "11"), (1, 0, "22")]]
    theirs = [
        asking(record("a", 0.5, s, x), e) for s, x, e in [(0, 1, "99"), (5, 1, "22"), (6, 1, "11")]
    ]
    counts = compare(ours, "a", "a", second_records=theirs)
    assert counts == [PairedCounts("single", "agnostic", 0.5, 1, 0, 1, 0)]


def test_two_runs_name_the_run_a_policy_is_missing_from():
    ours = [asking(record("a", 0.5, 0, 1), "11")]
    theirs = [asking(record("b", 0.5, 0, 1), "11")]
    with pytest.raises(ValueError, match=r"no records of 'a' in the second run; its policies: b"):
        compare(ours, "a", "a", second_records=theirs)


def test_samples_that_cannot_be_told_apart_are_refused():
    twins = [asking(record("a", 0.5, s, 1), "11") for s in (0, 1)]
    with pytest.raises(ValueError, match=r"two samples of 'a'.*ask the same"):
        compare(twins, "a", "a", second_records=twins)


def test_runs_with_other_sample_settings_are_refused():
    config = dict(model="demo", prompt_format="chat", context_tokens=2000, digits=6, seed=0)
    check_same_samples(config, {**config, "samples": 40, "tasks": ["multifact"]})
    with pytest.raises(ValueError, match=r"different samples \(context_tokens: 2000 and 8000\)"):
        check_same_samples(config, {**config, "context_tokens": 8000})


def test_two_published_runs_of_the_same_policy_answer_alike():
    """The default's answers in two runs made apart (the first with more policies) pair up
    completely: every answer the same, and as many as its manifest's accuracy gives."""
    counts = compare(
        read_records(RESULTS / "multifact-kvzip-40"),
        "global-kvzip",
        "global-kvzip",
        second_records=read_records(RESULTS / "multifact-spans-40"),
    )
    summary = read_manifest(RESULTS / "multifact-kvzip-40")["summary"]
    accuracy = next(r["accuracy"] for r in summary if r["policy"] == "global-kvzip")
    (c,) = counts
    assert c.first_only == c.second_only == 0 and c.samples == 120
    assert c.both == round(accuracy * 120)


def test_a_published_runs_paired_counts_give_its_accuracies():
    """Independent of the pairing: each policy's answered samples are its manifest's accuracy."""
    name = "multifact"
    summary = {(r["policy"], r["ratio"]): r for r in read_manifest(RESULTS / name)["summary"]}
    records = read_records(RESULTS / name)
    policy = next(p for p, ratio in summary if p != "full")
    for c in compare(records, "full", policy):
        ours, theirs = summary["full", 0.0], summary[policy, c.ratio]
        assert c.samples == ours["samples"] == theirs["samples"]
        assert c.both + c.first_only == round(ours["accuracy"] * c.samples)
        assert c.both + c.second_only == round(theirs["accuracy"] * c.samples)


def test_the_command_prints_the_comparison(capsys):
    policy = "global-kvzip/layer_floor=0"
    assert main(["multifact", "--results", str(RESULTS), "--compare", "full", policy]) == 0
    printed = capsys.readouterr().out
    assert "| task | question | ratio | samples | both | first only |" in printed
    assert printed.count("| multifact | agnostic | ") == 2  # r = 0.5 and 0.75
    with pytest.raises(SystemExit):
        main(["multifact", "--results", str(RESULTS), "--compare", "full", "nothing"])
    assert "no records of 'nothing'" in capsys.readouterr().err


def test_the_command_compares_two_runs(capsys):
    first, second = "multifact-kvzip-40", "multifact-spans-40"
    argv = [first, "--results", str(RESULTS), "--compare", "full", "global-kvzip/span_before=0"]
    assert main([*argv, "--against", second]) == 0
    printed = capsys.readouterr().out
    assert f"first: full ({first})" in printed and f"({second})" in printed
    assert "| multifact | agnostic | 0.75 | 120 |" in printed
    with pytest.raises(SystemExit):
        main([*argv, "--against", "gemma-8k-kvzip-spans"])
    assert "the two runs asked different samples" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([first, "--results", str(RESULTS), "--against", second])
    assert "--against needs --compare" in capsys.readouterr().err
