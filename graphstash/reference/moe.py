"""Pure-torch MoE dispatch/combine kernels: the CPU backend and the oracle for the CUDA kernels.

``gather_rows``, ``place_rows``, ``combine_rows`` and ``weight_grad`` take the same arguments as their
counterparts in :mod:`graphstash._kernels.moe` and write the same values into ``out``:
gathers bit for bit, weighted sums bit for bit too (NOTE [exact arithmetic] in
``raw_kernels/gs_dtype.cuh``), the weight gradient up to summation order.

:func:`dense_moe` is the dense, loop-over-experts formulation every dispatch/combine path
must agree with (within dtype tolerance): ``out[t] = sum_k w[t, k] * expert_k(x[t])``.
"""
from __future__ import annotations

from typing import Callable

import torch

from .arithmetic import acc_dtype


def _rows(src: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src[index] or 0, valid)`` for int32 ``index`` of any shape; no host read."""
    valid = (index >= 0) & (index < src.shape[0])
    if src.shape[0] == 0:
        picked = src.new_zeros(*index.shape, *src.shape[1:])
    else:
        picked = src[torch.where(valid, index, 0).long()]
    return picked, valid


def check_inverse(inverse: torch.Tensor | None, src: torch.Tensor) -> None:
    """ValueError naming ``inverse`` unless it is None or a contiguous int32 ``[src rows, K]``
    tensor on ``src``'s device (the map :func:`gather_rows` takes)."""
    if inverse is not None and (inverse.dtype != torch.int32 or inverse.dim() != 2
                                or inverse.shape[0] != src.shape[0]
                                or not inverse.is_contiguous() or inverse.device != src.device):
        raise ValueError(f"inverse: expected a contiguous int32 [{src.shape[0]}, K] tensor on "
                         f"{src.device} (the rows each source row feeds), got {inverse.dtype} "
                         f"{tuple(inverse.shape)} on {inverse.device}")


def gather_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor, *,
                inverse: torch.Tensor | None = None) -> None:
    """``out[i] = src[index[i]]`` bitwise, zero where ``index[i] < 0``.

    Args:
        out: ``[N, ...]`` destination, same dtype, device and row shape as ``src``.
        src: ``[M, ...]`` source rows.
        index: int32 ``[N]`` source row of each destination row, ``-1`` for none.
        inverse: int32 ``[M, K]``, the destination rows each source row feeds (``-1``:
            none), each row with a source exactly once; or None. It changes how the CUDA
            kernel moves the rows (NOTE [spread rows] in ``raw_kernels/moe_dispatch.cu``),
            never the result, so the oracle reads ``index`` only (and checks its shape).
    """
    check_inverse(inverse, src)
    picked, valid = _rows(src, index)
    mask = valid.view(-1, *([1] * (src.dim() - 1)))
    out.copy_(torch.where(mask, picked, torch.zeros((), dtype=src.dtype, device=src.device)))


def place_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """``out[i] = src[index[i]]`` bitwise where ``index[i]`` is a row of ``src``; every other
    row of ``out`` keeps what it holds (where :func:`gather_rows` writes zeros).

    Args:
        out: ``[N, ...]`` destination, same dtype, device and row shape as ``src``.
        src: ``[M, ...]`` source rows.
        index: int32 ``[N]`` source row of each destination row, ``-1`` for none.
    """
    picked, valid = _rows(src, index)
    mask = valid.view(-1, *([1] * (src.dim() - 1)))
    out.copy_(torch.where(mask, picked, out))


def combine_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                 weight: torch.Tensor | None) -> None:
    """``out[i] = sum_k weight[i, k] * src[index[i, k]]`` over the slots with ``index >= 0``.

    Args:
        out: ``[N, H]`` destination, dtype and device of ``src``.
        src: ``[M, H]`` source rows (float16, bfloat16, float32 or float64).
        index: int32 ``[N, K]``, ``-1`` for an empty slot.
        weight: ``[N, K]`` in the accumulator dtype (float32; float64 for float64 data),
            or ``None`` for weights of 1.
    """
    acc_type = acc_dtype(src.dtype)
    acc = torch.zeros(out.shape, dtype=acc_type, device=out.device)
    for k in range(index.shape[1]):
        picked, valid = _rows(src, index[:, k])
        term = picked.to(acc_type)
        if weight is not None:
            term = weight[:, k:k + 1] * term          # rounded product, then a rounded sum
        acc = acc + torch.where(valid.unsqueeze(1), term, torch.zeros((), dtype=acc_type,
                                                                      device=out.device))
    out.copy_(acc.to(out.dtype))


def weight_grad(out: torch.Tensor, grad: torch.Tensor, src: torch.Tensor,
                index: torch.Tensor) -> None:
    """``out[p] = <grad[p // K], src[index[p]]>`` (0 where ``index[p] < 0``).

    Args:
        out: ``[N * K]`` in the accumulator dtype of ``grad``.
        grad: ``[N, H]`` gradient of the combined output.
        src: ``[M, H]`` the rows that were combined.
        index: int32 ``[N, K]``, ``-1`` for an empty slot.
    """
    acc_type = acc_dtype(grad.dtype)
    picked, valid = _rows(src, index)                       # [N, K, H]
    dots = (picked.to(acc_type) * grad.to(acc_type).unsqueeze(1)).sum(-1)
    out.copy_(torch.where(valid, dots, torch.zeros((), dtype=acc_type, device=out.device))
              .reshape(-1))


def dense_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
              experts: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Dense MoE: ``out[t] = sum_k topk_weight[t, k] * experts(topk_idx[t, k], x[t])``.

    Args:
        x: ``[T, H]`` tokens.
        topk_idx: int ``[T, K]`` expert of each slot.
        topk_weight: ``[T, K]`` router weight of each slot, dtype of ``x``.
        experts: ``experts(e, rows [n, H]) -> [n, H_out]``, applied to each expert's rows.
    Differentiable in ``x``, ``topk_weight`` and whatever ``experts`` closes over.
    """
    T, K = topk_idx.shape
    out = None
    for e in torch.unique(topk_idx).tolist():
        for k in range(K):
            rows = (topk_idx[:, k] == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            y = experts(int(e), x[rows]) * topk_weight[rows, k:k + 1]
            if out is None:
                out = torch.zeros(T, y.shape[1], dtype=y.dtype, device=y.device)
            out = out.index_add(0, rows, y)
    if out is None:
        out = torch.zeros_like(x)
    return out
