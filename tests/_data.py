"""Test data that shows where it came from: byte b of row r of segment s is a function of
(s, r, b, salt), so a misplaced or torn row is an exact, readable difference."""
from __future__ import annotations

import torch


def pattern(shape, dtype: torch.dtype, *, salt: int, device="cpu") -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` whose bytes encode their position.

    Rows are the second-to-last dimension; segments (if 3-D) the first. Every byte of
    row r in segment s is ``(s * 131 + r * 7 + b * 3 + salt) % 251 + 1`` (never zero).
    """
    shape = tuple(shape)
    elem = torch.empty((), dtype=dtype).element_size()
    S, rows = (1, shape[0]) if len(shape) == 2 else (shape[0], shape[1])
    row_bytes = shape[-1] * elem
    s = torch.arange(S, dtype=torch.int64).view(S, 1, 1)
    r = torch.arange(rows, dtype=torch.int64).view(1, rows, 1)
    b = torch.arange(row_bytes, dtype=torch.int64).view(1, 1, row_bytes)
    data = ((s * 131 + r * 7 + b * 3 + salt) % 251 + 1).to(torch.uint8)
    return data.view(dtype).reshape(shape).to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a contiguous tensor (NaN-safe comparisons with torch.equal)."""
    return t.contiguous().view(torch.uint8)
