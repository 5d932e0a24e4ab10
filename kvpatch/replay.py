"""Finish a prefill whose policy plans every layer at once; for KVzip, reconstruct the context.

KVzip (https://arxiv.org/abs/2505.23416) scores what a compressed cache must keep by asking the
model to repeat its context: after the prefill, the cache still holds everything, and the model
reads a repeat request followed by the context itself, teacher-forced, chunk by chunk. The
largest attention a cached token gets from those queries is its score. Each chunk is attended
over the prefill and then forgotten: nothing of the reconstruction stays in the cache.

A chunk is ``prompt + context[s:e]``: the first chunk's prompt is ``REPEAT_PROMPT``, a later one's
``CONTINUE_PROMPT`` and the last ``overlap`` tokens before ``s``, each closed like a user turn of
the tokenizer's chat template (followed by the assistant's header) or, without a template, by a
newline.
"""

from __future__ import annotations

import torch

from kvpatch import compat
from kvpatch.cache import CompressedDynamicCache, CompressedLayer, ReplayChunk
from kvpatch.policies import Composed, KVzip, Policy
from kvpatch.policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT
from kvpatch.policies.wraps import WrapsScorer


def finish_prefill(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    tokenizer=None,
) -> None:
    """Compress the layers of ``cache`` that wait for the whole prefill (``input_ids``,
    ``attention_mask`` are what was prefilled); runs KVzip's reconstruction first if needed."""
    layers = cache.deferred_layers
    if not layers:
        return
    policy = layers[0].deferred.policy
    if policy.needs_replay:
        scorer = replay_scorer(policy)
        prompts = RepeatPrompts(tokenizer, input_ids.device)
        reconstruct(model, cache, input_ids, attention_mask, prompts, scorer)
    cache.compress_deferred()


def replay_scorer(policy: Policy) -> KVzip:
    """The :class:`KVzip` inside ``policy`` (composed, head-wise, global or spread)."""
    while not isinstance(policy, KVzip):
        if isinstance(policy, Composed):
            policy = policy.tokens
        elif isinstance(policy, WrapsScorer):
            policy = policy.scorer
        else:
            raise ValueError(f"{policy!r} needs a context replay but holds no KVzip scorer")
    return policy


class RepeatPrompts:
    """The token ids that ask for the context again, from a tokenizer."""

    def __init__(self, tokenizer, device):
        if tokenizer is None:
            raise ValueError(
                "kvzip asks the model to repeat its context, which needs the model's tokenizer: "
                "pass it as kvpatch.enable(model, policy, tokenizer=tokenizer) or "
                "kvpatch.prefill(..., tokenizer=tokenizer)"
            )
        encode = lambda text: torch.tensor(
            tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long, device=device
        )
        # encoded once: every chunk of every row uses them
        self.turn_end = encode(_turn_end(tokenizer))
        self._first = torch.cat([encode(REPEAT_PROMPT), self.turn_end])
        self._continue = encode(CONTINUE_PROMPT)

    def first(self) -> torch.Tensor:
        return self._first

    def later(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt before the overlap tokens, and the turn end after them."""
        return self._continue, self.turn_end


def _turn_end(tokenizer) -> str:
    """What the chat template puts after a user message, up to the assistant's first token."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    marker = "\x00KVPATCH\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    return text.partition(marker)[2]


@torch.no_grad()
def reconstruct(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompts: RepeatPrompts,
    scorer: KVzip,
    start: int = 0,
) -> None:
    """Run the reconstruction of ``input_ids[:, start:]`` through ``cache``, whose layers hold
    ``input_ids`` (``attention_mask`` marks its real tokens): the whole prefill of layers that
    wait for it (``start`` 0) or, for compressed layers, their tail from ``start`` on. Each such
    layer ends up with ``replay_attention`` ``[batch, kv_heads, scored tokens]``."""
    layers = cache.deferred_layers if start == 0 else cache.compressed_layers
    others = [layer for layer in cache.layers if not isinstance(layer, CompressedLayer)]
    mask = attention_mask.bool()
    rows = [ids[real] for ids, real in zip(input_ids, mask, strict=True)]  # each row's own tokens
    lengths = mask.sum(-1, keepdim=True)  # the position of each row's first new token
    firsts = mask[:, :start].sum(-1).tolist()  # where each row's scored tokens begin
    argument = compat.cache_argument(model)
    longest = max(len(row) - first for row, first in zip(rows, firsts, strict=True))
    for offset in range(0, longest, scorer.chunk_size):
        starts = [first + offset for first in firsts]
        ids, valid = _chunk_batch(prompts, rows, starts, scorer.chunk_size, scorer.overlap)
        positions = lengths + valid.long().cumsum(-1) - 1
        chunk = ReplayChunk(query_valid=valid, prefill_valid=mask)
        saved = [dict(layer.__dict__) for layer in others]  # sliding layers: restored below
        for layer in layers:
            layer.replay = chunk
        try:
            model(
                ids,
                attention_mask=torch.cat([attention_mask, valid.long()], dim=-1),
                position_ids=positions.clamp(min=0),
                use_cache=True,
                logits_to_keep=1,
                **{argument: cache},
            )
        finally:
            for layer in layers:
                layer.replay = None
            for layer, state in zip(others, saved, strict=True):
                layer.__dict__.clear()
                layer.__dict__.update(state)
    missing = [layer for layer in layers if layer.replay_attention is None]
    if missing:
        raise RuntimeError("the context reconstruction did not reach every compressed layer")


def _chunk_batch(
    prompts: RepeatPrompts, rows: list[torch.Tensor], starts: list[int], size: int, overlap: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, n]`` ids and validity of one reconstruction chunk: for every row, its prompt and
    its real tokens ``[start, start + size)``, left-padded to the longest row (a row whose tokens
    ran out gets only padding), so that each row reads what it would alone."""
    pieces = []
    for tokens, start in zip(rows, starts, strict=True):
        if start >= tokens.shape[0]:
            pieces.append(tokens[:0])
            continue
        chunk = tokens[start : start + size]
        if start == 0 or overlap == 0:
            prompt = prompts.first()
        else:
            before, after = prompts.later()
            prompt = torch.cat([before, tokens[max(start - overlap, 0) : start], after])
        pieces.append(torch.cat([prompt, chunk]))
    width = max(piece.shape[0] for piece in pieces)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=rows[0].device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=rows[0].device)
    for row, piece in enumerate(pieces):
        if piece.shape[0]:
            ids[row, -piece.shape[0] :] = piece
            valid[row, -piece.shape[0] :] = True
    return ids, valid
