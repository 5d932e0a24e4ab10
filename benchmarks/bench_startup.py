"""How long the ``kvpatch`` command takes to answer what needs no model: ``--help``, a
subcommand's ``--help``, and a misspelt policy (wall seconds of a fresh process, median of
``--rounds`` runs, the commands interleaved; ``python -c pass`` is the floor).

    python -m benchmarks.bench_startup --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "kvpatch --help": [sys.executable, "-m", "kvpatch.tools.cli", "--help"],
    "kvpatch ask --help": [sys.executable, "-m", "kvpatch.tools.cli", "ask", "--help"],
    "kvpatch eval --help": [sys.executable, "-m", "kvpatch.tools.cli", "eval", "--help"],
    "kvpatch generate x --policy snapvk": [
        *(sys.executable, "-m", "kvpatch.tools.cli", "generate", "x", "--policy", "snapvk"),
    ],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each (default: 3)")
    args = parser.parse_args(argv)
    seconds: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(command, capture_output=True, check=False)
            seconds[name].append(time.perf_counter() - start)
    print(f"median of {args.rounds} runs, interleaved")
    print("| command | seconds |\n|---|---|")
    for name, runs in seconds.items():
        print(f"| `{name}` | {statistics.median(runs):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
