"""A chat about a long document: the document and every turn held in one compressed cache.

The first turn brings the document; each later question is read on top of the compressed
history (nothing is prefilled again), and each turn is compressed in its turn.

    python examples/chat_document.py [--model demo|DIR] [--policy POLICY]
"""

from __future__ import annotations

import argparse

from kvpatch import ChatSession
from kvpatch.loading import load_model

DOCUMENT = (
    "Lease agreement. The tenant is Oskar Lind. The monthly rent is 950 euros, due on the first "
    "day of each month. The notice period is three months. "
    + "Clause: the tenant keeps the stairwell clean and quiet after ten. "
    * 30
)
TURNS = [
    "Read this lease and answer my questions briefly.\n\n" + DOCUMENT + "\n\nWho is the tenant?",
    "What is the monthly rent?",
    "And the notice period?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--policy", default="keydiff:0.5")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "sdpa", "float32")
    chat = ChatSession(model, tokenizer, args.policy, max_new_tokens=args.max_new_tokens)
    for turn in TURNS:
        print(f"user: {turn.splitlines()[-1]}")
        print(f"assistant: {chat.ask(turn).strip()}")
        print(f"  [{chat.stats()}]")


if __name__ == "__main__":
    main()
