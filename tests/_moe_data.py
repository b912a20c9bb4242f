"""Test data for the MoE tests: rows derived from their token index, fresh random routing."""
from __future__ import annotations

import torch


def tokens(T: int, H: int, gen: torch.Generator, dtype=torch.float32, offset: int = 0):
    """``[T, H]``: row t holds ``t + 1 + offset`` plus a small column ramp and random noise,
    so a misplaced row shows as a different integer part."""
    t = torch.arange(T, dtype=torch.float64).unsqueeze(1) + 1 + offset
    h = torch.arange(H, dtype=torch.float64).unsqueeze(0) / (4 * H)
    noise = torch.rand(T, H, generator=gen, dtype=torch.float64) / (8 * H)
    return (t + h + noise).to(dtype)


def routing(T: int, K: int, E: int, gen: torch.Generator, dtype=torch.float32, skew=None):
    """Distinct top-k experts per token (optionally skewed towards low ids) and weights that
    sum to 1 per token."""
    scores = torch.rand(T, E, generator=gen, dtype=torch.float64)
    if skew is not None:
        scores = scores + skew * torch.linspace(1, 0, E, dtype=torch.float64)
    idx = scores.topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1
    w = w / w.sum(1, keepdim=True)
    return idx, w.to(dtype)


def expected_layout(idx: torch.Tensor, E: int, budget: int, pad: int | None):
    """Pure-python NOTE [permuted layout]: row -> (token, slot) or None, and per-expert rows."""
    T, K = idx.shape
    rows = []
    tpe = []
    for e in range(E):
        mine = [(t, k) for t in range(T) for k in range(K) if int(idx[t, k]) == e]
        n = len(mine)
        padded = -(-n // pad) * pad if pad else n
        start = len(rows)
        rows += mine + [None] * (padded - n)
        tpe.append(max(0, min(len(rows), budget) - min(start, budget)))
    rows = rows[:budget] + [None] * max(0, budget - len(rows))
    return rows, tpe
