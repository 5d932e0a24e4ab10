"""Memory and speed of compressed caches against DynamicCache, measured side by side.

For each context length and policy, one fresh process (so that its peak memory is its own)
builds the same random Llama-style model, prefills the context and decodes a few tokens, timing
every step. Prefill and decode times are reported as ratios to the full cache measured in the
same run (medians of ``--repeats`` runs, with their spread).

    python benchmarks/bench_cache.py --contexts 2048 8192 16384
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

from kvpatch.cache import cache_nbytes

POLICIES = [
    "snapkv:0.5",
    "snapkv:0.75",
    "ada-snapkv:0.5",
    "ada-snapkv:0.75",
    "think:0.5+snapkv:0.5",
    "think:0.5+snapkv:0.75",
]
FULL = "full"


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
    prefill_context=None,
) -> dict:
    """Prefill ``context`` random tokens into ``cache`` (inside ``prefill_context``), then decode
    ``decode_tokens`` greedily, timing each forward."""
    ids = torch.randint(0, 4096, (1, context), generator=torch.Generator().manual_seed(1))
    steps = []
    with torch.inference_mode():
        start = time.perf_counter()
        with prefill_context or contextlib.nullcontext():
            out = model(ids, **{cache_argument: cache})
        prefill = time.perf_counter() - start
        held = cache_nbytes(cache)
        for _ in range(decode_tokens):
            token = out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            out = model(token, **{cache_argument: cache})
            steps.append(time.perf_counter() - start)
    return {
        "policy": policy,
        "context": context,
        "kv_bytes": held,
        "prefill_s": prefill,
        "decode_s": statistics.median(steps[1:] or steps),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure(policy: str, context: int, decode_tokens: int, threads: int) -> dict:
    """One run in this process: prefill ``context`` tokens, then decode ``decode_tokens``."""
    from transformers import DynamicCache

    import kvpatch
    from kvpatch import compat

    if threads > 0:
        torch.set_num_threads(threads)
    model = build_model()
    if policy == FULL:
        cache = DynamicCache(config=model.config)
    else:
        kvpatch.enable(model, policy)
        cache = kvpatch.CompressedDynamicCache(config=model.config)
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
    """One table row per policy: medians (and spreads) of the ratios to the full cache."""
    full = measured[FULL]
    full_prefill = statistics.median(r["prefill_s"] for r in full)
    full_decode = statistics.median(r["decode_s"] for r in full)
    for policy, results in measured.items():
        prefill = [r["prefill_s"] / full_prefill for r in results]
        decode = [r["decode_s"] / full_decode for r in results]
        kv = results[0]["kv_bytes"]
        print(
            f"{context:>7} {policy:<24} {kv / 2**20:>8.1f} "
            f"{kv / full[0]['kv_bytes']:>8.3f} "
            f"{statistics.median(prefill):>7.2f} {spread(prefill):>5} "
            f"{statistics.median(decode):>6.2f} {spread(decode):>5} "
            f"{statistics.median(r['decode_s'] for r in results) * 1e3:>10.2f} "
            f"{statistics.median(r['peak_rss_mb'] for r in results):>12.0f}",
            flush=True,
        )


def run_benchmark(script: str, description: str, measure_one, policies: list[str]) -> None:
    """The command line shared by the benchmark scripts; ``measure_one`` runs in each child."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384])
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
    print(
        f"{'context':>7} {'policy':<24} {'KV MB':>8} {'KV/full':>8} {'prefill/full':>13} "
        f"{'decode/full':>12} {'decode ms':>10} {'peak RSS MB':>12}"
    )
    for context in args.contexts:
        measured: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # interleave policies so drift hits all alike
            for policy in [FULL, *args.policies]:
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
