"""Evaluation harness: RULER-style retrieval tasks, policies x ratios, accuracy/memory/speed.

    python -m kvpatch.eval --policies snapkv ada-snapkv --ratios 0.5 0.75 --samples 20

or ``kvpatch-eval`` once installed. See :func:`main` for the options.
"""

from kvpatch.eval.harness import (
    DEFAULT_POLICIES,
    DEFAULT_RATIOS,
    MODES,
    EvalConfig,
    format_accuracy_grid,
    format_table,
    load_model,
    run_eval,
    with_ratio,
)
from kvpatch.eval.tasks import TASKS, Sample, make_sample, make_samples

__all__ = [
    "DEFAULT_POLICIES",
    "DEFAULT_RATIOS",
    "MODES",
    "TASKS",
    "EvalConfig",
    "Sample",
    "format_accuracy_grid",
    "format_table",
    "load_model",
    "main",
    "make_sample",
    "make_samples",
    "run_eval",
    "with_ratio",
]


def main(argv=None) -> int:
    from kvpatch.eval.cli import main as cli_main

    return cli_main(argv)
