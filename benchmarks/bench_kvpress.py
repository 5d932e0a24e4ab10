"""The same measurements as bench_cache.py, for kvpress's presses (https://github.com/NVIDIA/kvpress).

kvpress needs transformers < 5.3, so run this from its own virtualenv (kvpatch is installed there
too, for the shared model factory) and compare its ratios (against DynamicCache in that same
environment) with bench_cache.py's:

    python -m venv /tmp/kvpress-env
    /tmp/kvpress-env/bin/pip install torch==2.13.0 kvpress -e .
    /tmp/kvpress-env/bin/python benchmarks/bench_kvpress.py --contexts 8192
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_cache import (
    FULL,
    LIMIT,
    build_model,
    dynamic_cache_run,
    run_benchmark,
    set_threads,
    timed_run,
)

POLICIES = [
    "snapkv:0.5",
    "snapkv:0.75",
    "ada-snapkv:0.5",
    "ada-snapkv:0.75",
    "think:0.5+snapkv:0.75",
]


def make_press(policy: str):
    from kvpress import AdaKVPress, ComposedPress, SnapKVPress, ThinKPress

    ratio = float(policy.rsplit(":", 1)[1])
    snapkv = SnapKVPress(compression_ratio=ratio, window_size=64, kernel_size=5)
    if policy.startswith("ada-snapkv"):
        return AdaKVPress(snapkv)
    if policy.startswith("think"):
        return ComposedPress(
            [ThinKPress(key_channel_compression_ratio=0.5, window_size=32), snapkv]
        )
    return snapkv


def measure(policy: str, context: int, decode_tokens: int, threads: int) -> dict:
    from transformers import DynamicCache

    if policy == FULL or policy.startswith(LIMIT):
        return dynamic_cache_run(policy, context, decode_tokens, threads)
    set_threads(threads)
    model = build_model()
    cache = DynamicCache(config=model.config)
    press = make_press(policy)(model)
    return timed_run(model, cache, "past_key_values", policy, context, decode_tokens, press)


def main() -> None:
    run_benchmark(__file__, __doc__.splitlines()[0], measure, POLICIES)


if __name__ == "__main__":
    main()
