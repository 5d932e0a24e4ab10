"""Fake keys: padding for short heads that stock attention kernels give exactly zero weight.

A head that holds fewer tokens than the longest head of its layer is padded, in the dense view,
with a key ``k`` such that every current query ``q`` of its GQA group scores
``scaling * <q, k>`` at least :data:`MARGIN` below any real key's possible score. Softmax then
gives the slot ``exp(-MARGIN) == 0`` weight in fp32, and its value (zero) adds nothing.

``k`` is a multiple of a direction ``u`` with ``<q, u> < 0`` for every query: a hyperplane that
separates the group's queries from the origin. For at most ``head_dim`` queries in general position
the minimum-norm solution of ``<q_i/|q_i|, u> = -1`` is one; for more queries a least-squares fit
usually is. Where no such ``u`` is found, or the key would overflow the dtype, the head is reported
as failed and the caller must mask it explicitly.
"""

from __future__ import annotations

import torch

#: score gap under which fp32 ``exp`` underflows to exactly zero
#: (e**-103.3 is the smallest subnormal)
MARGIN = 120.0
#: largest magnitude a fake score may reach, safely inside fp16's range (65504)
MAX_SCORE = 3.0e4
_RIDGE = 1e-4
#: a shortcut direction is kept if every query sits at least this cosine inside its half-space
_GOOD_ENOUGH = 0.1


def separating_direction(queries: torch.Tensor) -> torch.Tensor:
    """A direction ``u`` with ``<q, u> < 0`` for (ideally) all rows ``q``.

    ``queries`` is ``[..., n, dim]`` in fp32; returns ``[..., dim]``.
    """
    unit = queries / queries.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    # the queries of one GQA group usually share a half-space: their mean is a cheap answer
    mean = -unit.mean(dim=-2)
    cosines = unit @ (mean / mean.norm(dim=-1, keepdim=True).clamp_min(1e-12)).unsqueeze(-1)
    if bool((cosines < -_GOOD_ENOUGH).all()):
        return mean
    n, dim = unit.shape[-2:]
    ones = unit.new_ones(*unit.shape[:-1], 1)
    if n <= dim:
        gram = unit @ unit.transpose(-1, -2)
        eye = torch.eye(n, device=unit.device)
        weights = torch.linalg.solve(gram + _RIDGE * eye, ones)
        direction = unit.transpose(-1, -2) @ weights
    else:
        gram = unit.transpose(-1, -2) @ unit
        eye = torch.eye(dim, device=unit.device)
        direction = torch.linalg.solve(gram + _RIDGE * eye, unit.transpose(-1, -2) @ ones)
    return -direction.squeeze(-1)


def fake_keys(
    queries: torch.Tensor, key_norm_bound: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fake key per (batch row, KV head).

    Parameters
    ----------
    queries : ``[batch, kv_heads, n, dim]``, the queries of each KV head's group.
    key_norm_bound : ``[batch, kv_heads]``, the largest norm of a real key of that head.
    scaling : softmax scale applied to ``<q, k>``.
    dtype : dtype the keys are stored in.

    Returns
    -------
    keys : ``[batch, kv_heads, dim]`` in ``dtype``.
    ok : bool ``[batch, kv_heads]``; False where the key does not guarantee zero weight.
    """
    q = queries.float()
    direction = separating_direction(q)
    alignment = -(q @ direction.unsqueeze(-1)).squeeze(-1)  # [b, h, n], must be > 0
    q_norm = q.norm(dim=-1)
    # a real score of query i is >= -scaling * |q_i| * bound; the fake one must sit MARGIN below
    needed = scaling * q_norm * key_norm_bound.float().unsqueeze(-1) + MARGIN
    separated = (alignment > 1e-6 * q_norm * direction.norm(dim=-1, keepdim=True)).all(-1)
    scale = (needed / (scaling * alignment).clamp_min(1e-30)).amax(-1)
    keys = (direction * scale.unsqueeze(-1)).nan_to_num(0.0, 0.0, 0.0).to(dtype)

    scores = scaling * (q @ keys.float().unsqueeze(-1)).squeeze(-1)
    largest_real = scaling * q_norm * key_norm_bound.float().unsqueeze(-1)
    ok = separated & (scores <= -largest_real - 0.9 * MARGIN).all(-1)
    ok &= (scores.abs() <= MAX_SCORE).all(-1) & torch.isfinite(keys).all(-1)
    return keys, ok
