"""``python -m kvpatch.tools.eval`` or ``kvpatch-eval``: the eval harness's command line."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvpatch import check_policy_names
from kvpatch.tools.eval.arguments import parser


def main(argv: list[str] | None = None, prog: str = "kvpatch-eval") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog).parse_args(argv)
    try:  # a policy's name is checked before torch loads: a typo answers at once
        for policy in args.policies:
            check_policy_names(policy)
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        return _run(args, prog)
    except KeyboardInterrupt:  # the journal holds every answer finished so far
        again = shlex.join([*prog.split(), *argv, *([] if args.resume else ["--resume"])])
        print(f"\n{prog}: interrupted; continue it with: {again}", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, prog: str) -> int:
    from kvpatch.tools.demo import DemoModelUnavailable
    from kvpatch.tools.eval.config import EvalConfig, load_model
    from kvpatch.tools.eval.journal import CannotResume
    from kvpatch.tools.eval.manifest import MANIFEST, RECORDS
    from kvpatch.tools.eval.report import format_accuracy_grid, format_table
    from kvpatch.tools.eval.run import run_eval

    try:
        config = EvalConfig(**vars(args))
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    try:  # a missing demo model says what to run; an unknown model what to give
        model, codec = load_model(
            config.model, config.attn_implementation, config.dtype, config.prompt_format
        )
    except (DemoModelUnavailable, ValueError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    try:
        result = run_eval(config, model, codec)
    except CannotResume as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    summary = result["summary"]
    print(format_table(summary))
    print()
    print(format_accuracy_grid(summary))
    output = Path(config.output)
    written = [MANIFEST, RECORDS, *(p.name for p in sorted(output.glob("results.*")))]
    print(f"\nwritten to {output}/: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
