"""RULER-style retrieval tasks, generated on the fly (no data downloads).

A haystack of random common words hides *needles*, ``One of the special magic numbers for
{key} is: {value}.``, and the question asks for a key's value(s):

- ``single`` — one needle;
- ``multikey`` — one needle asked for among distractor needles with other keys;
- ``multivalue`` — several needles with the same key; all their values are asked for;
- ``multiquestion`` — several needles with different keys, each asked for by its own question
  about the same context (one sample per question, sharing ``context_ids``): compress the context
  once, answer every question from a copy of that cache;
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
from dataclasses import dataclass, field

import torch

WORDS = """
able about above across act add afraid after again against age ago agree air all allow almost
alone along already also always among amount and angle animal answer any appear apple area arm
army around arrive art ask at atom baby back bad ball band bank bar base basic bear beat beauty
bed been before began begin behind bell best better between big bird bit black block blood blow
blue board boat body bone book born both bottom bought box boy branch bread break bright bring
broad brother brown build burn busy buy call came camp can capital captain car card care carry
case cat catch cause cell center century chair chance change character charge chart check chief
child choose church circle city claim class clean clear climb clock close cloth cloud coast coat
cold collect colony color column come common company compare complete condition connect consider
contain continent control cook cool copy corn corner cost cotton could count country course cover
cow crease create crop cross crowd cry current cut dad dance danger dark day dead deal dear death
decide deep degree depend describe desert design determine develop dictionary differ difficult
dinner direct discuss distant divide doctor does dog dollar done door double down draw dream dress
drink drive drop dry duck during each ear early earth ease east eat edge effect egg eight either
electric element else end enemy energy engine enough enter equal equate even evening event ever
every exact example except excite exercise expect experience experiment eye face fact fair fall
family famous far farm fast father favor fear feed feel feet fell felt few field fig fight figure
fill final find fine finger finish fire first fish fit five flat floor flow flower fly follow food
foot force forest form forward found fraction free fresh friend front fruit full fun game garden
gas gather gave general gentle get girl give glad glass gold gone good got govern grand grass gray
great green grew ground group grow guess guide gun hair half hand happen happy hard hat have head
hear heard heart heat heavy held help here high hill history hold hole home hope horse hot hour
house huge human hunt hurry ice idea inch include industry insect instant instrument interest
iron island job join joy jump keep kept kill kind king knew know lady lake land language large
last late laugh lay lead learn least leave led left leg length less letter level lie life lift
light like line liquid list listen little live locate log lone long look lost loud love low
machine made magnet main major make man many map mark market mass master match material matter
meant measure meat meet melody metal method middle might mile milk mind mine minute miss mix
modern molecule moment money month moon morning mother motion mount mountain mouth move music
name nation natural nature near necessary neck need neighbor new next night noise noon north nose
note nothing notice noun now number numeral object observe occur ocean offer office often oil old
once open operate opposite order organ original other out oxygen page paint pair paper paragraph
parent part particular party pass past path pattern pay people perhaps period person phrase pick
picture piece pitch place plain plan plane planet plant play please plural poem point poor
populate port pose position possible post pound power practice prepare present press pretty print
probable problem process produce product proper property protect prove provide pull push quart
question quick quiet quite quotient race radio rail rain raise ran range rather reach read ready
real reason receive record region remember repeat reply represent require rest result rich ride
right ring rise river road rock roll room root rope rose round row rub rule run safe said sail
salt same sand save saw say scale school science score sea search season seat second section see
seed seem segment select self sell send sense sentence separate serve settle seven several shape
share sharp sheet shell shine ship shoe shop shore short shoulder shout show side sight sign
silent silver similar simple since sing single sister sit six size skill skin sky sleep slip slow
small smell smile snow soft soil soldier solution solve some son song soon sound south space speak
special speech speed spell spend spoke spot spread spring square stand star start state station
stay stead steam steel step stick still stone stood stop store story straight strange stream
street stretch string strong student study subject substance subtract success such sudden suffix
sugar suggest suit summer sun supply support sure surface surprise swim syllable symbol system
table tail take talk tall teach team teeth tell temperature term test than thank thick thin thing
third those though thought thousand three through throw tie time tiny tire together told tone too
took tool total touch toward town track trade train travel tree triangle trip trouble truck try
tube turn twenty type under unit until usual valley value vary verb very view village visit voice
vowel wait walk wall want warm wash watch water wave wear weather week weight west wheel where
whether while white whole wide wife wild will win wind window wing winter wire wish woman wonder
wood word work world write wrong yard year yellow young
""".split()  # noqa: SIM905

ADJECTIVES = """
abundant ancient bitter brave calm clever crooked curious eager elegant faint fierce fragile
gentle giant glossy hollow humble icy jolly keen lively loyal misty noble odd polite quiet rapid
rusty shiny silent sleepy smooth sour steady sticky swift tame tender tidy vivid wary wicked witty
""".split()  # noqa: SIM905

NOUNS = """
anchor badger basket beacon blanket bucket cactus candle castle cobra comet compass crystal
dolphin dragon engine falcon feather fiddle garden glacier hammer harbor helmet jacket kettle
lantern lemon magnet meadow mirror needle orchard otter parrot pebble pillow pirate quilt rabbit
ribbon saddle tablet teapot thimble tiger tulip tunnel violin walrus wagon whistle window zebra
""".split()  # noqa: SIM905

TASKS = ("single", "multikey", "multivalue", "multiquestion", "chat")
#: the assistant's reply to every turn of a ``chat`` sample
ACKNOWLEDGEMENT = "Noted."

INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about the numbers afterwards.\n"
)


class Codec:
    """Text to token ids and back, with the character span of every token."""

    eos_token_id: int | None = None

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def wrap(self, user_text: str) -> tuple[str, str]:
        """Text before and after ``user_text`` (a chat template's turn markers, or nothing)."""
        return "", ""

    def conversation(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """``messages`` (``{"role", "content"}``) as text: the chat template, or plain turns."""
        text = "".join(f"{m['role'].title()}: {m['content']}\n" for m in messages)
        return text + ("Assistant:" if add_generation_prompt else "")


class HFCodec(Codec):
    """A Hugging Face (fast) tokenizer; uses its chat template when it has one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str):
        out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def wrap(self, user_text: str) -> tuple[str, str]:
        if not getattr(self.tokenizer, "chat_template", None):
            return "", ""
        marker = "\x00KVPATCH\x00"
        messages = [{"role": "user", "content": marker}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        before, _, after = text.partition(marker)
        return before, after

    def conversation(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            return super().conversation(messages, add_generation_prompt)
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )


class ByteCodec(Codec):
    """One token per byte (ids 0-255): for tiny random models, which need no tokenizer.

    Callable like a tokenizer without a chat template, for what needs one (KVzip's prompt).
    """

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode(text)[0]}

    def encode(self, text: str):
        ids, spans = [], []
        for index, char in enumerate(text):
            data = char.encode("utf-8")
            ids.extend(data)
            spans.extend([(index, index + 1)] * len(data))
        return ids, spans

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@dataclass
class Sample:
    """One generated prompt with its expected answers.

    Attributes
    ----------
    task : ``single``, ``multikey`` or ``multivalue``.
    context_ids, question_ids : 1-D token ids; the prompt is their concatenation.
    answers : the values the answer must contain.
    needle_spans : for each expected value, the token positions (in the prompt) of its digits.
    depth : relative position of the (first) asked needle in the haystack.
    context : index of the context among the samples; samples of one context share
        ``context_ids`` (``multiquestion``).
    turns : for a conversation (``chat``), where each turn of ``context_ids`` ends.
    """

    task: str
    context_ids: torch.Tensor
    question_ids: torch.Tensor
    answers: list[str]
    needle_spans: list[list[int]] = field(default_factory=list)
    depth: float = 0.0
    context: int = 0
    turns: list[int] = field(default_factory=list)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.context_ids, self.question_ids])

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


def _question_text(codec: Codec, key: str, several: bool) -> str:
    # "Answer with the number(s) only" and an answer prefix ending in a colon: without them this
    # model often answers with a haystack word instead of the number, even with the full cache
    if several:
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
    about it: one, or ``questions`` for ``multiquestion``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if task == "chat":
        return [make_chat(codec, context_tokens, rng, digits, turns=questions)]
    keys: set[str] = set()
    numbers: set[str] = set()
    key = _key(rng, keys)
    if task == "single":
        needles = [(key, _value(rng, numbers, digits))]
    elif task == "multikey":
        needles = [(key, _value(rng, numbers, digits))]
        needles += [(_key(rng, keys), _value(rng, numbers, digits)) for _ in range(distractors)]
    elif task == "multiquestion":
        needles = [(key, _value(rng, numbers, digits))]
        needles += [(_key(rng, keys), _value(rng, numbers, digits)) for _ in range(questions - 1)]
    else:
        needles = [(key, _value(rng, numbers, digits)) for _ in range(values)]
    asked = [k for k, _ in needles] if task == "multiquestion" else [key]
    question_texts = [_question_text(codec, k, task == "multivalue") for k in asked]
    before = codec.wrap("\x01")[0]
    longest = max(len(codec.encode(text)[0]) for text in question_texts)
    overhead = len(codec.encode(before + INSTRUCTION)[0]) + longest
    sentences = [f" One of the special magic numbers for {k} is: {v}." for k, v in needles]
    overhead += sum(len(codec.encode(s)[0]) for s in sentences)
    budget = max(context_tokens - overhead, 16)

    haystack = _haystack(codec, rng, budget, sentences)

    context_text = before + INSTRUCTION + haystack
    context_ids, spans = codec.encode(context_text)
    context_tensor = torch.tensor(context_ids, dtype=torch.long)
    samples = []
    for asked_key, question_text in zip(asked, question_texts, strict=True):
        answers = [v for k, v in needles if k == asked_key]
        needle_spans = []
        for answer in answers:
            start = context_text.index(f" is: {answer}.") + len(" is: ")
            end = start + len(answer)
            needle_spans.append([i for i, (a, b) in enumerate(spans) if a < end and b > start])
        first = min(s[0] for s in needle_spans)
        samples.append(
            Sample(
                task=task,
                context_ids=context_tensor,
                question_ids=torch.tensor(codec.encode(question_text)[0], dtype=torch.long),
                answers=answers,
                needle_spans=needle_spans,
                depth=first / max(len(context_ids), 1),
            )
        )
    return samples


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
    sentence = lambda k, v: f" One of the special magic numbers for {k} is: {v}."
    overhead = len(codec.encode(INSTRUCTION + question)[0]) + 24 * (turns + 1)
    overhead += sum(len(codec.encode(sentence(k, v))[0]) for k, v in needles)
    budget = max((context_tokens - overhead) // turns, 16)
    messages, ends = [], []
    for index, (k, v) in enumerate(needles):
        text = _haystack(codec, rng, budget, [sentence(k, v)])
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
    start = context_text.index(f" is: {answer}.") + len(" is: ")
    span = [i for i, (a, b) in enumerate(spans) if a < start + len(answer) and b > start]
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
    samples (several per context for ``multiquestion``), each numbered by its context."""
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
