"""Memory and speed of compressed caches against DynamicCache, measured side by side.

For each context length, one random Llama-style model runs ``generate`` on the context once per
configuration and round, into a fresh cache. The configurations' ``generate`` calls take turns,
one decode step each (:func:`kvpatch.tools.bench.take_turns`), so that the machine's drift hits them
alike, and a stopping criterion times each step where it happens. Two baselines run in the same
rounds: the full ``DynamicCache``, and the *limit* of each ratio r (a ``DynamicCache`` holding
``(1 - r) * n`` tokens, which no cache keeping that share of the tokens can beat).
``POLICY@int8`` (or ``@int4``) stores the kept tokens quantized. Each ratio is taken within a
round; the table gives their medians over ``--repeats`` rounds, with their spread.

    python -m benchmarks.bench_cache --contexts 2048 4096 8192 16384 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kvpatch.cache import cache_nbytes
from kvpatch.tools.bench import TurnClock, take_turns

POLICIES = [
    "snapkv:0.75",
    "ada-snapkv:0.75",
    "think:0.5+snapkv:0.75",
    "snapkv:0.5",
    "ada-snapkv:0.5",
]
FULL = "full"
LIMIT = "limit"
#: one round of a configuration: ``generate`` timed by the clock; returns the KV bytes held
Run = Callable[[TurnClock], int]


def token_ratio(policy: str) -> float:
    """The share of tokens ``policy`` evicts (its token term's ratio; 0 for channels only)."""
    terms = [t for t in policy.partition("@")[0].split("+") if not t.startswith("think")]
    return float(terms[-1].rsplit(":", 1)[1]) if terms else 0.0


def limits_of(policies: list[str]) -> list[str]:
    """The limit configurations the policies are compared with, ``limit:R`` for each ratio."""
    ratios = sorted({token_ratio(p) for p in policies})
    return [f"{LIMIT}:{r:g}" for r in ratios]


def baseline_tokens(label: str, context: int) -> int:
    """Context tokens of a baseline: all for the full cache, ``(1 - R) * context`` for
    ``limit:R``."""
    if label.startswith(LIMIT):
        return round(context * (1 - float(label.split(":")[1])))
    return context


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)


def build_model(**fields):
    """An attention-bound random Llama: 8 layers, 8 query heads sharing 2 KV heads (``fields``
    change its config)."""
    from kvpatch.tools.testing import tiny_model

    shape = dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        pad_token_id=None,
    )
    return tiny_model(**{**shape, **fields})


def timed_generate(
    model,
    make_cache,
    cache_argument: str,
    tokens: int,
    decode_tokens: int,
    clock,
    around=None,
    batch: int = 1,
) -> int:
    """``generate`` on ``batch`` rows of ``tokens`` random tokens into ``make_cache()`` (inside
    ``around()``, e.g. a kvpress press), decoding ``decode_tokens`` greedily, each step timed by
    ``clock``; returns the KV bytes held at the end."""
    ids = torch.randint(0, 4096, (batch, tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)
    cache = make_cache()
    with torch.inference_mode(), around() if around else contextlib.nullcontext():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=decode_tokens + 1,
            min_new_tokens=decode_tokens + 1,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=[clock],
            **{cache_argument: cache},
        )
    return cache_nbytes(cache)


def kvpatch_runs(
    labels: list[str], context: int, decode_tokens: int, model=None, batch: int = 1
) -> dict[str, Run]:
    """One model (:func:`build_model` unless given) for every configuration: a stock
    ``DynamicCache`` for the baselines, a ``CompressedDynamicCache`` carrying its own policy for
    the others."""
    from transformers import DynamicCache

    import kvpatch
    from kvpatch import compat

    model = model if model is not None else build_model()
    kvpatch.enable(model)  # each compressed cache carries its policy; DynamicCache stays stock
    argument = compat.cache_argument(model)
    runs = {}
    for label in labels:
        if label == FULL or label.startswith(LIMIT):
            make_cache = partial(DynamicCache, config=model.config)
            tokens = baseline_tokens(label, context)
        else:
            spec, _, quantize = label.partition("@")  # "snapkv:0.75@int8": quantized storage
            make_cache = partial(
                kvpatch.CompressedDynamicCache,
                config=model.config,
                policy=spec,
                quantize=quantize or None,
            )
            tokens = context
        runs[label] = partial(
            timed_generate, model, make_cache, argument, tokens, decode_tokens, batch=batch
        )
    return runs


def run_isolated(script: str, *child, env: dict[str, str] | None = None) -> dict:
    """Run the benchmark ``script`` (its ``__file__``) as ``python -m benchmarks.NAME --child
    CHILD...`` in a fresh process, so that its peak memory is its own (``env``: variables added
    to its environment); returns the JSON object its last line prints."""
    module = f"benchmarks.{Path(script).stem}"
    command = [sys.executable, "-m", module, "--child", *map(str, child)]
    environment = {**os.environ, **env} if env else None
    root = Path(__file__).resolve().parents[1]  # where the benchmarks package is importable
    result = subprocess.run(
        command, check=True, capture_output=True, text=True, env=environment, cwd=root
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"±{(max(values) - min(values)) / 2 / statistics.median(values):.0%}"


def measure_rounds(runs: dict[str, Run], context: int, repeats: int) -> dict[str, list[dict]]:
    """``repeats`` rounds of every run, their steps interleaved: per label, one record a round."""
    measured: dict[str, list[dict]] = {label: [] for label in runs}
    for _ in range(repeats):
        for label, (clock, kv_bytes) in take_turns(runs).items():
            measured[label].append(
                {
                    "policy": label,
                    "context": context,
                    "kv_bytes": kv_bytes,
                    "prefill_s": clock.prefill_seconds,
                    "decode_s": clock.step_seconds(),
                }
            )
    return measured


def ratios(results: list[dict], baseline: list[dict], key: str) -> list[float]:
    """Round by round, ``key`` of ``results`` over the baseline's in the same round."""
    return [r[key] / b[key] for r, b in zip(results, baseline, strict=True)]


def print_rows(context: int, measured: dict[str, list[dict]]) -> None:
    """One markdown row per policy: medians (and spreads) of the ratios to the baselines."""
    median = statistics.median
    full = measured[FULL]
    for policy, results in measured.items():
        if policy.startswith(LIMIT):
            continue
        prefill, decode = ratios(results, full, "prefill_s"), ratios(results, full, "decode_s")
        if policy == FULL:
            limit = "-"
        else:
            to_limit = ratios(results, measured[f"{LIMIT}:{token_ratio(policy):g}"], "decode_s")
            limit = f"{median(to_limit):.2f} {spread(to_limit)}"
        kv = results[0]["kv_bytes"]
        print(
            f"| {context} | {policy} | {kv / 2**20:.1f} | {kv / full[0]['kv_bytes']:.3f} | "
            f"{median(prefill):.2f} {spread(prefill)} | {median(decode):.2f} {spread(decode)} | "
            f"**{limit}** | {median(r['decode_s'] for r in results) * 1e3:.2f} |",
            flush=True,
        )
    for label in sorted(p for p in measured if p.startswith(LIMIT)):
        ms = median(r["decode_s"] for r in measured[label]) * 1e3
        print(
            f"|  | ({label}: a DynamicCache of the kept tokens decodes in {ms:.2f} ms) |",
            flush=True,
        )


def run_benchmark(description: str, make_runs, policies: list[str]) -> None:
    """The command line shared by the benchmark scripts; ``make_runs(labels, context,
    decode_tokens)`` gives the :data:`Run` of each configuration."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--policies", nargs="+", default=policies)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--json", help="also write the raw runs here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    set_threads(args.threads)
    labels = [FULL, *limits_of(args.policies), *args.policies]
    records = []
    print(f"threads: {torch.get_num_threads()}; medians of {args.repeats} rounds")
    print(
        "| context | policy | KV MB | KV / full | prefill / full | decode / full | "
        "decode / limit | decode ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        runs = make_runs(labels, context, args.decode_tokens)
        measured = measure_rounds(runs, context, args.repeats)
        records += [record for results in measured.values() for record in results]
        print_rows(context, measured)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def main() -> None:
    run_benchmark(__doc__.splitlines()[0], kvpatch_runs, POLICIES)


if __name__ == "__main__":
    main()
