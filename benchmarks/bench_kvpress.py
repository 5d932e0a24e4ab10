"""The same measurements as bench_cache.py, for kvpress's presses (https://github.com/NVIDIA/kvpress).

kvpress needs transformers < 5.3, so run this from its own virtualenv (kvpatch is installed there
too, for the shared model factory) and compare its ratios (against DynamicCache in that same
environment) with bench_cache.py's:

    python -m venv /tmp/kvpress-env
    /tmp/kvpress-env/bin/pip install torch==2.13.0 kvpress -e .
    /tmp/kvpress-env/bin/python -m benchmarks.bench_kvpress --contexts 8192
"""

from __future__ import annotations

from functools import partial

from benchmarks.bench_cache import (
    FULL,
    LIMIT,
    baseline_tokens,
    build_model,
    run_benchmark,
    timed_generate,
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


def kvpress_runs(labels: list[str], context: int, decode_tokens: int) -> dict:
    """A ``DynamicCache`` for every configuration; each press hooks a model of its own (the
    same weights), entered for the duration of its ``generate``."""
    from transformers import DynamicCache

    plain = build_model()
    runs = {}
    for label in labels:
        baseline = label == FULL or label.startswith(LIMIT)
        model = plain if baseline else build_model()
        make_cache = partial(DynamicCache, config=model.config)
        tokens = baseline_tokens(label, context)
        around = None if baseline else partial(make_press(label), model)
        run = partial(timed_generate, model, make_cache, "past_key_values", tokens, decode_tokens)
        runs[label] = partial(run, around=around)
    return runs


def main() -> None:
    run_benchmark(__doc__.splitlines()[0], kvpress_runs, POLICIES)


if __name__ == "__main__":
    main()
