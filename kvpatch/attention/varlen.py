"""Decode attention over variable-length packed heads in one kernel call per layer.

Each (batch row, KV head) of the packed block is one sequence of a variable-length attention
kernel, the group's query heads (and query positions) folded into that sequence's queries: the
keys and values are read where they lie (``[total_kept, channels]``, one head each), and one call
serves every row and head, however many there are. The kernel also gives each query's
log-sum-exp, with which the packed part is merged with the full-width tail's (appended tokens,
one batched product): ``out = (e^a o_packed + e^b o_tail) / (e^a + e^b)``.

The kernel is torch's FlashAttention-2 ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10,
CUDA, fp16/bf16): :data:`KERNELS` names it per device type. :func:`reference_varlen` computes the
same in plain torch, one sequence at a time, to test this module on a CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from kvpatch.cache.packed import PackedKV, gather_channels

try:  # torch >= 2.10
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
except ImportError:  # older torch: the per-segment path serves
    AuxRequest, varlen_attn = None, None

#: the variable-length kernel of each device type, and the dtypes it takes
KERNELS: dict[str, Callable] = {"cuda": varlen_attn} if varlen_attn is not None else {}
DTYPES: dict[str, tuple[torch.dtype, ...]] = {"cuda": (torch.float16, torch.bfloat16)}


#: FlashAttention-2 reads queries, keys and values of one width, a multiple of 8 up to 256
MAX_WIDTH = 256


def kernel_for(query: torch.Tensor, packed: PackedKV) -> Callable | None:
    """The kernel that serves ``query``'s device and dtype and ``packed``'s widths (its kept
    key and value channels), or None."""
    kernel = KERNELS.get(query.device.type)
    dtypes = DTYPES.get(query.device.type, ())
    if kernel is None or query.dtype not in dtypes:
        return None
    keys = packed.head_dim if packed.channels is None else packed.channels.shape[-1]
    values = packed.value_dim if packed.value_channels is None else packed.value_channels.shape[-1]
    if keys != values or keys % 8 or keys > MAX_WIDTH:
        return None
    return kernel


def packed_part(
    packed: PackedKV, grouped: torch.Tensor, kernel: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the scaled ``grouped`` queries ``[batch, kv_heads, rows, dim]`` over each
    head's packed tokens, in one call of ``kernel``: the output ``[batch, kv_heads, rows,
    value_dim]`` (zeros in pruned value channels) and the log-sum-exp ``[batch, kv_heads, rows]``
    (fp32; -inf for a head that holds nothing)."""
    b, h, rows, _ = grouped.shape
    queries = gather_channels(grouped, packed.channels)  # each head's kept key channels
    keys, values = packed.rows()
    sequences = b * h
    as_int = dict(dtype=torch.int32, device=grouped.device)
    cu_seq_q = torch.arange(0, (sequences + 1) * rows, rows, **as_int)
    cu_seq_k = torch.zeros(sequences + 1, **as_int)
    cu_seq_k[1:] = packed.lengths.flatten().cumsum(0)
    output, lse = kernel(
        queries.reshape(sequences * rows, 1, -1),
        keys[:, None, :],
        values[:, None, :],
        cu_seq_q,
        cu_seq_k,
        rows,
        max(packed.max_length, 1),
        return_aux=AuxRequest(lse=True) if AuxRequest is not None else _Lse(),
        scale=1.0,  # the queries are scaled
    )
    output = output.view(b, h, rows, -1)
    if packed.value_channels is not None:
        full = output.new_zeros(b, h, rows, packed.value_dim)
        index = packed.value_channels[:, :, None, :].expand_as(output)
        output = full.scatter_(-1, index, output)
    # one query head per sequence: (T_q, 1) and (1, T_q) alike; a head holding nothing gets
    # -inf whatever the kernel says of an empty sequence (FlashAttention writes +inf)
    lse = lse.float().reshape(b, h, rows)
    held = (packed.lengths > 0)[..., None]
    return output.masked_fill(~held[..., None], 0), lse.masked_fill(~held, -torch.inf)


def refused(device_type: str, error: Exception) -> None:
    """The kernel failed on this device (a GPU FlashAttention-2 does not run on, say): warn
    once, and let the batched reading serve from now on."""
    KERNELS.pop(device_type, None)
    warnings.warn(
        f"kvpatch: the variable-length attention kernel failed on {device_type} ({error}); "
        "decode steps read the packed heads from a padded copy instead",
        RuntimeWarning,
        stacklevel=2,
    )


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """One softmax over several parts' keys, from each part's normalised output and
    log-sum-exp: ``sum_i e^{lse_i} out_i / sum_i e^{lse_i}``, in fp32."""
    top = torch.stack([lse for _, lse in parts]).amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total, output = None, None
    for part, lse in parts:
        weight = (lse - top).exp()[..., None]
        weighted = part.float() * weight
        output = weighted if output is None else output + weighted
        total = weight if total is None else total + weight
    return (output / total).to(dtype)


class _Lse:
    """What :func:`reference_varlen` reads of ``return_aux`` where torch has no ``AuxRequest``."""

    lse = True


def reference_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux=None,
    scale: float | None = None,
    **unused,
):
    """``varlen_attn`` (full attention, no window) in plain torch, one sequence at a time, fp32
    softmax: the output ``[T_q, heads, value_dim]`` in the query's dtype and, if asked, the
    log-sum-exp ``[T_q, heads]`` (-inf for a query whose sequence has no key)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    heads, group = query.shape[1], query.shape[1] // key.shape[1]
    output = query.new_zeros(query.shape[0], heads, value.shape[-1])
    lse = torch.full((query.shape[0], heads), -torch.inf, device=query.device)
    q_bounds, k_bounds = cu_seq_q.tolist(), cu_seq_k.tolist()
    for sequence in range(len(q_bounds) - 1):
        (q_start, q_end), (k_start, k_end) = (
            q_bounds[sequence : sequence + 2],
            k_bounds[sequence : sequence + 2],
        )
        if k_end == k_start or q_end == q_start:
            continue
        q = query[q_start:q_end].transpose(0, 1).float()  # [heads, q, dim]
        k = key[k_start:k_end].repeat_interleave(group, dim=1).transpose(0, 1).float()
        v = value[k_start:k_end].repeat_interleave(group, dim=1).transpose(0, 1).float()
        scores = (q @ k.transpose(-1, -2)) * scale
        lse[q_start:q_end] = scores.logsumexp(-1).transpose(0, 1)
        output[q_start:q_end] = (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
    if return_aux is not None and return_aux.lse:
        return output, lse
    return output
