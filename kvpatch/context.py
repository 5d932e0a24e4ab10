"""Compress once, ask many: prefill a long context once, then answer questions on copies of it.

>>> kvpatch.enable(model, "snapkv:0.75")
>>> context = kvpatch.prefill(model, context_ids)          # one forward over the context
>>> answer = context.generate(question_ids, max_new_tokens=32)
>>> answers = context.generate_many([q1_ids, q2_ids, q3_ids], max_new_tokens=32)

The context is compressed *before* any question is seen (question-agnostic compression). A
question's tokens are appended as one causal chunk after the compressed context: ``generate``
runs on a copy of the compressed cache, ``generate_many`` answers all its questions in one batch
that reads the context where it is, each row appending to a tail of its own.

A conversation grows turn by turn: :meth:`CompressedContext.extend` appends a turn and compresses
it too, so a long chat holds ``1 - ratio`` of its history.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvpatch import checks, compat, saving
from kvpatch.cache import CompressedDynamicCache, check_chunk_size
from kvpatch.cache.shared_context import can_share, share_context
from kvpatch.feed import (
    append_within_budget,
    compress_appended,
    keep_system_prefix,
    prefill_into,
)
from kvpatch.patching import expand_for_generate, is_enabled, policy_of, tokenizer_of
from kvpatch.policies import Policy


@dataclass
class CompressedContext:
    """A context prefilled into a compressed cache.

    Attributes
    ----------
    model : the (enabled) model that prefilled it.
    input_ids : ``[batch, context_tokens]`` context token ids.
    attention_mask : ``[batch, context_tokens]`` padding mask (1 for real tokens).
    cache : the compressed cache after the context; never modified by :meth:`generate`.
    logits : ``[batch, 1, vocab]``, the model's logits after the context's last token.
    """

    model: torch.nn.Module
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    cache: CompressedDynamicCache
    logits: torch.Tensor | None = None

    def save(self, path, /, **extra: str) -> None:
        """Write this context to ``path`` (:func:`load_context` reads it back, in any process,
        for the same model): the tensors held, in safetensors, and a header checked on loading.
        ``extra`` strings are kept in the header."""
        saving.save(
            path, self.model, self.cache, self.input_ids, self.attention_mask, self.logits, **extra
        )

    def copy_cache(self) -> CompressedDynamicCache:
        """An independent copy of the compressed cache, to continue from."""
        return copy.deepcopy(self.cache)

    def extend(self, ids: torch.Tensor, tokenizer=None) -> CompressedContext:
        """This context followed by ``ids`` (a new turn), compressed with the same policy: of the
        tokens appended since the last compression, ``1 - ratio`` are kept, scored with the
        queries of this forward (or by reconstructing them, for a policy that does). ``self`` is
        unchanged.

        ``ids`` is ``[batch, tokens]`` (or 1-D for a batch of one), all real tokens.
        """
        self._check_enabled()
        ids = self._as_batch(ids, "ids")
        cache = self.copy_cache()
        input_ids = torch.cat([self.input_ids, ids], dim=-1)
        mask = torch.cat([self.attention_mask, torch.ones_like(ids)], dim=-1)
        start = self.input_ids.shape[1]
        get_tokenizer = lambda: tokenizer_of(self.model, tokenizer)
        if cache.max_kv_tokens is not None:  # kept whole, the older history compressed to fit
            logits = append_within_budget(self.model, cache, input_ids, mask, start)
        else:
            logits = compress_appended(self.model, cache, input_ids, mask, start, get_tokenizer)
        return CompressedContext(self.model, input_ids, mask, cache, logits)

    def _check_enabled(self) -> None:
        """Only kvpatch's attention reads a compressed cache: the stock one would fail obscurely
        (its mask spans every position seen, the cache holds fewer)."""
        if not is_enabled(self.model):
            raise ValueError(
                "this context is held in a compressed cache, which only a model enabled with "
                "kvpatch can read, and its model is no longer enabled: call "
                "kvpatch.enable(model) again before asking it"
            )

    def _as_batch(self, ids: torch.Tensor, name: str) -> torch.Tensor:
        ids, _ = checks.token_batch(ids, name=name)
        ids = ids.to(self.input_ids.device)
        if ids.shape[0] != self.input_ids.shape[0]:
            raise ValueError(
                f"the context has batch size {self.input_ids.shape[0]} but the new tokens have "
                f"{ids.shape[0]}"
            )
        return ids

    def generate(self, question_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """``model.generate`` on context + question, reusing a copy of the compressed cache.

        ``question_ids`` is ``[batch, question_tokens]`` (or 1-D for a batch of one). Returns the
        generated tokens only, ``[batch, new_tokens]``.
        """
        self._check_enabled()
        question_ids = self._as_batch(question_ids, "question_ids")
        ids = torch.cat([self.input_ids, question_ids], dim=-1)
        mask = torch.cat([self.attention_mask, torch.ones_like(question_ids)], dim=-1)
        return self._generate_into(self.copy_cache(), ids, mask, generate_kwargs)

    def generate_many(self, questions, **generate_kwargs) -> list[torch.Tensor]:
        """Answer every question of ``questions`` (1-D token id tensors, of any lengths) in one
        batched ``generate``; returns, for each, what :meth:`generate` returns for it alone
        (cut after its end-of-sequence token).

        The compressed context is stored once: every batch row reads it in place and appends its
        question and answer to a tail of its own (on the CPU and CUDA with sdpa; other backends
        read a per-row padded copy of it at each step). A context whose cache has a decode
        budget, assisted decoding and streaming (which transformers runs on one batch row)
        answer one question after another instead.
        """
        self._check_enabled()
        questions = [self._question(q, i) for i, q in enumerate(questions)]
        if not questions:
            return []
        if self.input_ids.shape[0] != 1:
            raise ValueError(
                f"generate_many answers questions about a context of one batch row; this one "
                f"has {self.input_ids.shape[0]}: call generate with a question per row instead"
            )
        if not can_share(self.cache) or _one_row_only(self.model, generate_kwargs):
            return [self.generate(q, **generate_kwargs) for q in questions]
        ids, mask = self._question_batch(questions, _pad_id(self.model, generate_kwargs))
        cache = share_context(self.cache, len(questions))
        answers = self._generate_into(cache, ids, mask, generate_kwargs).chunk(len(questions))
        ends = _end_ids(self.model, generate_kwargs)
        return [_cut_after_end(answer, ends) for answer in answers]

    def _generate_into(self, cache, ids, mask, generate_kwargs: dict) -> torch.Tensor:
        """``model.generate`` on ``ids`` continuing ``cache`` (which holds this context); the
        generated tokens only."""
        expand_for_generate(self.model, cache, generate_kwargs)  # beams, returned sequences
        cache_kwarg = {compat.cache_argument(self.model): cache}
        output = self.model.generate(ids, attention_mask=mask, **cache_kwarg, **generate_kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        return sequences[:, ids.shape[-1] :]

    def _question(self, question: torch.Tensor, index: int) -> torch.Tensor:
        ids, _ = checks.token_batch(question, name=f"question {index}")
        if ids.shape[0] != 1:
            raise ValueError(
                f"question {index} must be the token ids of one question (1-D), got shape "
                f"{tuple(question.shape)}"
            )
        return ids[0].to(self.input_ids.device)

    def _question_batch(self, questions: list[torch.Tensor], pad_id: int):
        """``[questions, context + longest question]`` ids and mask: the context, then each
        question left-padded to the longest (the padding is masked; positions count real
        tokens, so every question starts right after the context)."""
        longest = max(len(q) for q in questions)
        n = len(questions)
        ids = self.input_ids.new_full((n, longest), pad_id)
        mask = self.attention_mask.new_zeros(n, longest)
        for row, question in enumerate(questions):
            ids[row, longest - len(question) :] = question
            mask[row, longest - len(question) :] = 1
        context_ids = self.input_ids.expand(n, -1)
        context_mask = self.attention_mask.expand(n, -1)
        return torch.cat([context_ids, ids], dim=-1), torch.cat([context_mask, mask], dim=-1)


def _one_row_only(model: torch.nn.Module, generate_kwargs: dict) -> bool:
    """Whether ``generate`` refuses a batch of several rows with these settings: assisted
    decoding, a streamer."""
    config = generate_kwargs.get("generation_config") or model.generation_config
    settings = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
    assisted = any(generate_kwargs.get(name) or getattr(config, name, None) for name in settings)
    return assisted or generate_kwargs.get("streamer") is not None


def _pad_id(model: torch.nn.Module, generate_kwargs: dict) -> int:
    config = generate_kwargs.get("generation_config") or model.generation_config
    for candidate in (generate_kwargs.get("pad_token_id"), config.pad_token_id):
        if candidate is not None:
            return int(candidate)
    ends = _end_ids(model, generate_kwargs)
    return min(ends) if ends else 0


def _end_ids(model: torch.nn.Module, generate_kwargs: dict) -> set[int]:
    config = generate_kwargs.get("generation_config") or model.generation_config
    ends = generate_kwargs.get("eos_token_id", config.eos_token_id)
    if ends is None:
        return set()
    if isinstance(ends, torch.Tensor):
        return set(ends.flatten().tolist())
    return {int(ends)} if isinstance(ends, int) else {int(e) for e in ends}


def _cut_after_end(answers: torch.Tensor, ends: set[int]) -> torch.Tensor:
    """``answers`` ``[rows, tokens]`` (one question's returned sequences) up to the step where
    its last row produced an end-of-sequence token, as ``generate`` alone would stop."""
    if not ends or answers.shape[-1] == 0:
        return answers
    is_end = torch.isin(answers, torch.tensor(sorted(ends), device=answers.device))
    steps = torch.where(is_end.any(-1), is_end.int().argmax(-1) + 1, answers.shape[-1])
    return answers[:, : int(steps.max())]


def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    policy: str | Policy | None = None,
    tokenizer=None,
    chunk_size: int | None = None,
    **cache_kwargs,
) -> CompressedContext:
    """Run the context through ``model`` once and compress its cache.

    Parameters
    ----------
    model : a model on which :func:`kvpatch.enable` was called.
    input_ids : ``[batch, tokens]`` context (left-padded for a batch).
    attention_mask : its padding mask; all ones by default.
    policy : overrides the model's policy for this context.
    tokenizer : for a policy that asks the model to repeat the context (defaults to the one
        given to :func:`kvpatch.enable`, or found in the model's checkpoint directory); given
        here, the chat template's preamble (system prompt, user header) a rendered context starts
        with is kept by every policy.
    chunk_size : prefill the context in chunks of this many tokens: after each chunk every
        layer is compressed back to its budget (the policy's share of the real tokens seen so
        far), scored with that chunk's queries, so the KV held never exceeds the budget plus one
        chunk. A left-padded batch's first chunk reaches one real token of every row. Not for a
        policy that reconstructs the whole context.
    cache_kwargs : passed to :class:`~kvpatch.CompressedDynamicCache` (e.g. ``decode_budget``).
    """
    if not is_enabled(model):
        raise ValueError("kvpatch.prefill needs kvpatch.enable(model, policy) first")
    input_ids, attention_mask = checks.token_batch(input_ids, attention_mask)
    checks.no_empty_rows(attention_mask)
    cache = CompressedDynamicCache(config=model.config, policy=policy, **cache_kwargs)
    in_force = cache.policy if cache.policy is not None else policy_of(model)
    check_chunk_size(chunk_size, in_force)
    if tokenizer is not None:  # given for this context: its chat template's preamble is kept
        keep_system_prefix(cache, tokenizer, input_ids, attention_mask, in_force)
    get_tokenizer = lambda: tokenizer_of(model, tokenizer)
    logits = prefill_into(model, cache, input_ids, attention_mask, get_tokenizer, chunk_size)
    return CompressedContext(model, input_ids, attention_mask, cache, logits)


def load_context(model: torch.nn.Module, path) -> CompressedContext:
    """The context :meth:`CompressedContext.save` wrote to ``path``, for ``model`` (enabled with
    :func:`kvpatch.enable`; the same config, weights and dtype as the model that saved it, or a
    ValueError naming the difference). Answers are those of the context before it was saved."""
    if not is_enabled(model):
        raise ValueError("kvpatch.load_context needs kvpatch.enable(model) first")
    cache, input_ids, attention_mask, logits = saving.load(model, path)
    return CompressedContext(model, input_ids, attention_mask, cache, logits)
