"""Memory and speed of compressed caches against DynamicCache, measured side by side.

For each context length and policy, one fresh process (so that its peak memory is its own)
builds the same random Llama-style model and runs ``generate`` on the context, with a stopping
criterion that stamps the clock after every step: decode steps are timed where they happen.
Two baselines run in the same rounds: the full ``DynamicCache``, and the *limit* of each ratio r
(a ``DynamicCache`` holding ``(1 - r) * n`` tokens, which no cache keeping that share of the
tokens can beat). ``POLICY@int8`` (or ``@int4``) stores the kept tokens quantized.
Configurations are interleaved round by round against the machine's drift; the table gives
medians of ``--repeats`` rounds and ratios to the baselines.

    python benchmarks/bench_cache.py --contexts 2048 4096 8192 16384 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from kvpatch.bench import StepClock
from kvpatch.cache import cache_nbytes

POLICIES = [
    "snapkv:0.75",
    "ada-snapkv:0.75",
    "think:0.5+snapkv:0.75",
    "snapkv:0.5",
    "ada-snapkv:0.5",
]
FULL = "full"
LIMIT = "limit"


def token_ratio(policy: str) -> float:
    """The share of tokens ``policy`` evicts (its token term's ratio; 0 for channels only)."""
    terms = [t for t in policy.partition("@")[0].split("+") if not t.startswith("think")]
    return float(terms[-1].rsplit(":", 1)[1]) if terms else 0.0


def limits_of(policies: list[str]) -> list[str]:
    """The limit configurations the policies are compared with, ``limit:R`` for each ratio."""
    ratios = sorted({token_ratio(p) for p in policies})
    return [f"{LIMIT}:{r:g}" for r in ratios]


def dynamic_cache_run(label: str, context: int, decode_tokens: int, threads: int) -> dict:
    """A baseline: the full DynamicCache, or ``limit:R`` (one holding ``(1 - R) * context``
    tokens)."""
    from transformers import DynamicCache

    set_threads(threads)
    model = build_model()
    tokens = context
    if label.startswith(LIMIT):
        tokens = round(context * (1 - float(label.split(":")[1])))
    cache = DynamicCache(config=model.config)
    result = timed_run(model, cache, "past_key_values", label, tokens, decode_tokens)
    return {**result, "context": context}


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)


def build_model(**fields):
    """An attention-bound random Llama: 8 layers, 8 query heads sharing 2 KV heads (``fields``
    change its config)."""
    from kvpatch.testing import tiny_model

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


def timed_run(
    model,
    cache,
    cache_argument: str,
    policy: str,
    context: int,
    decode_tokens: int,
    around=None,
) -> dict:
    """``generate`` on ``context`` random tokens into ``cache`` (inside ``around``, e.g. a
    kvpress press), decoding ``decode_tokens`` greedily; the clock stamps every step."""
    ids = torch.randint(0, 4096, (1, context), generator=torch.Generator().manual_seed(1))
    clock = StepClock()
    with torch.inference_mode(), around or contextlib.nullcontext():
        start = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=decode_tokens + 1,
            min_new_tokens=decode_tokens + 1, do_sample=False, pad_token_id=0,
            stopping_criteria=[clock], **{cache_argument: cache},
        )  # fmt: skip
    return {
        "policy": policy,
        "context": context,
        "kv_bytes": cache_nbytes(cache),
        "prefill_s": clock.stamps[0] - start,  # the prefill and its first token
        "decode_s": clock.step_seconds(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure(policy: str, context: int, decode_tokens: int, threads: int) -> dict:
    """One run in this process: generate on ``context`` tokens, decoding ``decode_tokens``."""
    import kvpatch
    from kvpatch import compat

    if policy == FULL or policy.startswith(LIMIT):
        return dynamic_cache_run(policy, context, decode_tokens, threads)
    set_threads(threads)
    model = build_model()
    spec, _, quantize = policy.partition("@")  # "snapkv:0.75@int8": quantized storage
    kvpatch.enable(model, spec)
    cache = kvpatch.CompressedDynamicCache(config=model.config, quantize=quantize or None)
    return timed_run(model, cache, compat.cache_argument(model), policy, context, decode_tokens)


def run_isolated(script: str, policy: str, context: int, decode_tokens: int, threads: int) -> dict:
    """Run ``script --child ...`` in a fresh process, so that its peak memory is its own."""
    child = [policy, str(context), str(decode_tokens), str(threads)]
    command = [sys.executable, script, "--child", *child]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"±{(max(values) - min(values)) / 2 / statistics.median(values):.0%}"


def print_rows(context: int, measured: dict[str, list[dict]]) -> None:
    """One markdown row per policy: medians (and spreads) of the ratios to the baselines."""
    median = statistics.median
    full = measured[FULL]
    full_prefill, full_decode = (
        median(r["prefill_s"] for r in full),
        median(r["decode_s"] for r in full),
    )
    for policy, results in measured.items():
        if policy.startswith(LIMIT):
            continue
        prefill = [r["prefill_s"] / full_prefill for r in results]
        decode = [r["decode_s"] / full_decode for r in results]
        if policy == FULL:
            limit = "-"
        else:
            baseline = median(r["decode_s"] for r in measured[f"{LIMIT}:{token_ratio(policy):g}"])
            limit = f"{median(r['decode_s'] for r in results) / baseline:.2f}"
        kv = results[0]["kv_bytes"]
        print(
            f"| {context} | {policy} | {kv / 2**20:.1f} | {kv / full[0]['kv_bytes']:.3f} | "
            f"{median(prefill):.2f} {spread(prefill)} | {median(decode):.2f} {spread(decode)} | "
            f"**{limit}** | {median(r['decode_s'] for r in results) * 1e3:.2f} | "
            f"{median(r['peak_rss_mb'] for r in results):.0f} |",
            flush=True,
        )
    for label in sorted(p for p in measured if p.startswith(LIMIT)):
        ms = median(r["decode_s"] for r in measured[label]) * 1e3
        print(
            f"|  | ({label}: a DynamicCache of the kept tokens decodes in {ms:.2f} ms) |",
            flush=True,
        )


def run_benchmark(script: str, description: str, measure_one, policies: list[str]) -> None:
    """The command line shared by the benchmark scripts; ``measure_one`` runs in each child."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--policies", nargs="+", default=policies)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--json", help="also write the raw runs here")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per run (0: torch's default)"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        policy, context, decode_tokens, threads = args.child
        print(json.dumps(measure_one(policy, int(context), int(decode_tokens), int(threads))))
        return

    runs = []
    print(f"threads: {args.threads}; medians of {args.repeats} interleaved rounds")
    print(
        "| context | policy | KV MB | KV / full | prefill / full | decode / full | "
        "decode / limit | decode ms | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        measured: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # interleave policies so drift hits all alike
            for policy in [FULL, *limits_of(args.policies), *args.policies]:
                run = run_isolated(script, policy, context, args.decode_tokens, args.threads)
                runs.append(run)
                measured.setdefault(policy, []).append(run)
        print_rows(context, measured)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


def main() -> None:
    run_benchmark(__file__, __doc__.splitlines()[0], measure, POLICIES)


if __name__ == "__main__":
    main()
