"""The arithmetic every MoE kernel shares with its reference: the accumulator dtype."""
from __future__ import annotations

import torch

__all__ = ["acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels accumulate ``dtype`` data in (sums, dots, router weights):
    float64 for float64, float32 for every other floating dtype (NOTE [expert activation
    arithmetic] in ``graphstash/reference/experts.py``)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
