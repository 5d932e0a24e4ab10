"""Closed-form ridge regression from streamed sums, a small MLP, and the fit's measures: what
``kvpatch fit-scorer`` fits a hidden-state map with."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: ridge strengths tried, as multiples of the features' mean variance
RIDGE_GRID = (1e-8, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


@dataclass
class Moments:
    """Sums for a ridge regression: ``n``, ``sum x``, ``sum y``, ``X^T X`` and ``X^T Y``."""

    n: int = 0
    sx: torch.Tensor | None = None
    sy: torch.Tensor | None = None
    xx: torch.Tensor | None = None
    xy: torch.Tensor | None = None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        parts = (x.sum(0), y.sum(0), x.T @ x, x.T @ y)
        if self.sx is None:
            self.sx, self.sy, self.xx, self.xy = parts
        else:
            self.sx, self.sy = self.sx + parts[0], self.sy + parts[1]
            self.xx, self.xy = self.xx + parts[2], self.xy + parts[3]
        self.n += x.shape[0]

    def solve(self, strength: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight [hidden, out], bias [out])`` of the ridge fit at ``strength`` (a multiple of
        the centred features' mean variance)."""
        mx, my = self.sx / self.n, self.sy / self.n
        cxx = self.xx - self.n * torch.outer(mx, mx)
        cxy = self.xy - self.n * torch.outer(mx, my)
        scale = float(cxx.diagonal().mean()) or 1.0
        eye = torch.eye(cxx.shape[0], dtype=cxx.dtype)
        weight = torch.linalg.solve(cxx + strength * scale * eye, cxy)
        return weight, my - mx @ weight


def r_squared(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """The coefficient of determination, averaged over the columns (KV heads)."""
    residual = ((target - predicted) ** 2).sum(0)
    total = ((target - target.mean(0)) ** 2).sum(0).clamp(min=1e-12)
    return float((1 - residual / total).mean())


def rank_correlation(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """Spearman's rank correlation, averaged over the columns (KV heads)."""
    ranks = lambda t: t.argsort(0).argsort(0).double()
    a, b = ranks(predicted), ranks(target)
    a, b = a - a.mean(0), b - b.mean(0)
    return float(((a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp(min=1e-12)).mean())


def best_ridge(moments: Moments, test_x: torch.Tensor, test_y: torch.Tensor):
    """The ridge fit whose strength in :data:`RIDGE_GRID` predicts the held-out text best."""
    best = None
    for strength in RIDGE_GRID:
        w, b = moments.solve(strength)
        fit = r_squared(test_x.double() @ w + b, test_y.double())
        if best is None or fit > best[0]:
            best = (fit, strength, w, b)
    return best[1:]


def mlp(x, w1, b1, w2, b2):
    return torch.nn.functional.gelu(x @ w1 + b1) @ w2 + b2


def fit_mlp(x: torch.Tensor, y: torch.Tensor, width: int, epochs: int):
    """A two-layer MLP ``hidden -> width -> kv_heads`` fitted by Adam on the mean squared error
    (full batch, fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    hidden, out = x.shape[1], y.shape[1]
    w1 = (torch.randn(hidden, width, generator=generator) / math.sqrt(hidden)).requires_grad_()
    b1 = torch.zeros(width, requires_grad=True)
    w2 = (torch.randn(width, out, generator=generator) / math.sqrt(width)).requires_grad_()
    b2 = y.mean(0).clone().requires_grad_()
    optimizer = torch.optim.Adam([w1, b1, w2, b2], lr=3e-3)
    with torch.enable_grad():
        for _ in range(epochs):
            optimizer.zero_grad()
            loss = ((mlp(x, w1, b1, w2, b2) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
    return w1, b1, w2, b2
