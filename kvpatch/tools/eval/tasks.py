"""RULER-style retrieval tasks, generated on the fly (no data downloads).

A haystack of random common words hides *needles*, ``One of the special magic numbers for
{key} is: {value}.``, and the question asks for a key's value(s):

- ``single`` — one needle;
- ``multikey`` — one needle asked for among distractor needles with other keys;
- ``multivalue`` — several needles with the same key; all their values are asked for;
- ``multiquestion`` — several needles with different keys, each asked for by its own question
  about the same context (one sample per question, sharing ``context_ids``): compress the context
  once, answer every question from a copy of that cache;
- ``multifact`` — as ``multiquestion``, but each needle is a different kind of fact
  (:data:`FACT_KINDS`: a vault's code, a hotel's phone number, a card's PIN), asked in its own
  words and shape, which a small model mixes up less than three magic numbers;
- ``chat`` — a conversation: each user turn brings part of the haystack with one needle, the
  assistant acknowledges it, and a last turn asks for the needle of an earlier turn. Compressed
  question-agnostically, the history is compressed turn by turn (``Sample.turns``).

Each sample is one token sequence: ``context_ids`` (instructions, haystack and needles) then
``question_ids`` (the question and the start of the answer). A sample can be answered with the
question in the prefill (everything compressed together) or question-agnostically (the context is
compressed before the question is seen).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

import torch

from kvpatch.tools.eval.codecs import Codec
from kvpatch.tools.eval.options import TASKS
from kvpatch.tools.eval.words import ADJECTIVES, NOUNS, WORDS

#: the assistant's reply to every turn of a ``chat`` sample
ACKNOWLEDGEMENT = "Noted."


@dataclass(frozen=True)
class FactKind:
    """One of ``multifact``'s kinds of fact: its needle sentence, question and answer start (each
    with ``{key}``, the needle with ``{value}``) and its values' shape (``#`` a digit). Every
    needle ends ``is: {value}.``, which locates its tokens."""

    needle: str
    question: str
    answer_start: str
    shape: str


#: ``multifact``'s kinds: SmolLM2-135M answers 0.73 of such facts with its full cache, 0.38 of
#: three magic numbers
FACT_KINDS = (
    FactKind(
        " The secret code of the {key} vault is: {value}.",
        "What is the secret code of the {key} vault mentioned in the provided text?",
        "The secret code of the {key} vault is:",
        "######",
    ),
    FactKind(
        " The phone number of the {key} hotel is: {value}.",
        "What is the phone number of the {key} hotel mentioned in the provided text?",
        "The phone number of the {key} hotel is:",
        "###-####",
    ),
    FactKind(
        " The PIN of the {key} card is: {value}.",
        "What is the PIN of the {key} card mentioned in the provided text?",
        "The PIN of the {key} card is:",
        "####",
    ),
)

#: ``multifact``'s instruction: it names no kind of fact, so that none is favoured
FACTS_INSTRUCTION = (
    "Some codes and numbers are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about them afterwards.\n"
)

INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about the numbers afterwards.\n"
)


@dataclass
class Sample:
    """One generated prompt with its expected answers.

    Attributes
    ----------
    task : one of :data:`~kvpatch.tools.eval.options.TASKS`.
    context_ids, question_ids : 1-D token ids; the prompt is their concatenation.
    answers : the values the answer must contain.
    needle_spans : for each expected value, the token positions (in the prompt) of its digits.
    depth : relative position of the (first) asked needle in the haystack.
    context : index of the context among the samples; samples of one context share
        ``context_ids`` (``multiquestion``).
    turns : for a conversation (``chat``), where each turn of ``context_ids`` ends.
    shape : the asked value's shape where it is not a plain number (``multifact``: ``#`` a
        digit), which tells the answer's length and when it is complete.
    """

    task: str
    context_ids: torch.Tensor
    question_ids: torch.Tensor
    answers: list[str]
    needle_spans: list[list[int]] = field(default_factory=list)
    depth: float = 0.0
    context: int = 0
    turns: list[int] = field(default_factory=list)
    shape: str | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.context_ids, self.question_ids])

    def answer_pattern(self, digits: int) -> str:
        """A regular expression that one complete value matches: the shape's, else a number of
        at least ``digits`` digits."""
        if self.shape is None:
            return rf"\d{{{digits},}}"
        return "".join(r"\d" if c == "#" else re.escape(c) for c in self.shape)

    def answer_width(self, digits: int) -> int:
        """Characters of one value: the shape's, else ``digits``."""
        return digits if self.shape is None else len(self.shape)

    def score(self, text: str) -> float:
        """Fraction of the expected values found in ``text`` (1.0 or 0.0 for one value)."""
        return sum(answer in text for answer in self.answers) / len(self.answers)


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def _value(rng: random.Random, taken: set[str], digits: int) -> str:
    while True:
        value = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if value not in taken:
            taken.add(value)
            return value


def _shaped(rng: random.Random, shape: str) -> str:
    """A random value of ``shape``: ``#`` a digit (a run of them starts with no 0), anything
    else itself."""
    out: list[str] = []
    for char in shape:
        if char == "#":
            leading = not out or not out[-1].isdigit()
            out.append(rng.choice(string.digits[1:] if leading else string.digits))
        else:
            out.append(char)
    return "".join(out)


def _shaped_needles(
    rng: random.Random, needles: list[tuple[str, str]], shapes: list[str]
) -> list[tuple[str, str]]:
    """``needles`` with new values of ``shapes``, none inside another (an answer giving another
    fact's value must not hold the asked one)."""
    while True:
        values = [_shaped(rng, shape) for shape in shapes]
        if not any(a in b for a in values for b in values if a is not b):
            return [(key, value) for (key, _), value in zip(needles, values, strict=True)]


def _question_text(codec: Codec, key: str, several: bool, kind: int | None = None) -> str:
    # "Answer with the number(s) only" and an answer prefix ending in a colon: without them this
    # model often answers with a haystack word instead of the number, even with the full cache
    if kind is not None:
        fact = FACT_KINDS[kind]
        question = f"{fact.question.format(key=key)} Answer with the number only."
        prefix = fact.answer_start.format(key=key)
    elif several:
        question = (
            f"What are all the special magic numbers for {key} mentioned in the provided text? "
            "Answer with the numbers only."
        )
        prefix = f"The special magic numbers for {key} are:"
    else:
        question = (
            f"What is the special magic number for {key} mentioned in the provided text? "
            "Answer with the number only."
        )
        prefix = f"The special magic number for {key} is:"
    after = codec.wrap("\x01")[1]
    return f"\n{question}{after or chr(10)}{prefix}"


def _haystack(codec: Codec, rng: random.Random, budget: int, sentences: list[str]) -> str:
    """Random common words of about ``budget`` tokens with ``sentences`` (the needles) hidden at
    random word boundaries, in a random order."""
    # random words until the haystack's tokens reach the budget
    per_word = len(codec.encode(" " + " ".join(rng.choices(WORDS, k=200)))[0]) / 200
    words = rng.choices(WORDS, k=max(int(budget / per_word), 8))
    while True:
        count = len(codec.encode(" " + " ".join(words))[0])
        if abs(count - budget) <= max(4, budget // 200):
            break
        change = int((budget - count) / per_word) or (1 if count < budget else -1)
        words = words + rng.choices(WORDS, k=change) if change > 0 else words[:change]
        if len(words) < 8:
            break
    # needles at random word boundaries, in sorted order; the asked one at a random depth
    slots = sorted(rng.sample(range(len(words) + 1), len(sentences)))
    order = list(range(len(sentences)))
    rng.shuffle(order)
    pieces, last = [], 0
    for slot, index in zip(slots, order, strict=True):
        pieces.append(" " + " ".join(words[last:slot]) if slot > last else "")
        pieces.append(sentences[index])
        last = slot
    pieces.append(" " + " ".join(words[last:]) if last < len(words) else "")
    return "".join(pieces).strip()


def make_sample(
    task: str,
    codec: Codec,
    context_tokens: int,
    rng: random.Random,
    digits: int = 6,
    distractors: int = 3,
    values: int = 4,
) -> Sample:
    """Generate one sample of about ``context_tokens`` prompt tokens (for ``multiquestion``,
    the sample of its first question: see :func:`make_context`)."""
    return make_context(task, codec, context_tokens, rng, digits, distractors, values)[0]


def _needles(rng: random.Random, count: int, digits: int, same_key: bool) -> list[tuple[str, str]]:
    """``count`` (key, value) needles with distinct values: distinct keys, or one key."""
    keys: set[str] = set()
    numbers: set[str] = set()
    first = _key(rng, keys)
    return [
        (first if same_key or i == 0 else _key(rng, keys), _value(rng, numbers, digits))
        for i in range(count)
    ]


def _token_span(text: str, spans: list[tuple[int, int]], anchor: str, value: str) -> list[int]:
    """Indices of the tokens covering ``value`` where it appears inside ``anchor`` in ``text``."""
    start = text.index(anchor) + anchor.index(value)
    end = start + len(value)
    return [i for i, (a, b) in enumerate(spans) if a < end and b > start]


def make_context(
    task: str,
    codec: Codec,
    context_tokens: int,
    rng: random.Random,
    digits: int = 6,
    distractors: int = 3,
    values: int = 4,
    questions: int = 3,
) -> list[Sample]:
    """Generate one context of about ``context_tokens`` prompt tokens and the samples that ask
    about it: one, or ``questions`` for ``multiquestion`` and ``multifact``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if task == "chat":
        return [make_chat(codec, context_tokens, rng, digits, turns=questions)]
    counts = {
        "multikey": 1 + distractors,
        "multiquestion": questions,
        "multifact": questions,
        "multivalue": values,
    }
    needles = _planted(task, rng, counts.get(task, 1), digits)
    asked = range(len(needles)) if task in ("multiquestion", "multifact") else [0]
    question_texts = [
        _question_text(codec, needles[i][0], task == "multivalue", needles[i][2]) for i in asked
    ]
    before = codec.wrap("\x01")[0]
    instruction = FACTS_INSTRUCTION if task == "multifact" else INSTRUCTION
    sentences = [_sentence(*needle) for needle in needles]
    overhead = len(codec.encode(before + instruction)[0])
    overhead += max(len(codec.encode(text)[0]) for text in question_texts)
    overhead += sum(len(codec.encode(s)[0]) for s in sentences)
    haystack = _haystack(codec, rng, max(context_tokens - overhead, 16), sentences)
    context = _Context(before + instruction + haystack, codec)  # one tensor for every question
    return [
        _sample(task, codec, context, needles, index, question_text)
        for index, question_text in zip(asked, question_texts, strict=True)
    ]


def _planted(
    task: str, rng: random.Random, count: int, digits: int
) -> list[tuple[str, str, int | None]]:
    """The (key, value, kind) needles of a context: a kind of :data:`FACT_KINDS` each for
    ``multifact`` (cycling through them, the value of its shape), else magic numbers (None)."""
    needles = _needles(rng, count, digits, same_key=task == "multivalue")
    if task != "multifact":
        return [(key, value, None) for key, value in needles]
    kinds = [i % len(FACT_KINDS) for i in range(count)]
    needles = _shaped_needles(rng, needles, [FACT_KINDS[kind].shape for kind in kinds])
    return [(key, value, kind) for (key, value), kind in zip(needles, kinds, strict=True)]


def _sentence(key: str, value: str, kind: int | None) -> str:
    if kind is None:
        return f" One of the special magic numbers for {key} is: {value}."
    return FACT_KINDS[kind].needle.format(key=key, value=value)


class _Context:
    """A context's text, its token ids and each token's character span."""

    def __init__(self, text: str, codec: Codec):
        ids, self.spans = codec.encode(text)
        self.text, self.ids = text, torch.tensor(ids, dtype=torch.long)


def _sample(
    task: str,
    codec: Codec,
    context: _Context,
    needles: list[tuple[str, str, int | None]],
    index: int,
    question_text: str,
) -> Sample:
    """The sample asking ``question_text`` about needle ``index`` of ``context`` (every value of
    its key)."""
    key, _, kind = needles[index]
    answers = [v for k, v, _ in needles if k == key]
    needle_spans = [_token_span(context.text, context.spans, f" is: {a}.", a) for a in answers]
    return Sample(
        task=task,
        context_ids=context.ids,
        question_ids=torch.tensor(codec.encode(question_text)[0], dtype=torch.long),
        answers=answers,
        needle_spans=needle_spans,
        depth=min(s[0] for s in needle_spans) / max(len(context.ids), 1),
        shape=None if kind is None else FACT_KINDS[kind].shape,
    )


def make_chat(
    codec: Codec, context_tokens: int, rng: random.Random, digits: int = 6, turns: int = 3
) -> Sample:
    """A conversation of ``turns`` user turns of about ``context_tokens / turns`` tokens, each
    hiding one needle and answered with :data:`ACKNOWLEDGEMENT`, then a question about the needle
    of a turn before the last one."""
    if turns < 2:
        raise ValueError(f"a chat needs at least 2 turns, got {turns}")
    keys: set[str] = set()
    numbers: set[str] = set()
    needles = [(_key(rng, keys), _value(rng, numbers, digits)) for _ in range(turns)]
    asked = rng.randrange(turns - 1)
    key, answer = needles[asked]
    question = (
        f"What is the special magic number for {key} mentioned in the conversation? "
        "Answer with the number only."
    )
    overhead = len(codec.encode(INSTRUCTION + question)[0]) + 24 * (turns + 1)
    overhead += sum(len(codec.encode(_sentence(k, v, None))[0]) for k, v in needles)
    budget = max((context_tokens - overhead) // turns, 16)
    messages, ends = [], []
    for index, (k, v) in enumerate(needles):
        text = _haystack(codec, rng, budget, [_sentence(k, v, None)])
        messages.append({"role": "user", "content": (INSTRUCTION if index == 0 else "") + text})
        messages.append({"role": "assistant", "content": ACKNOWLEDGEMENT})
        ends.append(len(codec.conversation(messages)))
    context_text = codec.conversation(messages)
    asking = codec.conversation([*messages, {"role": "user", "content": question}], True)
    if not asking.startswith(context_text):
        raise ValueError("the chat template does not render a conversation as its turns in order")
    turn = asking[len(context_text) :]
    space = "" if turn[-1:].isspace() else " "
    question_text = f"{turn}{space}The special magic number for {key} is:"
    context_ids, spans = codec.encode(context_text)
    turn_ends = [sum(1 for _, end in spans if end <= char) for char in ends]
    span = _token_span(context_text, spans, f" is: {answer}.", answer)
    return Sample(
        task="chat",
        context_ids=torch.tensor(context_ids, dtype=torch.long),
        question_ids=torch.tensor(codec.encode(question_text)[0], dtype=torch.long),
        answers=[answer],
        needle_spans=[span],
        depth=span[0] / max(len(context_ids), 1),
        turns=turn_ends,
    )


def make_samples(
    tasks: list[str], codec: Codec, context_tokens: int, samples: int, seed: int = 0, **kwargs
) -> list[Sample]:
    """``samples`` contexts of each task, reproducible from ``seed``, with their questions'
    samples (several per context for ``multiquestion`` and ``multifact``), each numbered by its
    context."""
    out = []
    contexts = 0
    for task in tasks:
        rng = random.Random(f"{seed}-{task}")
        for _ in range(samples):
            for sample in make_context(task, codec, context_tokens, rng, **kwargs):
                sample.context = contexts
                out.append(sample)
            contexts += 1
    return out
