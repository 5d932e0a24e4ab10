"""Bytes a quantized compressed cache holds, against the formula and the full cache.

Prefills ``--context`` random tokens into bench_cache's random Llama (bf16 by default) for each
policy at full precision, int8 and int4, and prints the bytes held next to the formula
``(1 - r) x full x bits / (8 x dtype bytes)`` plus the scales and the full-precision residual.

    python -m benchmarks.bench_quantized_bytes --context 8192
"""

from __future__ import annotations

import argparse
import math

import torch

import kvpatch
from benchmarks.bench_cache import build_model

POLICIES = ["snapkv:0.5", "ada-snapkv:0.5", "think:0.5+snapkv:0.5", "snapkv:0.75"]


def formula_bytes(cache, bits: int, dtype_bytes: int) -> float:
    """Codes at ``bits`` a channel, one scale and offset per key channel and group of a head's
    tokens and per value token, the tail (residual) at full precision: from what each layer
    holds."""
    total, group = 0.0, cache.quantization.key_group
    for layer in cache.compressed_layers:
        store, packed = layer.store, layer.packed
        tokens = int(packed.lengths.sum())
        key_channels = packed.channels.shape[-1] if packed.channels is not None else packed.head_dim
        value_channels = (
            packed.value_channels.shape[-1]
            if packed.value_channels is not None
            else packed.value_dim
        )
        heads = packed.lengths.numel()
        groups = sum(math.ceil(n / group) for n in packed.lengths.flatten().tolist())
        total += tokens * (key_channels + value_channels) * bits / 8
        total += 2 * groups * key_channels * dtype_bytes + 2 * tokens * dtype_bytes
        total += heads * store.tail_length * (packed.head_dim + packed.value_dim) * dtype_bytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = build_model().to(dtype)
    ids = torch.randint(0, 4096, (1, args.context), generator=torch.Generator().manual_seed(1))
    full = kvpatch.CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, "snapkv:0"), torch.inference_mode():
        model(ids, past_key_values=full)  # nothing evicted: a full cache's bytes
    full_bytes = full.nbytes()
    print(f"context {args.context}, {args.dtype}; full cache {full_bytes / 2**20:.1f} MB")
    print("| policy | storage | MB | / full | / formula |")
    print("|---|---|---|---|---|")
    for policy in args.policies:
        for quantize in (None, "int8", "int4"):
            cache = kvpatch.CompressedDynamicCache(config=model.config, quantize=quantize)
            with kvpatch.enabled(model, policy), torch.inference_mode():
                model(ids, past_key_values=cache)
            held = cache.nbytes()
            ratio = "-"
            if quantize is not None:
                bits = int(quantize[3:])
                ratio = f"{held / formula_bytes(cache, bits, dtype.itemsize):.3f}"
            print(
                f"| {policy} | {quantize or args.dtype} | {held / 2**20:.2f} | "
                f"{held / full_bytes:.3f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
