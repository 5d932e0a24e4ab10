"""The whole evaluation: every sample, mode, policy and ratio of an :class:`EvalConfig`."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

import kvpatch
from kvpatch.eval.answer import (
    AnswerComplete,
    answer,
    answer_shared,
    build_context_cache,
    new_tokens_for,
)
from kvpatch.eval.codecs import Codec, HFCodec
from kvpatch.eval.config import FULL, MODES, EvalConfig, load_model, with_ratio
from kvpatch.eval.report import write_outputs
from kvpatch.eval.scoring import summarize
from kvpatch.eval.tasks import Sample, make_samples


def run_eval(config: EvalConfig, model=None, codec: Codec | None = None) -> dict:
    """Run everything in ``config``; returns ``{"config", "summary", "records"}`` and writes the
    table (``results.md``), ``results.csv``, ``results.json`` and ``results.png`` to
    ``config.output``."""
    if model is None:
        model, codec = load_model(
            config.model, config.attn_implementation, config.dtype, config.prompt_format
        )
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    samples = make_samples(
        config.tasks, codec, config.context_tokens, config.samples, config.seed,
        digits=config.digits,
    )  # fmt: skip
    runner = _Runner(config, model, codec)
    total = len(runner.runs) * len(config.modes) * len(samples)
    runner.progress = _progress(total, config.progress)
    was_enabled = kvpatch.is_enabled(model)
    try:
        if not was_enabled:
            kvpatch.enable(model)  # stock attention on stock caches; each cache its policy
        for indexed in context_groups(samples):
            runner.run_group(indexed)
    finally:
        runner.progress.close()
        if was_enabled and not kvpatch.is_enabled(model):
            kvpatch.enable(model)
        elif not was_enabled and kvpatch.is_enabled(model):
            kvpatch.disable(model)
    records = sorted(
        runner.records, key=lambda r: (r["task"], MODES.index(r["mode"]), r["policy"] != FULL)
    )
    # the format the prompts were laid out in (None in the config: the codec's choice)
    settings = {**asdict(config), "prompt_format": codec.prompt_format}
    result = {"config": settings, "summary": summarize(records), "records": records}
    write_outputs(result, Path(config.output), plot=config.plot)
    return result


class _Runner:
    """Runs the samples of one context through every mode, policy and ratio."""

    def __init__(self, config: EvalConfig, model, codec: Codec):
        self.config, self.model, self.codec = config, model, codec
        self.runs = [(FULL, 0.0)] + [(p, r) for p in config.policies for r in config.ratios]
        # KVzip's repeat prompt needs a tokenizer; the byte codec is one
        self.tokenizer = codec.tokenizer if isinstance(codec, HFCodec) else codec
        self.records: list[dict] = []
        self.progress = None

    def run_group(self, indexed: list[tuple[int, Sample]]) -> None:
        group = [sample for _, sample in indexed]
        prefills = None
        if self.config.shared_prefill:
            asked = group if "prefill" in self.config.modes else group[:1]
            device = self.model.device
            hidden = any(
                kvpatch.parse_policy(with_ratio(p, 0.5)).needs_hidden_states
                for p, _ in self.runs
                if p != FULL
            )  # kvzap scores from the hidden states: the prefill records them too
            prefills = [
                kvpatch.SharedPrefill.run(self.model, s.input_ids[None].to(device), hidden)
                for s in asked
            ]
        for mode in self.config.modes:
            for policy, ratio in self.runs:
                spec = None if policy == FULL else with_ratio(policy, ratio)
                context_cache, context_s = None, 0.0
                # one compressed context, copied for each question; a chat turn by turn
                if mode == "agnostic" and (len(group) > 1 or group[0].turns):
                    shared = prefills[0] if prefills else None
                    context_cache, context_s = build_context_cache(
                        self.model, group[0], spec, shared, self.tokenizer,
                        self.config.prefill_options(),
                    )  # fmt: skip
                for offset, (index, sample) in enumerate(indexed):
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
        stop = AnswerComplete(self.codec, start, len(sample.answers), self.config.digits)
        options = dict(stop=stop, tokenizer=self.tokenizer, context_cache=context_cache)
        if prefill is not None:
            return answer_shared(self.model, sample, prefill, spec, mode, limit, **options)
        prefill_options = self.config.prefill_options()
        return answer(
            self.model, sample, spec, mode, limit, **options, prefill_options=prefill_options
        )

    def record(self, index, sample, mode, policy, ratio, spec, result) -> None:
        text = self.codec.decode(result.pop("tokens"))
        self.records.append(
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


def _progress(total: int, enabled: bool):
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
    return tqdm(total=total, desc="kvpatch-eval", unit="run")


def context_groups(samples: list[Sample]) -> list[list[tuple[int, Sample]]]:
    """``(index, sample)`` pairs grouped by the context they ask about, in order."""
    groups: dict[int, list[tuple[int, Sample]]] = defaultdict(list)
    for index, sample in enumerate(samples):
        groups[sample.context].append((index, sample))
    return list(groups.values())
