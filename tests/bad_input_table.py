"""Rewrite the bad-input table (docs/bad-input.md) from the cases of ``test_bad_input.py``.

Each case runs; an error row shows the exception and its message, a defined behaviour the text
below. ``test_the_table_lists_every_case`` then checks that the table and the cases agree.

    cd tests && python bad_input_table.py
"""

from __future__ import annotations

import re
import warnings

from test_bad_input import CASES, TABLE

#: what the cases without an error do (each checks it itself)
DEFINED = {
    ("is_enabled", "not a model"): "`False`",
    ("policy string", "upper case"): "accepted: names are case-insensitive",
    ("prefill", "a prompt shorter than the policy's window"): (
        "the whole prompt is kept (the window is never evicted)"
    ),
    ("prefill", "a one-token prompt"): (
        "kept as it is (nothing to compress); questions and decoding work"
    ),
    ("generate", "bf16 weights"): "works: the cache holds bf16, at the policy's share of the bytes",
    ("generate", "fp16 weights"): "works: the cache holds fp16 (fake keys stay finite)",
    ("generate", "a DynamicCache, enabled without a policy"): (
        "used as given, uncompressed: `kvpatch.enable(model)` without a policy compresses only "
        "`CompressedDynamicCache`s that carry one"
    ),
    ("pipeline", "no policy, on a model not enabled"): (
        "compresses with `kvpatch.DEFAULT_POLICY` (`keydiff:0.5/window=64`), the commands' default"
    ),
    ("kvpatch command", "no prompt (exit status 2)"): (
        "`kvpatch generate: error: give the prompt as an argument or with --prompt-file (one of "
        "them)` on stderr, exit status 2"
    ),
}
#: entry points that are not Python names (not shown as code)
PLAIN = ("policy string", "policy object", "eval CLI", "pipeline", "kvpatch command")
HEADER = "| entry point | bad input | what it gets |"


def row(case) -> str:
    if case.error is None:
        outcome = DEFINED[(case.entry, case.given)]
    else:
        try:
            case.run()
        except case.error as error:
            message = re.sub(r"\s+", " ", str(error).split("Valid names:")[0].strip())
            message = message.replace("|", "\\|")
            if len(message) > 260:
                message = message[:257].rsplit(" ", 1)[0] + " …"
            outcome = f"`{case.error.__name__}`: {message}"
        else:
            raise SystemExit(f"no error: {case}")
    entry = case.entry if case.entry in PLAIN else f"`{case.entry}`"
    return f"| {entry} | {case.given} | {outcome} |"


def main() -> None:
    warnings.filterwarnings("ignore")
    table = "\n".join([HEADER, "|---|---|---|", *(row(case) for case in CASES)])
    text = TABLE.read_text()
    start = text.index(HEADER)
    end = text.find("\n\n", start) % (len(text) + 1)  # at the first blank line, or the end
    TABLE.write_text(text[:start] + table + text[end:])


if __name__ == "__main__":
    main()
