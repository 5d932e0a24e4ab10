"""Evaluation harness: RULER-style retrieval tasks, policies x ratios, accuracy/memory/speed.

- :mod:`~kvpatch.tools.eval.tasks` (with :mod:`~kvpatch.tools.eval.codecs`,
  :mod:`~kvpatch.tools.eval.words`): the generated samples;
- :mod:`~kvpatch.tools.eval.config`: what to run; :mod:`~kvpatch.tools.eval.run`: running it, with
  :mod:`~kvpatch.tools.eval.answering` answering one sample;
- :mod:`~kvpatch.tools.eval.scoring`: the summary; :mod:`~kvpatch.tools.eval.manifest`: a run as
  data (its manifest and compressed records), :mod:`~kvpatch.tools.eval.journal` while it runs;
  :mod:`~kvpatch.tools.eval.report`: tables and plots; :mod:`~kvpatch.tools.eval.published`: the
  published runs (``results/``) as the documentation shows them.

    python -m kvpatch.tools.eval --policies snapkv ada-snapkv --ratios 0.5 0.75 --samples 20

or ``kvpatch-eval`` once installed. See :func:`main` for the options.
"""

from typing import TYPE_CHECKING

from kvpatch.lazy import lazy_exports
from kvpatch.tools.eval.options import (
    DEFAULT_POLICIES,
    DEFAULT_RATIOS,
    MODES,
    PROMPT_FORMATS,
    TASKS,
)

#: each module and the names it gives the package (the imports below, for static tools)
EXPORTS = {
    "kvpatch.tools.eval.answering": ("answer",),
    "kvpatch.tools.eval.codecs": ("ByteCodec", "Codec", "HFCodec"),
    "kvpatch.tools.eval.config": ("EvalConfig", "load_model", "with_ratio"),
    "kvpatch.tools.eval.report": ("format_accuracy_grid", "format_table"),
    "kvpatch.tools.eval.run": ("run_eval",),
    "kvpatch.tools.eval.scoring": ("summarize",),
    "kvpatch.tools.eval.tasks": (
        "Sample",
        "make_chat",
        "make_context",
        "make_sample",
        "make_samples",
    ),
}
__all__ = sorted(
    [
        *("DEFAULT_POLICIES", "DEFAULT_RATIOS", "MODES", "PROMPT_FORMATS", "TASKS", "main"),
        *(name for names in EXPORTS.values() for name in names),
    ]
)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)

if TYPE_CHECKING:
    from kvpatch.tools.eval.answering import answer
    from kvpatch.tools.eval.codecs import ByteCodec, Codec, HFCodec
    from kvpatch.tools.eval.config import EvalConfig, load_model, with_ratio
    from kvpatch.tools.eval.report import format_accuracy_grid, format_table
    from kvpatch.tools.eval.run import run_eval
    from kvpatch.tools.eval.scoring import summarize
    from kvpatch.tools.eval.tasks import Sample, make_chat, make_context, make_sample, make_samples


def main(argv=None) -> int:
    from kvpatch.tools.eval.cli import main as cli_main

    return cli_main(argv)
