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


def separating_direction(queries: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """A direction ``u`` with ``<q, u> < 0`` for (ideally) all rows ``q``.

    ``queries`` is ``[..., n, dim]`` in fp32 and ``norms`` their norms ``[..., n]``; returns
    ``[..., dim]``.
    """
    unit = queries / norms.clamp_min(1e-12).unsqueeze(-1)
    # the queries of one GQA group usually share a half-space: their mean is a cheap answer
    mean = -unit.mean(dim=-2)
    cosines = (unit @ mean.unsqueeze(-1)).squeeze(-1)
    if bool((cosines < -_GOOD_ENOUGH * mean.norm(dim=-1, keepdim=True)).all()):
        return mean
    n, dim = unit.shape[-2:]
    ones = unit.new_ones(*unit.shape[:-1], 1)
    if n <= dim:  # the minimum-norm u with <unit_i, u> = -1 for every query
        gram = unit @ unit.transpose(-1, -2)
        eye = torch.eye(n, device=unit.device)
        direction = unit.transpose(-1, -2) @ torch.linalg.solve(gram + _RIDGE * eye, ones)
    else:  # least squares
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
    keys : ``[batch, kv_heads, dim]`` in ``dtype``, always finite.
    ok : bool ``[batch, kv_heads]``; False where the key does not guarantee zero weight.
    """
    q = queries.float()
    q_norm = torch.linalg.vector_norm(q, dim=-1)
    direction = separating_direction(q, q_norm)
    alignment = -(q @ direction.unsqueeze(-1)).squeeze(-1)  # [b, h, n], must be > 0
    # a real score of query i is >= -largest_real[i]; the fake one must sit MARGIN below that
    largest_real = (scaling * key_norm_bound.float()).unsqueeze(-1) * q_norm
    scale = ((largest_real + MARGIN) / (scaling * alignment).clamp_min(1e-30)).amax(-1)
    keys = (direction * scale.unsqueeze(-1)).to(dtype).nan_to_num(0.0, 0.0, 0.0)
    # check what the kernels will see: the keys as stored, against every query
    scores = scaling * (q @ keys.float().unsqueeze(-1)).squeeze(-1)
    ok = (scores <= -largest_real - 0.9 * MARGIN) & (scores >= -MAX_SCORE)
    return keys, ok.all(-1)
