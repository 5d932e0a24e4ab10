"""Finish a prefill whose policy plans every layer at once; first run the reconstruction the
policy declares, if any (:class:`~kvpatch.policies.Reconstruction`).

A reconstruction scores what a compressed cache must keep by asking the model to repeat its
context: after the prefill, the cache still holds everything, and the model reads a repeat
request followed by the context itself, teacher-forced, chunk by chunk. The largest attention a
cached token gets from those queries is its score. Each chunk is attended over the prefill and
then forgotten: nothing of the reconstruction stays in the cache.

A chunk is ``prompt + context[s:e]``: the first chunk's prompt is the reconstruction's
``first_prompt``, a later one's ``continue_prompt`` and the last ``overlap`` tokens before ``s``,
each closed like a user turn of the tokenizer's chat template (followed by the assistant's header)
or, without a template, by a newline. Scored locally (``local``), a chunk's queries are normalised
over the sinks, ``context[s:e]`` and the chunk itself (:class:`~kvpatch.cache.LocalColumns`).
"""

from __future__ import annotations

import torch

from kvpatch import compat
from kvpatch.cache import CompressedDynamicCache, CompressedLayer, LocalColumns, ReconstructionChunk
from kvpatch.policies import Reconstruction, reconstruction_of


def finish_prefill(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    tokenizer=None,
) -> None:
    """Compress the layers of ``cache`` that wait for the whole prefill (``input_ids``,
    ``attention_mask`` are what was prefilled); runs the policy's reconstruction first if it
    declares one."""
    layers = cache.deferred_layers
    if not layers:
        return
    policy = layers[0].deferred.policy
    declared = reconstruction_of(policy)
    if declared is not None:
        prompts = Prompts(tokenizer, declared, input_ids.device, policy.name)
        reconstruct(model, cache, input_ids, attention_mask, prompts, declared)
    cache.compress_deferred()


class Prompts:
    """The token ids that ask for the context again, from a tokenizer."""

    def __init__(self, tokenizer, declared: Reconstruction, device, policy_name: str):
        if tokenizer is None:
            raise ValueError(
                f"{policy_name} asks the model to repeat its context, which needs the model's "
                "tokenizer: pass it as kvpatch.enable(model, policy, tokenizer=tokenizer) or "
                "kvpatch.prefill(..., tokenizer=tokenizer)"
            )
        encode = lambda text: torch.tensor(
            tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long, device=device
        )
        # encoded once: every chunk of every row uses them
        self.turn_end = encode(_turn_end(tokenizer))
        self._first = torch.cat([encode(declared.first_prompt), self.turn_end])
        self._continue = encode(declared.continue_prompt)

    def first(self) -> torch.Tensor:
        return self._first

    def later(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt before the overlap tokens, and the turn end after them."""
        return self._continue, self.turn_end


_MARKER = "\x00KVPATCH\x00"


def _around_user_message(tokenizer, add_generation_prompt: bool) -> tuple[str, str]:
    """What the chat template puts before and after a user message."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARKER}],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    before, _, after = text.partition(_MARKER)
    return before, after


def _turn_end(tokenizer) -> str:
    """What the chat template puts after a user message, up to the assistant's first token."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    return _around_user_message(tokenizer, add_generation_prompt=True)[1]


def system_prefix_length(tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading real tokens every row shares with the chat template's preamble (its
    system prompt and the user turn's header), the sinks a rendered conversation keeps; 0 without
    a tokenizer or a template, or for a context that does not start with it."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return 0
    try:
        preamble = _around_user_message(tokenizer, add_generation_prompt=False)[0]
    except Exception:  # a template that cannot render a lone user turn has no preamble to keep
        return 0
    ids = tokenizer(preamble, add_special_tokens=False)["input_ids"]
    if not ids:
        return 0
    preamble_ids = torch.tensor(ids, dtype=torch.long, device=input_ids.device)
    shared = []
    for row, real in zip(input_ids, attention_mask.bool(), strict=True):
        tokens = row[real][: preamble_ids.shape[0]]
        same = (tokens == preamble_ids[: tokens.shape[0]]).long().cumprod(0)
        shared.append(int(same.sum()))
    return min(shared)


@torch.no_grad()
def reconstruct(
    model: torch.nn.Module,
    cache: CompressedDynamicCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompts: Prompts,
    declared: Reconstruction,
    start: int = 0,
) -> None:
    """Run the reconstruction of ``input_ids[:, start:]`` through ``cache``, whose layers hold
    ``input_ids`` (``attention_mask`` marks its real tokens): the whole prefill of layers that
    wait for it (``start`` 0) or, for compressed layers, their tail from ``start`` on. Each such
    layer ends up with ``reconstruction_scores`` ``[batch, kv_heads, scored tokens]``."""
    layers = cache.deferred_layers if start == 0 else cache.stored_layers
    others = [layer for layer in cache.layers if not isinstance(layer, CompressedLayer)]
    mask = attention_mask.bool()
    rows = [ids[real] for ids, real in zip(input_ids, mask, strict=True)]  # each row's own tokens
    lengths = mask.sum(-1, keepdim=True)  # the position of each row's first new token
    firsts = mask[:, :start].sum(-1).tolist()  # where each row's scored tokens begin
    longest = max(len(row) - first for row, first in zip(rows, firsts, strict=True))
    local = declared.local and start == 0  # appended turns: over what is held
    sinks = max(declared.sinks, cache.sink_tokens)
    size = declared.chunk_size
    hidden_norms: dict[int, torch.Tensor] = {}
    hooks = _record_hidden_norms(model, hidden_norms) if declared.weighted else []
    try:
        for offset in range(0, longest, size):
            starts = [first + offset for first in firsts]
            ids, valid = _chunk_batch(prompts, rows, starts, size, declared.overlap)
            positions = lengths + valid.long().cumsum(-1) - 1
            chunk = ReconstructionChunk(
                query_valid=valid,
                prefill_valid=mask,
                local=_local_columns(mask, starts, size, sinks, local),
                hidden_norms=hidden_norms if declared.weighted else None,
            )
            _run_chunk(model, cache, layers, others, chunk, ids, positions, attention_mask)
    finally:
        for hook in hooks:
            hook.remove()
    missing = [layer for layer in layers if layer.reconstruction_scores is None]
    if missing:
        raise RuntimeError("the context reconstruction did not reach every compressed layer")


def _local_columns(mask, starts, chunk_size: int, sinks: int, local: bool) -> LocalColumns | None:
    """The columns a chunk's weights are normalised over, where scoring is local to it."""
    return LocalColumns.of_chunk(mask, starts, chunk_size, sinks) if local else None


def _run_chunk(model, cache, layers, others, chunk, ids, positions, attention_mask) -> None:
    """One reconstruction forward through ``cache``; nothing of it stays in any layer."""
    saved = [dict(layer.__dict__) for layer in others]  # sliding layers: restored below
    for layer in layers:
        layer.begin_reconstruction(chunk)
    try:
        model(
            ids,
            attention_mask=torch.cat([attention_mask, chunk.query_valid.long()], dim=-1),
            position_ids=positions.clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
            **{compat.cache_argument(model): cache},
        )
    finally:
        for layer in layers:
            layer.end_reconstruction()
        for layer, state in zip(others, saved, strict=True):
            layer.__dict__.clear()
            layer.__dict__.update(state)


def _record_hidden_norms(model: torch.nn.Module, norms: dict[int, torch.Tensor]) -> list:
    """Hooks that store, per layer index, the norm of each query's hidden state ``[batch, q]``
    as the attention module reads it (a weighted reconstruction divides by it)."""

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        norms[module.layer_idx] = hidden.float().norm(dim=-1)

    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not modules:
        raise ValueError(
            "a weighted reconstruction weighs each token by the attention's output projection "
            f"(o_proj), which {type(model).__name__}'s attention modules do not have; use a "
            "policy that does not weigh its scores"
        )
    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]


def _chunk_batch(
    prompts: Prompts, rows: list[torch.Tensor], starts: list[int], size: int, overlap: int
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
