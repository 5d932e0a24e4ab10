"""The compress-once pipeline: one document, several questions, one compressed prefill.

python examples/pipeline_questions.py [--model demo|DIR] [--policy POLICY]
"""

from __future__ import annotations

import argparse

from transformers import pipeline

import kvpatch  # noqa: F401  (registers "kvpatch-text-generation")
from kvpatch.loading import load_model

DOCUMENT = (
    "Minutes of the harbour committee. The new ferry, named Saltwind, enters service on 14 May. "
    "Tickets cost 7 euros for adults. The committee chair is Ines Varga. "
    + "The rest of the meeting discussed the paint of the benches at length. "
    * 30
)
QUESTIONS = ["What is the ferry called?", "How much is an adult ticket?", "Who chairs it?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--policy", default="global-kvzip:0.75")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "sdpa", "float32")
    ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer, policy=args.policy)
    answers = ask(context=DOCUMENT, questions=QUESTIONS, max_new_tokens=args.max_new_tokens)
    for answer in answers:
        print(f"Q: {answer['question']}\nA: {answer['generated_text'].strip()}\n")
    held, full = answers[0]["kv_bytes"] / 2**20, answers[0]["uncompressed_kv_bytes"] / 2**20
    print(f"KV cache of the document: {held:.2f} MiB held, {full:.2f} MiB uncompressed")


if __name__ == "__main__":
    main()
