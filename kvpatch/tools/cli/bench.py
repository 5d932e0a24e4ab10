"""``kvpatch bench``'s options; :mod:`kvpatch.tools.bench` runs it."""

from __future__ import annotations

import argparse
import sys

from kvpatch.policies.registry import DEFAULT_POLICY, check_policy_names
from kvpatch.tools.loading import add_model_options


def parser(prog: str = "kvpatch bench") -> argparse.ArgumentParser:
    description = (
        "Decode speed and KV bytes of policies against the full cache, on a model: the "
        "configurations take turns one decode step each, medians over interleaved rounds."
    )
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_model_options(parser, None, new_tokens=False)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=[DEFAULT_POLICY],
        help="the policies timed against the full cache (default: %(default)s, the default of "
        "the other commands)",
    )
    parser.add_argument(
        "--context", type=int, default=2048, help="prompt tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--tokens", type=int, default=32, help="tokens decoded per run (default: %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)"
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "kvpatch bench") -> int:
    args = parser(prog).parse_args(argv)
    try:
        for policy in args.policies:
            check_policy_names(policy)  # a typo answers before torch loads
        from kvpatch.tools.bench import run
        from kvpatch.tools.demo import DemoModelUnavailable

        try:
            return run(args)
        except DemoModelUnavailable as error:  # it says how to fetch the model
            raise ValueError(str(error)) from None
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
