"""Evaluation harness: RULER-style retrieval tasks, policies x ratios, accuracy/memory/speed.

- :mod:`~kvpatch.eval.tasks` (with :mod:`~kvpatch.eval.codecs`, :mod:`~kvpatch.eval.words`):
  the generated samples;
- :mod:`~kvpatch.eval.config`: what to run; :mod:`~kvpatch.eval.run`: running it, with
  :mod:`~kvpatch.eval.answering` answering one sample;
- :mod:`~kvpatch.eval.scoring`: the summary; :mod:`~kvpatch.eval.report`: tables and plots.

    python -m kvpatch.eval --policies snapkv ada-snapkv --ratios 0.5 0.75 --samples 20

or ``kvpatch-eval`` once installed. See :func:`main` for the options.
"""

from typing import TYPE_CHECKING

from kvpatch.eval.options import DEFAULT_POLICIES, DEFAULT_RATIOS, MODES, PROMPT_FORMATS, TASKS
from kvpatch.lazy import lazy_exports

#: each module and the names it gives the package (the imports below, for static tools)
EXPORTS = {
    "kvpatch.eval.answering": ("answer",),
    "kvpatch.eval.codecs": ("ByteCodec", "Codec", "HFCodec"),
    "kvpatch.eval.config": ("EvalConfig", "load_model", "with_ratio"),
    "kvpatch.eval.report": ("format_accuracy_grid", "format_table"),
    "kvpatch.eval.run": ("run_eval",),
    "kvpatch.eval.scoring": ("summarize",),
    "kvpatch.eval.tasks": ("Sample", "make_chat", "make_context", "make_sample", "make_samples"),
}
__all__ = sorted(
    [
        *("DEFAULT_POLICIES", "DEFAULT_RATIOS", "MODES", "PROMPT_FORMATS", "TASKS", "main"),
        *(name for names in EXPORTS.values() for name in names),
    ]
)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)

if TYPE_CHECKING:
    from kvpatch.eval.answering import answer
    from kvpatch.eval.codecs import ByteCodec, Codec, HFCodec
    from kvpatch.eval.config import EvalConfig, load_model, with_ratio
    from kvpatch.eval.report import format_accuracy_grid, format_table
    from kvpatch.eval.run import run_eval
    from kvpatch.eval.scoring import summarize
    from kvpatch.eval.tasks import Sample, make_chat, make_context, make_sample, make_samples


def main(argv=None) -> int:
    from kvpatch.eval.cli import main as cli_main

    return cli_main(argv)
