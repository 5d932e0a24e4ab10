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
        model, codec = load_model(config.model, config.attn_implementation, config.dtype)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    samples = make_samples(
        config.tasks, codec, config.context_tokens, config.samples, config.seed,
        digits=config.digits,
    )  # fmt: skip
    runs = [(FULL, 0.0)] + [
        (policy, ratio) for policy in config.policies for ratio in config.ratios
    ]
    total = len(runs) * len(config.modes) * len(samples)
    progress = _progress(total, config.progress)
    records = []
    was_enabled = kvpatch.is_enabled(model)

    def record(index, sample, mode, policy, ratio, spec, result):
        text = codec.decode(result.pop("tokens"))
        records.append(
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
        progress.update(1)

    def stop_for(sample):
        start = int(sample.input_ids.shape[0])
        return AnswerComplete(codec, start, len(sample.answers), config.digits)

    tokenizer = codec.tokenizer if isinstance(codec, HFCodec) else codec  # for KVzip's prompt
    try:
        if not was_enabled:
            kvpatch.enable(model)  # stock attention on stock caches; each cache its policy
        for indexed in context_groups(samples):
            group = [sample for _, sample in indexed]
            if config.shared_prefill:
                asked = group if "prefill" in config.modes else group[:1]
                prefills = [
                    kvpatch.SharedPrefill.run(model, s.input_ids[None].to(model.device))
                    for s in asked
                ]
            for mode in config.modes:
                for policy, ratio in runs:
                    spec = None if policy == FULL else with_ratio(policy, ratio)
                    context_cache, context_s = None, 0.0
                    # one compressed context, copied for each question; a chat turn by turn
                    if mode == "agnostic" and (len(group) > 1 or group[0].turns):
                        shared = prefills[0] if config.shared_prefill else None
                        context_cache, context_s = build_context_cache(
                            model, group[0], spec, shared, tokenizer
                        )
                    for offset, (index, sample) in enumerate(indexed):
                        limit = new_tokens_for(sample, config.digits)
                        options = dict(stop=stop_for(sample), tokenizer=tokenizer)
                        if config.shared_prefill:
                            shared = prefills[offset if mode == "prefill" else 0]
                            result = answer_shared(
                                model, sample, shared, spec, mode, limit,
                                context_cache=context_cache, **options,
                            )  # fmt: skip
                        else:
                            result = answer(
                                model, sample, spec, mode, limit,
                                context_cache=context_cache, **options,
                            )  # fmt: skip
                        if context_cache is not None:
                            result["prefill_s"] += context_s
                        record(index, sample, mode, policy, ratio, spec, result)
            if config.shared_prefill:
                del prefills
    finally:
        progress.close()
        if was_enabled and not kvpatch.is_enabled(model):
            kvpatch.enable(model)
        elif not was_enabled and kvpatch.is_enabled(model):
            kvpatch.disable(model)
    records.sort(key=lambda r: (r["task"], MODES.index(r["mode"]), r["policy"] != FULL))
    summary = summarize(records)
    result = {"config": asdict(config), "summary": summary, "records": records}
    write_outputs(result, Path(config.output), plot=config.plot)
    return result


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
