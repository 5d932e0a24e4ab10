"""``kvpatch fit-scorer``'s options; :mod:`kvpatch.tools.fitting` runs it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpatch.policies.registry import FIT_TARGETS, HIDDEN_STATE_POLICY, TARGET_POLICY
from kvpatch.tools.loading import add_model_options


def parser(prog: str = "kvpatch fit-scorer") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"Fit the {HIDDEN_STATE_POLICY} scorer of a model: a map from each token's "
        f"hidden state to its {TARGET_POLICY} score (or --target's), written where the "
        f"{HIDDEN_STATE_POLICY} policy finds it.",
    )
    add_model_options(parser, policy=None, new_tokens=False)
    parser.add_argument(
        "--text-files",
        nargs="+",
        type=Path,
        default=None,
        help="training documents, one per file (default: texts the model writes itself from "
        "built-in seed prompts)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the map's file (default: the model's file in the kvpatch cache, where "
        f"{HIDDEN_STATE_POLICY} looks)",
    )
    parser.add_argument(
        "--kind",
        default="linear",
        choices=("linear", "mlp"),
        help="a ridge regression per layer, or a two-layer MLP (default: linear)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=12,
        help="texts the model writes when no files are given (default: 12)",
    )
    parser.add_argument(
        "--sample-tokens", type=int, default=512, help="tokens of each written text (default: 512)"
    )
    parser.add_argument(
        "--per-document",
        type=int,
        default=3,
        help="written texts joined into one training document (default: 3, ~1,500 tokens; 16 "
        "texts of 512 tokens make documents of ~8,000, to fit for long contexts)",
    )
    parser.add_argument(
        "--held-out", type=int, default=1, help="documents held out to report the fit (default: 1)"
    )
    parser.add_argument(
        "--target",
        default=TARGET_POLICY,
        help=f"the scores the map learns: a policy reconstructing the context, one of "
        f"{', '.join(FIT_TARGETS)}, settings allowed (default: {TARGET_POLICY}, as the "
        f"{HIDDEN_STATE_POLICY} paper fits)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "kvpatch fit-scorer") -> int:
    options = parser(prog)
    args = options.parse_args(argv)
    if args.held_out < 1 or args.samples < 2 or args.sample_tokens < 16 or args.per_document < 1:
        options.error(
            "--held-out >= 1, --samples >= 2, --sample-tokens >= 16 and --per-document >= 1"
        )
    from kvpatch.tools.demo import DemoModelUnavailable
    from kvpatch.tools.fitting import run

    try:
        return run(args)
    except (ValueError, OSError, DemoModelUnavailable) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
