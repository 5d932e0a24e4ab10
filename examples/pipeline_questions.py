"""The compress-once pipeline: one document, several questions, one compressed prefill.

The document is compressed before the questions are seen, then all of them are answered in one
batch. Each answer is printed next to the expected one and the full cache's (the same pipeline at
ratio 0, which removes nothing), marked right or wrong.

    python examples/pipeline_questions.py [--model demo|DIR] [--policy POLICY]
"""

from __future__ import annotations

import argparse

from transformers import pipeline

import kvpatch  # noqa: F401  (registers "kvpatch-text-generation")
from kvpatch.tools.loading import load_model

DOCUMENT = (
    "Minutes of the harbour committee. The new ferry, named Saltwind, enters service on 14 May. "
    "Tickets cost 7 euros for adults. The committee chair is Ines Varga. "
    + "The rest of the meeting discussed the paint of the benches at length. "
    "Members also talked about the weather, the gulls on the pier and the queue at the kiosk. " * 12
)
#: each question and what a right answer contains
QUESTIONS = {
    "What is the name of the new ferry?": "Saltwind",
    "Who is the committee chair?": "Ines Varga",
    "When does the ferry enter service?": "14 May",
}


def ask_all(model, tokenizer, policy: str, max_new_tokens: int) -> list[dict]:
    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer, policy=policy)
    return ask(context=DOCUMENT, questions=list(QUESTIONS), max_new_tokens=max_new_tokens)


def marked(answer: dict, expected: str) -> str:
    said = answer["generated_text"].strip()
    return f"{said!r} ({'right' if expected.lower() in said.lower() else 'wrong'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, a checkpoint directory, ...")
    parser.add_argument("--policy", default="global-kvzip:0.75", help="the compressed run's")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "sdpa", "float32")
    full = ask_all(model, tokenizer, "snapkv:0", args.max_new_tokens)  # ratio 0: nothing removed
    compressed = ask_all(model, tokenizer, args.policy, args.max_new_tokens)
    for (question, expected), whole, small in zip(QUESTIONS.items(), full, compressed, strict=True):
        print(f"Q: {question} (expected: {expected})")
        print(f"   full cache: {marked(whole, expected)}")
        print(f"   {args.policy}: {marked(small, expected)}\n")
    held, total = compressed[0]["kv_bytes"] / 2**20, compressed[0]["uncompressed_kv_bytes"] / 2**20
    print(f"KV cache of the document: {held:.2f} MiB held, {total:.2f} MiB uncompressed")


if __name__ == "__main__":
    main()
