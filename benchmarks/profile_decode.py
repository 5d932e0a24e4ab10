"""Where a decode step's time goes: torch.profiler over decode steps of each policy.

The model is bench_cache's random Llama; each policy prefills the same context, then
``--steps`` decode forwards run under the profiler. Prints the ops with the most self CPU time,
and the step time next to a DynamicCache holding the full context and one holding the tokens the
policy keeps (the physical limit).

    python -m benchmarks.profile_decode --context 8192 --policies ada-snapkv:0.75
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import kvpatch
from benchmarks.bench_cache import build_model
from kvpatch import compat


def decode_steps(model, cache, context: int, steps: int, profiled: bool = False):
    """Prefill ``context`` random tokens, then time ``steps`` decode forwards: the median step
    (s), and the profile of the decode steps if ``profiled``."""
    argument = compat.cache_argument(model)
    ids = torch.randint(0, 4096, (1, context), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.inference_mode():
        out = model(ids, **{argument: cache})
        with profile(activities=[ProfilerActivity.CPU]) if profiled else nullcontext() as prof:
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                start = time.perf_counter()
                out = model(token, **{argument: cache})
                times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--policies", nargs="+", default=["ada-snapkv:0.75"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=25, help="ops shown per policy")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    kvpatch.enable(model)
    for policy in args.policies:
        kept = kvpatch.CompressedDynamicCache(config=model.config, policy=policy)
        step, prof = decode_steps(model, kept, args.context, args.steps, profiled=True)
        full_cache = DynamicCache(config=model.config)
        full, _ = decode_steps(model, full_cache, args.context, args.steps)
        share = kvpatch.cache_nbytes(kept) / kvpatch.cache_nbytes(full_cache)
        limit_cache = DynamicCache(config=model.config)
        limit, _ = decode_steps(model, limit_cache, round(args.context * share), args.steps)
        print(
            f"\n== {policy}: {step * 1e3:.2f} ms/step; limit ({share:.2f} of the tokens) "
            f"{limit * 1e3:.2f} ms, full cache {full * 1e3:.2f} ms"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
