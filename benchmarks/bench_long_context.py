"""Memory of a long prefill: a DynamicCache, a compressed one-shot prefill, a chunked prefill.

Each run is a fresh process (its peak memory is its own) with a small random Llama (4 layers,
4 query heads sharing 2 KV heads of 64 channels), prefilling ``--contexts`` random tokens:

- ``dynamic``: the plain model into a ``DynamicCache`` (every token's KV kept);
- ``oneshot``: ``kvpatch.prefill`` (each layer compressed right after its attention, so at most
  one layer's full KV exists besides the compressed ones);
- ``chunked``: ``kvpatch.prefill(chunk_size=...)`` (the KV held never exceeds the budget plus one
  chunk).

Columns: the cache's bytes after the prefill; the most KV bytes held at once (sampled before
every decoder layer, plus the KV that layer adds: a chunk, or the whole context in one shot);
the process's peak resident memory above what it held before the prefill (weights, ids and
the allocator's own included); and the prefill's wall time.

    python -m benchmarks.bench_long_context --contexts 8192 16384 32768 --plot docs/long_context.png
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from benchmarks.bench_cache import run_isolated

MODES = ("dynamic", "oneshot", "chunked")


def build_model():
    """:func:`bench_cache.build_model` made smaller, so that 32k tokens prefill in a minute."""
    from benchmarks.bench_cache import build_model as bench_model

    return bench_model(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=65536,
    )


def kv_bytes_per_token(config) -> int:
    """Bytes one token's keys and values take in one layer (fp32)."""
    return 2 * config.num_key_value_heads * config.head_dim * 4


def measure(mode: str, context: int, policy: str, chunk: int, threads: int) -> dict:
    """One prefill in this process."""
    from transformers import DynamicCache

    import kvpatch
    from kvpatch import CompressedDynamicCache, compat

    torch.set_num_threads(threads)
    model = build_model()
    ids = torch.randint(0, 4096, (1, context), generator=torch.Generator().manual_seed(1))
    per_token = kv_bytes_per_token(model.config)
    held: list[int] = []
    cache_box: list = []

    def before_model(module, args, kwargs):  # the cache of this forward
        cache_box[:] = [kwargs[compat.cache_argument(model)]]

    def before_layer(module, args, kwargs):  # bytes held as this layer starts, plus its new KV
        new = args[0].shape[1] if args else kwargs["hidden_states"].shape[1]
        held.append(kvpatch.cache_nbytes(cache_box[0]) + new * per_token)

    hooks = [model.model.register_forward_pre_hook(before_model, with_kwargs=True)]
    hooks += [
        layer.register_forward_pre_hook(before_layer, with_kwargs=True)
        for layer in model.model.layers
    ]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.inference_mode():
        if mode == "dynamic":
            cache = DynamicCache(config=model.config)
            model(ids, logits_to_keep=1, **{compat.cache_argument(model): cache})
        else:
            kvpatch.enable(model, policy)
            size = chunk if mode == "chunked" else None
            cache = kvpatch.prefill(model, ids, chunk_size=size).cache
            assert isinstance(cache, CompressedDynamicCache)
    seconds = time.perf_counter() - start
    for hook in hooks:
        hook.remove()
    return {
        "mode": mode,
        "context": context,
        "policy": policy if mode != "dynamic" else "full",
        "chunk": chunk if mode == "chunked" else None,
        "cache_mb": kvpatch.cache_nbytes(cache) / 2**20,
        "full_kv_mb": context * per_token * model.config.num_hidden_layers / 2**20,
        "most_kv_mb": max(held) / 2**20,
        "extra_peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
        "prefill_s": seconds,
    }


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        rows = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["context"])
        if not rows:
            continue
        x = [r["context"] for r in rows]
        axes[0].plot(x, [r["most_kv_mb"] for r in rows], marker="o", label=mode)
        axes[1].plot(x, [r["extra_peak_rss_mb"] for r in rows], marker="o", label=mode)
    axes[0].set_title("most KV held at once (MB)")
    axes[1].set_title("peak resident memory of the prefill (MB)")
    for ax in axes:
        ax.set_xlabel("context tokens")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--policy", default="snapkv:0.75")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the runs here")
    parser.add_argument("--plot", help="write a PNG of both memory columns here")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, context, policy, chunk, threads = args.child
        print(json.dumps(measure(mode, int(context), policy, int(chunk), int(threads))))
        return
    print("| context | mode | cache MB | full KV MB | most KV held MB | extra peak RSS MB | s |")
    print("|---|---|---|---|---|---|---|")
    runs = []
    for context in args.contexts:
        for mode in args.modes:
            run = run_isolated(__file__, mode, context, args.policy, args.chunk, args.threads)
            runs.append(run)
            label = {"dynamic": "DynamicCache", "oneshot": f"{args.policy} one shot"}.get(
                mode, f"{args.policy} chunks of {args.chunk}"
            )
            print(
                f"| {context} | {label} | {run['cache_mb']:.1f} | {run['full_kv_mb']:.1f} | "
                f"{run['most_kv_mb']:.1f} | {run['extra_peak_rss_mb']:.0f} | "
                f"{run['prefill_s']:.1f} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
