"""A chat about a long document: the document and every turn held in one compressed cache.

The first turn brings the document; each later question is read on top of the compressed
history (nothing is prefilled again), and each turn is compressed in its turn. Each reply is
printed next to the expected fact and the reply of the same chat with nothing removed (ratio 0),
marked right or wrong.

    python examples/chat_document.py [--model demo|DIR] [--policy POLICY]
"""

from __future__ import annotations

import argparse

from kvpatch import ChatSession
from kvpatch.tools.loading import load_model

DOCUMENT = (
    "Lease agreement. The tenant is Oskar Lind. The monthly rent is 950 euros, due on the first "
    "day of each month. The notice period is three months. "
    + "Clause: the tenant keeps the stairwell clean and quiet after ten. "
    * 30
)
#: each turn and what a right reply contains
TURNS = {
    "Read this lease and answer my questions briefly.\n\n" + DOCUMENT + "\n\nWho is the tenant?": (
        "Oskar Lind"
    ),
    "What is the monthly rent?": "950",
    "And the notice period?": "three months",
}


def marked(reply: str, expected: str) -> str:
    reply = reply.strip()
    return f"{reply!r} ({'right' if expected.lower() in reply.lower() else 'wrong'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, a checkpoint directory, ...")
    parser.add_argument("--policy", default="keydiff:0.5", help="the compressed chat's")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "sdpa", "float32")
    replies, stats = {}, {}
    for name, policy in (("full cache", "snapkv:0"), (args.policy, args.policy)):  # 0: keep all
        chat = ChatSession(model, tokenizer, policy, max_new_tokens=args.max_new_tokens)
        replies[name] = [
            chat.ask(turn) for turn in TURNS
        ]  # the model is shared: one chat at a time
        stats[name] = chat.stats()
    for number, (turn, expected) in enumerate(TURNS.items()):
        print(f"user: {turn.splitlines()[-1]} (expected: {expected})")
        for name in replies:
            print(f"   {name}: {marked(replies[name][number], expected)}")
    for name in replies:
        print(f"{name}: {stats[name]}")


if __name__ == "__main__":
    main()
