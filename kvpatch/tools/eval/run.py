"""The whole evaluation: every sample, mode, policy and ratio of an :class:`EvalConfig`."""

from __future__ import annotations

import random
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

import kvpatch
from kvpatch.tools.eval.answering import (
    AnswerComplete,
    answer,
    answer_shared,
    build_context_cache,
    new_tokens_for,
)
from kvpatch.tools.eval.codecs import Codec, HFCodec
from kvpatch.tools.eval.config import MODES, EvalConfig, load_model, with_ratio
from kvpatch.tools.eval.journal import Journal
from kvpatch.tools.eval.manifest import describe_process, make_manifest, write_run
from kvpatch.tools.eval.options import FULL
from kvpatch.tools.eval.report import write_outputs
from kvpatch.tools.eval.scoring import summarize
from kvpatch.tools.eval.tasks import Sample, make_samples


def run_eval(config: EvalConfig, model=None, codec: Codec | None = None) -> dict:
    """Run everything in ``config``; returns ``{"config", "summary", "records", "manifest"}``.

    ``config.output`` receives the run as data: ``manifest.json`` (the command, the commit,
    the versions, the hardware, the summary with 95% intervals) and ``records.jsonl.gz`` (every
    answer); and its renderings: the tables (``results.md``), ``results.csv`` and, if
    ``config.plot``, ``results.png``.

    Every answer is journaled as it finishes (``records.jsonl``, until the run ends) and the
    tables are rewritten after each context, so a stopped run leaves what it finished;
    ``config.resume`` continues it. After the first context, the expected duration of the whole
    run is printed."""
    if model is None:
        model, codec = load_model(
            config.model, config.attn_implementation, config.dtype, config.prompt_format
        )
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    samples = make_samples(
        config.tasks,
        codec,
        config.context_tokens,
        config.samples,
        config.seed,
        digits=config.digits,
    )
    # the format the prompts were laid out in (None in the config: the codec's choice)
    settings = {**asdict(config), "prompt_format": codec.prompt_format}
    output = Path(config.output)
    device = getattr(model, "device", None)
    made_by = describe_process(None if device is None else str(device))
    journal = Journal.open(output, settings, config.resume, made_by)
    runner = _Runner(config, model, codec, journal)
    total = len(runner.runs) * len(config.modes) * len(samples)
    runner.progress = _progress(total, len(journal.records), config.progress)
    clock = _Estimate(total, len(journal.records))
    was_enabled = kvpatch.is_enabled(model)
    try:
        if not was_enabled:
            kvpatch.enable(model)  # stock attention on stock caches; each cache its policy
        for indexed in context_groups(samples):
            if runner.run_group(indexed):
                clock.after_context(len(journal.records))
                write_outputs(_result(settings, journal.records, runner.runs), output, plot=False)
    finally:
        runner.progress.close()
        if was_enabled and not kvpatch.is_enabled(model):
            kvpatch.enable(model)
        elif not was_enabled and kvpatch.is_enabled(model):
            kvpatch.disable(model)
    result = _result(settings, journal.records, runner.runs)
    manifest = make_manifest(
        settings, result["summary"], journal.provenance(), len(result["records"])
    )
    write_run(output, manifest, result["records"])
    journal.remove()  # its answers are in the compressed records now
    write_outputs(result, output, plot=config.plot)
    return {**result, "manifest": manifest}


def _result(settings: dict, records: list[dict], runs: list[tuple[str, float]]) -> dict:
    """Records in the order a run without a stop makes them: by task, mode, the order of
    ``runs`` (the runner's ``(policy, ratio)`` pairs), then sample."""
    rank = {(policy, float(ratio)): i for i, (policy, ratio) in enumerate(runs)}
    records = sorted(
        records,
        key=lambda r: (
            r["task"],
            MODES.index(r["mode"]),
            rank[r["policy"], float(r["ratio"])],
            r["sample"],
        ),
    )
    return {"config": settings, "summary": summarize(records), "records": records}


class _Estimate:
    """Prints, once the first context with new answers is done, how long the run should take."""

    def __init__(self, total: int, done: int):
        self.total, self.done_before = total, done
        self.start, self.printed = time.perf_counter(), False

    def after_context(self, done: int) -> None:
        new = done - self.done_before
        if self.printed or new <= 0:
            return
        self.printed = True
        seconds = time.perf_counter() - self.start
        left = seconds / new * (self.total - done)
        print(
            f"kvpatch-eval: {_count(new, 'answer')} in {seconds:.0f} s; the "
            f"{_count(self.total - done, 'answer')} left should take about {_duration(left)} "
            "(if it stops, `--resume` continues it)",
            file=sys.stderr,
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Runner:
    """Runs the samples of one context through every mode, policy and ratio."""

    def __init__(self, config: EvalConfig, model, codec: Codec, journal: Journal):
        self.config, self.model, self.codec, self.journal = config, model, codec, journal
        self.runs = [(FULL, 0.0)] + [(p, r) for p in config.policies for r in config.ratios]
        # a reconstruction's prompt needs a tokenizer; the byte codec is one
        self.tokenizer = codec.tokenizer if isinstance(codec, HFCodec) else codec
        self.progress = None

    def run_group(self, indexed: list[tuple[int, Sample]]) -> bool:
        """Answer what the journal lacks of one context's samples; False if nothing was left."""
        left = [
            (mode, policy, ratio)
            for mode in self.config.modes
            for policy, ratio in self.runs
            if any(not self.journal.is_done(mode, policy, ratio, i) for i, _ in indexed)
        ]
        if not left:
            return False
        group = [sample for _, sample in indexed]
        prefills = self._shared_prefills(group) if self.config.shared_prefill else None
        for mode, policy, ratio in left:
            self._run(indexed, prefills, mode, policy, ratio)
        return True

    def _shared_prefills(self, group: list[Sample]) -> list:
        """One recorded prefill per sample (per context when only agnostic runs ask)."""
        asked = group if "prefill" in self.config.modes else group[:1]
        device = self.model.device
        hidden = any(
            kvpatch.parse_policy(with_ratio(p, 0.5)).needs_hidden_states
            for p, _ in self.runs
            if p != FULL
        )  # scored from the hidden states: the prefill records them too
        return [
            kvpatch.SharedPrefill.run(self.model, s.input_ids[None].to(device), hidden)
            for s in asked
        ]

    def _run(self, indexed, prefills, mode: str, policy: str, ratio: float) -> None:
        """One (mode, policy, ratio) on the samples of one context that the journal lacks."""
        group = [sample for _, sample in indexed]
        spec = None if policy == FULL else with_ratio(policy, ratio)
        context_cache, context_s = None, 0.0
        # one compressed context, copied for each question; a chat turn by turn
        if mode == "agnostic" and (len(group) > 1 or group[0].turns):
            shared = prefills[0] if prefills else None
            context_cache, context_s = build_context_cache(
                self.model, group[0], spec, shared, self.tokenizer, self.config.prefill_options()
            )
        for offset, (index, sample) in enumerate(indexed):
            if self.journal.is_done(mode, policy, ratio, index):
                continue
            prefill = None
            if prefills:
                prefill = prefills[offset if mode == "prefill" else 0]
            result = self.answer(sample, prefill, spec, mode, context_cache)
            if context_cache is not None:
                result["prefill_s"] += context_s
            self.record(index, sample, mode, policy, ratio, spec, result)

    def answer(self, sample: Sample, prefill, spec, mode: str, context_cache) -> dict:
        limit = new_tokens_for(sample, self.config.digits)
        start = int(sample.input_ids.shape[0])
        pattern = sample.answer_pattern(self.config.digits)
        stop = AnswerComplete(self.codec, start, len(sample.answers), pattern)
        options = dict(stop=stop, tokenizer=self.tokenizer, context_cache=context_cache)
        if prefill is not None:
            return answer_shared(self.model, sample, prefill, spec, mode, limit, **options)
        prefill_options = self.config.prefill_options()
        return answer(
            self.model, sample, spec, mode, limit, **options, prefill_options=prefill_options
        )

    def record(self, index, sample, mode, policy, ratio, spec, result) -> None:
        text = self.codec.decode(result.pop("tokens"))
        self.journal.add(
            {
                "task": sample.task,
                "mode": mode,
                "policy": policy,
                "ratio": ratio,
                "spec": spec or FULL,
                "sample": index,
                "context": sample.context,
                "depth": round(sample.depth, 4),
                "expected": " ".join(sample.answers),
                "answer": text.strip(),
                "score": sample.score(text),
                "prompt_tokens": int(sample.input_ids.shape[0]),
                **result,
            }
        )
        self.progress.update(1)


def _progress(total: int, done: int, enabled: bool):
    """A bar over every run, starting at the ``done`` ones of a resumed run (its time left
    estimated from the runs done now only)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        tqdm = None
    if tqdm is None or not enabled:

        class _Silent:
            def update(self, n: int = 1) -> None:
                pass

            def close(self) -> None:
                pass

        return _Silent()
    return tqdm(total=total, initial=done, desc="kvpatch eval", unit="run")


def context_groups(samples: list[Sample]) -> list[list[tuple[int, Sample]]]:
    """``(index, sample)`` pairs grouped by the context they ask about, in order."""
    groups: dict[int, list[tuple[int, Sample]]] = defaultdict(list)
    for index, sample in enumerate(samples):
        groups[sample.context].append((index, sample))
    return list(groups.values())
