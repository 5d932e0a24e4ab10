"""Attention of a reconstruction chunk (:mod:`kvpatch.feed.reconstruction`), which needs its
weights: each layer records, per scored token and KV head, the largest weight any query of the
head's GQA group gives it.

- :func:`score_locally` (a ``local`` reconstruction): the stock kernel computes the output; the
  weights are a softmax over the sinks, the context tokens the chunk repeats and the chunk
  itself, a few queries at a time.
- :func:`attend` (over the whole context, and turns appended to a compressed context): output and
  weights over everything held, in fp32, a few queries at a time.

For a ``weighted`` reconstruction each weight is multiplied by ``||W_o[g] v||``
(:func:`output_norms`) and divided by the norm of the query's hidden state.
"""

from __future__ import annotations

import math

import torch

from kvpatch.attention.kernels import workspace_elements
from kvpatch.cache import ReconstructionRequest

#: fp32 weights :func:`score_locally` computes at a time on a CPU (8 MiB; on a GPU a share of its
#: free memory, :func:`~kvpatch.attention.kernels.workspace_elements`)
LOCAL_SCORE_ELEMENTS = 1 << 21
#: fp32 weights :func:`attend` computes at a time on a CPU (4 MiB, plus as much for their scores)
ATTEND_ELEMENTS = 1 << 20


def attend(
    module, query, key, value, request: ReconstructionRequest, scaling: float, softcap: float | None
) -> tuple[torch.Tensor, None]:
    """Exact attention of a reconstruction chunk over what the layer holds and the chunk, in
    fp32, normalised over all of it; records the scores and returns the output. A few queries
    at a time: at most :data:`ATTEND_ELEMENTS` weights (and as many scores) exist at once, so
    the workspace does not grow with the context (as long as one query's row fits)."""
    batch, kv_heads, total, dim = key.shape
    q_heads, q_len = query.shape[1], query.shape[2]
    group, held = q_heads // kv_heads, total - q_len
    chunk, first_scored = request.chunk, request.scored_from
    queries = (query.float() * scaling).view(batch, kv_heads, group, q_len, dim)
    keys, values = key.float().transpose(-1, -2), value.float()
    if chunk.hidden_norms is not None:  # weighted: ||W_o[g] v|| over the queries' ||h||
        value_norms = output_norms(module, values[:, :, first_scored:held], group)[..., None, :]
        hidden = chunk.hidden_norms[module.layer_idx].clamp(min=1e-6)[:, None, None, :, None]
    held_visible = request.held_valid[:, :, None, :]  # [b, 1 or kv_heads, 1, held]
    output = values.new_empty(batch, kv_heads, group, q_len, values.shape[-1])
    best = None
    budget = workspace_elements(query.device, ATTEND_ELEMENTS)
    rows = max(1, budget // (batch * kv_heads * group * total))
    # two flat workspaces, reused by every block and layer of the chunk
    size = (batch * kv_heads * group * min(rows, q_len) * total,)
    score_space, weight_space = chunk.buffer("s", size, key), chunk.buffer("w", size, key)
    for first in range(0, q_len, rows):
        last = min(first + rows, q_len)
        shape = (batch, kv_heads, group, last - first, total)
        block = queries[:, :, :, first:last].reshape(batch, kv_heads, -1, dim)
        scores = _workspace(score_space, shape)
        torch.matmul(block, keys, out=scores.view(batch, kv_heads, -1, total))
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        real = chunk.query_valid[:, None, first:last, None]  # [b, 1, n, 1]
        visible = torch.cat(  # a padding query sees only itself
            [
                (held_visible & real).expand(-1, -1, last - first, -1),
                chunk.chunk_visible[:, None, first:last].expand(-1, held_visible.shape[1], -1, -1),
            ],
            dim=-1,
        )
        scores.masked_fill_(~visible[:, :, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1, out=_workspace(weight_space, shape))
        scored = weights[..., first_scored:held]
        if chunk.hidden_norms is not None:
            scored = scored * value_norms / hidden[:, :, :, first:last]
        block_best = scored.amax(dim=(2, 3))
        best = block_best if best is None else best.maximum(block_best)
        output[:, :, :, first:last] = weights @ values[:, :, None]
    request.layer.record_reconstruction_scores(best)
    output = output.reshape(batch, q_heads, q_len, -1).transpose(1, 2).contiguous()
    return output.to(query.dtype), None


def score_locally(
    module, query, key, value, request: ReconstructionRequest, scaling: float, softcap: float | None
) -> None:
    """Record the scores of a waiting prefill, scored locally: each query's
    softmax over the chunk's :class:`~kvpatch.cache.LocalColumns` and the chunk's own keys, max
    over the GQA group and the chunk's real queries (0 for tokens outside the chunk).
    ``key``/``value`` are the held prefill then the chunk. At most
    :data:`LOCAL_SCORE_ELEMENTS` fp32 weights exist at once."""
    chunk = request.chunk
    batch, kv_heads, total, dim = key.shape
    q_len = query.shape[2]
    group, held = query.shape[1] // kv_heads, total - q_len
    index = chunk.local.index
    columns = index.shape[1]

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        where = index[:, None, :, None].expand(batch, kv_heads, columns, tensor.shape[-1])
        return tensor[:, :, :held].gather(2, where).float()

    keys = torch.cat([gather(key), key[:, :, held:].float()], dim=2).transpose(-1, -2)
    queries = (query.float() * scaling).view(batch, kv_heads, group, q_len, dim)
    if chunk.hidden_norms is not None:  # weighted: ||W_o[g] v|| over the queries' ||h||
        value_norms = output_norms(module, gather(value), group)[..., None, :]
        hidden = chunk.hidden_norms[module.layer_idx].clamp(min=1e-6)[:, None, None, :, None]
    best = keys.new_zeros(batch, kv_heads, columns)
    budget = workspace_elements(query.device, LOCAL_SCORE_ELEMENTS)
    rows = max(1, budget // (batch * kv_heads * group * keys.shape[-1]))
    for first in range(0, q_len, rows):
        last = min(first + rows, q_len)
        # one matmul per KV head (einsum is about three times slower here on the CPU)
        block = queries[:, :, :, first:last].reshape(batch, kv_heads, -1, dim)
        scores = (block @ keys).view(batch, kv_heads, group, last - first, -1)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        scores += chunk.local_bias[:, :, :, first:last]
        weights = scores.softmax(-1)[..., :columns]
        if chunk.hidden_norms is not None:
            weights = weights * value_norms / hidden[:, :, :, first:last]
        best = best.maximum(weights.amax(dim=(2, 3)))
    full = best.new_zeros(batch, kv_heads, held)
    spread = index[:, None, :].expand(-1, kv_heads, -1)
    request.layer.record_reconstruction_scores(full.scatter_reduce_(2, spread, best, reduce="amax"))


def _workspace(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first ``prod(shape)`` elements of ``flat`` as a contiguous ``shape``."""
    return flat[: math.prod(shape)].view(shape)


def output_norms(module: torch.nn.Module, values: torch.Tensor, group: int) -> torch.Tensor:
    """``||W_o[g] v||`` for every query head ``g`` of each KV head's group, ``[batch, kv_heads,
    group, tokens]``: what a token's value ``values`` ``[batch, kv_heads, tokens, dim]`` adds to
    the layer's output through each head's slice of the output projection, as
    ``sqrt(v^T W_o[g]^T W_o[g] v)`` (a ``dim x dim`` product per head, not ``hidden`` wide)."""
    kv_heads, dim = values.shape[1], values.shape[-1]
    weight = module.o_proj.weight.float()  # [hidden, heads * dim]
    slices = weight.view(weight.shape[0], kv_heads, group, dim).permute(1, 2, 3, 0)
    gram = slices @ slices.transpose(-1, -2)  # [kv_heads, group, dim, dim]
    squared = torch.einsum("bhtd,hgde,bhte->bhgt", values, gram, values)
    return squared.clamp(min=0).sqrt()
