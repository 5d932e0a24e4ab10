"""Text to token ids and back: a Hugging Face tokenizer, or bytes for tiny random models."""

from __future__ import annotations

from kvpatch.chat import render, split_turn


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
        """``messages`` (``{"role", "content"}``) as text: plain ``Role: text`` turns."""
        return render(None, messages, add_generation_prompt)


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
        return split_turn(self.tokenizer)

    def conversation(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template (plain turns without one)."""
        return render(self.tokenizer, messages, add_generation_prompt)


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
