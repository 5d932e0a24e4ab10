"""Evaluation harness: RULER-style retrieval tasks, policies x ratios, accuracy/memory/speed.

- :mod:`~kvpatch.eval.tasks` (with :mod:`~kvpatch.eval.codecs`, :mod:`~kvpatch.eval.words`):
  the generated samples;
- :mod:`~kvpatch.eval.config`: what to run; :mod:`~kvpatch.eval.run`: running it, with
  :mod:`~kvpatch.eval.answer` answering one sample;
- :mod:`~kvpatch.eval.scoring`: the summary; :mod:`~kvpatch.eval.report`: tables and plots.

    python -m kvpatch.eval --policies snapkv ada-snapkv --ratios 0.5 0.75 --samples 20

or ``kvpatch-eval`` once installed. See :func:`main` for the options.
"""

from kvpatch.eval.answer import answer
from kvpatch.eval.codecs import PROMPT_FORMATS, ByteCodec, Codec, HFCodec
from kvpatch.eval.config import (
    DEFAULT_POLICIES,
    DEFAULT_RATIOS,
    MODES,
    EvalConfig,
    load_model,
    with_ratio,
)
from kvpatch.eval.report import format_accuracy_grid, format_table
from kvpatch.eval.run import run_eval
from kvpatch.eval.scoring import summarize
from kvpatch.eval.tasks import TASKS, Sample, make_chat, make_context, make_sample, make_samples

__all__ = [
    "DEFAULT_POLICIES",
    "DEFAULT_RATIOS",
    "MODES",
    "PROMPT_FORMATS",
    "TASKS",
    "ByteCodec",
    "Codec",
    "EvalConfig",
    "HFCodec",
    "Sample",
    "answer",
    "format_accuracy_grid",
    "format_table",
    "load_model",
    "main",
    "make_chat",
    "make_context",
    "make_sample",
    "make_samples",
    "run_eval",
    "summarize",
    "with_ratio",
]


def main(argv=None) -> int:
    from kvpatch.eval.cli import main as cli_main

    return cli_main(argv)
