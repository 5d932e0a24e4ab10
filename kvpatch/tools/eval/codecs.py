"""Text to token ids and back: a Hugging Face tokenizer, or bytes for tiny random models.

A codec also says how prompts are laid out, its *prompt format*: ``chat`` wraps the context and
the question in the tokenizer's chat template (an instruction-tuned model); ``completion`` is
plain text, the question followed by the start of the answer for the model to complete (a base
model, or any tokenizer without a chat template), after the BOS token the tokenizer would add.
"""

from __future__ import annotations

from kvpatch.chat import bos_text, render, split_turn
from kvpatch.tools.eval.options import PROMPT_FORMATS


class Codec:
    """Text to token ids and back, with the character span of every token."""

    eos_token_id: int | None = None
    prompt_format: str = "completion"

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def wrap(self, user_text: str) -> tuple[str, str]:
        """Text before and after ``user_text`` (a chat template's turn markers, or nothing)."""
        return "", ""

    def conversation(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """``messages`` (``{"role", "content"}``) as text: plain ``Role: text`` turns."""
        return render(None, messages, add_generation_prompt)


def resolve_prompt_format(tokenizer, prompt_format: str | None) -> str:
    """``prompt_format``, or (None) ``chat`` if the tokenizer has a chat template and
    ``completion`` otherwise; a ValueError for an unknown format or a chat without a template."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format is None:
        return "chat" if has_template else "completion"
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(
            f"unknown prompt format {prompt_format!r}; prompt formats: {', '.join(PROMPT_FORMATS)}"
        )
    if prompt_format == "chat" and not has_template:
        raise ValueError(
            "the tokenizer has no chat template: use the prompt format 'completion' (chosen by "
            "default for such a tokenizer)"
        )
    return prompt_format


class HFCodec(Codec):
    """A Hugging Face (fast) tokenizer.

    Parameters
    ----------
    tokenizer : the model's tokenizer.
    prompt_format : ``chat`` (through its chat template) or ``completion`` (plain text after the
        BOS token it would add); None picks ``chat`` when it has a chat template.
    """

    def __init__(self, tokenizer, prompt_format: str | None = None):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.prompt_format = resolve_prompt_format(tokenizer, prompt_format)
        # the text is encoded without special tokens (each piece on its own), so the prompt's
        # BOS is written out in the completion format; a chat template writes its own
        self.start = bos_text(tokenizer) if self.prompt_format == "completion" else ""

    def encode(self, text: str):
        out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def wrap(self, user_text: str) -> tuple[str, str]:
        if self.prompt_format == "completion":
            return self.start, ""
        return split_turn(self.tokenizer)

    def conversation(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template, or plain ``Role: text`` turns in the completion format."""
        if self.prompt_format == "completion":
            return self.start + render(None, messages, add_generation_prompt)
        return render(self.tokenizer, messages, add_generation_prompt)


class ByteCodec(Codec):
    """One token per byte (ids 0-255): for tiny random models, which need no tokenizer.

    Callable like a tokenizer without a chat template, for what needs one (a reconstruction's
    prompt).
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
