"""A multi-turn chat on one compressed cache that keeps compressing as the history grows.

>>> chat = kvpatch.ChatSession(model, tokenizer, policy="keydiff:0.5")
>>> chat.ask("Here is my contract: ... What is the notice period?")
>>> chat.ask("And who signs it?")          # the first turn is held compressed, not re-read
>>> print(chat.stats())

Each turn's text is what the chat template adds for it (the user's message and the assistant's
prefix, then the reply and its end of turn). It is appended to the compressed context with
:meth:`~kvpatch.CompressedContext.extend`, which keeps ``1 - ratio`` of it, so the history held
stays ``1 - ratio`` of the conversation.
"""

from __future__ import annotations

import torch

from kvpatch.cache import check_max_kv_tokens
from kvpatch.context import CompressedContext, prefill
from kvpatch.patching import disable, enable, is_enabled, policy_of
from kvpatch.policies import Policy, parse_policy

#: stands for the text a user turn is split at
_MARKER = "\x00kvpatch-split\x00"


def bos_text(tokenizer) -> str:
    """The BOS token's text if the tokenizer starts every encoded text with it (Gemma's does,
    and a base model is lost without it), else ``""``."""
    bos = getattr(tokenizer, "bos_token", None)
    if bos is None or tokenizer.bos_token_id is None:
        return ""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids[:1] == [tokenizer.bos_token_id] else ""


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """``messages`` as text: the tokenizer's chat template (no turns: no text), or plain
    ``Role: text`` lines after the BOS token the tokenizer would add (the text is encoded
    without special tokens, as a template's is)."""
    if getattr(tokenizer, "chat_template", None):
        if not messages:
            return ""
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    if not messages and not add_generation_prompt:
        return ""
    text = "".join(f"{m['role'].title()}: {m['content']}\n" for m in messages)
    return bos_text(tokenizer) + text + ("Assistant:" if add_generation_prompt else "")


def split_turn(tokenizer, head: str = "") -> tuple[str, str]:
    """The chat template's text of one user turn (and the assistant's prefix) before and after
    the point just past ``head``: ``("<user marker>" + head, "<end of turn><assistant marker>")``;
    ``("", "")`` without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    messages = [{"role": "user", "content": head + _MARKER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    before, _, after = text.partition(_MARKER)
    return before, after


class ChatSession:
    """A conversation with ``model`` whose history lives in a compressed cache.

    Parameters
    ----------
    model, tokenizer : a causal LM and its tokenizer.
    policy : what to keep of each turn (the model is enabled with it; a model already enabled
        keeps its own policy unless one is given).
    max_kv_tokens : a history at constant memory: every turn is kept whole, and once the history
        holds more than this many tokens per head the older turns are compressed back to it with
        ``policy`` (scored by the newest turn), instead of each turn at the policy's ratio.
    generate_kwargs : passed to every ``generate`` (``max_new_tokens``, ``do_sample``, ...).
    """

    def __init__(
        self,
        model,
        tokenizer,
        policy: str | Policy | None = None,
        max_kv_tokens: int | None = None,
        **generate_kwargs,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_kv_tokens = max_kv_tokens  # checked with the policy by set_policy
        self.generate_kwargs = {"max_new_tokens": 256, "do_sample": False, **generate_kwargs}
        if self.generate_kwargs.get("pad_token_id") is None:
            self.generate_kwargs["pad_token_id"] = tokenizer.pad_token_id or tokenizer.eos_token_id
        self.messages: list[dict] = []
        self.context: CompressedContext | None = None
        self.set_policy(policy)

    @property
    def policy(self) -> Policy | None:
        return policy_of(self.model)

    def set_policy(self, policy: str | Policy | None) -> None:
        """Compress with ``policy`` from now on; the history so far is prefilled again with it."""
        if policy is None and is_enabled(self.model):
            check_max_kv_tokens(self.max_kv_tokens, self.policy)
            return
        if policy is None:
            raise ValueError("ChatSession needs a policy (e.g. 'keydiff:0.5') or an enabled model")
        parsed = parse_policy(policy)
        check_max_kv_tokens(self.max_kv_tokens, parsed)
        if is_enabled(self.model):
            disable(self.model)
        enable(self.model, parsed, tokenizer=self.tokenizer)
        history, self.context = self.messages, None
        if history:
            self._append(self._ids(render(self.tokenizer, history)))

    def reset(self) -> None:
        """Forget the conversation."""
        self.messages, self.context = [], None

    def ask(self, text: str, streamer=None) -> str:
        """Add the user's ``text``, generate the reply (streamed to ``streamer`` if given) and add
        it to the history; returns the reply."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a chat turn needs some text")
        before = render(self.tokenizer, self.messages)
        self.messages.append({"role": "user", "content": text})
        prompt = render(self.tokenizer, self.messages, add_generation_prompt=True)
        ids = self._ids(self._added(before, prompt))
        self._append(ids[:, :-1])
        last = ids[:, -1:]  # generate is asked with the prompt's last token
        reply_ids = self.context.generate(last, streamer=streamer, **self.generate_kwargs)
        reply = self.tokenizer.decode(reply_ids[0], skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        end = self._ids(self._added(prompt, render(self.tokenizer, self.messages)))
        self._append(torch.cat([last, end], dim=-1))
        return reply

    def stats(self):
        """The compressed history's :class:`~kvpatch.CacheStats` (None before the first turn)."""
        return None if self.context is None else self.context.cache.stats()

    def _added(self, before: str, after: str) -> str:
        if not after.startswith(before):  # a template that rewrites earlier turns
            raise ValueError(
                "this chat template renders earlier turns differently once a turn is added, so "
                "the history cannot be extended turn by turn"
            )
        return after[len(before) :]

    def _ids(self, text: str) -> torch.Tensor:
        encoded = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        return encoded.input_ids.to(self.model.device)

    def _append(self, ids: torch.Tensor) -> None:
        if ids.shape[1] == 0:
            return
        if self.context is None:
            self.context = prefill(self.model, ids, max_kv_tokens=self.max_kv_tokens)
        else:
            self.context = self.context.extend(ids)
