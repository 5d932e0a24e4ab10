"""What scoring costs at prefill: time and peak memory against a plain prefill, for every policy.

Each run is a fresh process (so that its peak memory is its own) that builds the random
Llama-style model of ``bench_cache.py`` (or loads the demo model, ``--model demo``) and prefills a
context with ``kvpatch.prefill``: for ``kvzip`` that includes the context reconstruction (one
more pass over the context, chunk by chunk). Times are ratios to the plain prefill (a
``DynamicCache``, the same forward) measured in the same run, medians of ``--repeats``
interleaved rounds with their spread. "extra peak MB" is the run's peak resident memory minus
the plain prefill's: that includes memory the C allocator keeps after torch frees it (glibc
serves mid-sized tensors from its heap and may not return them). "extra allocated MB" is the same
difference in one more run per policy whose allocator maps every block over 64 KiB on its own
and unmaps it on free (``MALLOC_MMAP_THRESHOLD_``), so that its peak resident memory follows the
storage actually allocated.

``replay-forward`` is the floor of KVzip's cost: the plain prefill, then the forwards of its
reconstruction (the same chunks of 512 through the ``DynamicCache``, each cropped away after it)
with the stock kernel and no scoring; what a ``kvzip`` row takes beyond it is its scoring.

    python -m benchmarks.bench_prefill --contexts 2048 8192

A policy may carry settings after a slash, e.g. ``kvzip:0.5/chunk_size=512,normalise=context``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from benchmarks.bench_cache import FULL, build_model, run_isolated, spread
from kvpatch.tools.testing import byte_tokenizer

#: one policy of every scorer, budget allocation and channel selection; KVzip's reconstruction
#: (one more pass over the context) last
POLICIES = [
    "snapkv:0.5",
    "ada-snapkv:0.5",
    "global-snapkv:0.5",
    "pyramid-snapkv:0.5",
    "span-snapkv:0.5",
    "tova:0.5",
    "knorm:0.5",
    "streamingllm:0.5",
    "random:0.5",
    "keydiff:0.5",
    "expected-attention:0.5",
    "think:0.5+snapkv:0.5",
    "think-v:0.25+snapkv:0.5",
    "kvzip:0.5",
    "kvzip:0.5/normalise=context",
    "ada-kvzip:0.5",
    "global-kvzip:0.5",
    "kvzip-plus:0.5",
]
#: the plain prefill and KVzip's reconstruction forwards, unscored
REPLAY_FORWARD = "replay-forward"
#: glibc: blocks of 64 KiB or more mapped and unmapped one by one (no retained heap)
ALLOCATED_ONLY = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def reconstruction_forwards(model, cache, ids: torch.Tensor, tokenizer) -> None:
    """The forwards of KVzip's reconstruction of ``ids`` (the chunks of
    :func:`kvpatch.feed.reconstruction.reconstruct`, at the default chunk size and overlap), each
    through ``cache`` and cropped away."""
    from kvpatch import compat
    from kvpatch.feed.reconstruction import Prompts, _chunk_batch
    from kvpatch.policies import KVzip

    settings = KVzip().reconstruction
    prompts = Prompts(tokenizer, settings, ids.device, "kvzip")
    length = ids.shape[1]
    for start in range(0, length, settings.chunk_size):
        size, overlap = settings.chunk_size, settings.overlap
        chunk = _chunk_batch(prompts, [ids[0]], [start], size, overlap)[0]
        positions = length + torch.arange(chunk.shape[1])[None]
        mask = torch.ones(1, length + chunk.shape[1], dtype=torch.long)
        inputs = dict(attention_mask=mask, position_ids=positions, logits_to_keep=1)
        model(chunk, **inputs, **{compat.cache_argument(model): cache})
        cache.crop(-chunk.shape[1])  # negative: tokens removed, in every release


def load(name: str):
    """The model and the tokenizer KVzip's repeat prompt is written with."""
    if name == "bench":
        return build_model(), byte_tokenizer(chat_template=False)  # one id per byte
    from kvpatch.tools import demo

    return demo.load(download=False)


def measure(policy: str, context: int, threads: int, model_name: str) -> dict:
    """One prefill of ``context`` random tokens in this process."""
    from transformers import DynamicCache

    import kvpatch
    from kvpatch import compat

    if threads > 0:
        torch.set_num_threads(threads)
    model, tokenizer = load(model_name)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        if policy in (FULL, REPLAY_FORWARD):
            cache = DynamicCache(config=model.config)
            start = time.perf_counter()
            model(ids, logits_to_keep=1, **{compat.cache_argument(model): cache})
            if policy == REPLAY_FORWARD:
                reconstruction_forwards(model, cache, ids, tokenizer)
            seconds = time.perf_counter() - start
        else:
            kvpatch.enable(model, policy, tokenizer=tokenizer)
            start = time.perf_counter()
            kvpatch.prefill(model, ids)
            seconds = time.perf_counter() - start
    return {
        "policy": policy,
        "context": context,
        "prefill_s": seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--model", default="bench", choices=["bench", "demo"])
    parser.add_argument("--json", help="also write the raw runs here")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        policy, context, threads, model_name = args.child
        print(json.dumps(measure(policy, int(context), int(threads), model_name)))
        return
    runs = []
    header = f"{'context':>7} {'policy':<24} {'prefill/plain':>14} {'prefill s':>10}"
    print(f"{header} {'extra peak MB':>14} {'extra allocated MB':>19}")
    for context in args.contexts:
        measured: dict[str, list[dict]] = {}
        policies = [FULL, *args.policies]
        for _ in range(args.repeats):  # interleaved, so that drift hits every policy alike
            for policy in policies:
                run = run_isolated(__file__, policy, context, args.threads, args.model)
                runs.append(run)
                measured.setdefault(policy, []).append(run)
        allocated = {  # one run each: the storage allocated does not drift
            policy: run_isolated(
                __file__, policy, context, args.threads, args.model, env=ALLOCATED_ONLY
            )["peak_rss_mb"]
            for policy in policies
        }
        plain = statistics.median(r["prefill_s"] for r in measured[FULL])
        plain_peak = statistics.median(r["peak_rss_mb"] for r in measured[FULL])
        for policy, results in measured.items():
            ratios = [r["prefill_s"] / plain for r in results]
            peak = statistics.median(r["peak_rss_mb"] for r in results) - plain_peak
            print(
                f"{context:>7} {policy:<24} {statistics.median(ratios):>8.2f} {spread(ratios):>5} "
                f"{statistics.median(r['prefill_s'] for r in results):>10.2f} {peak:>14.0f} "
                f"{allocated[policy] - allocated[FULL]:>19.0f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
