"""Launchers of the MoE dispatch/combine kernels (``raw_kernels/moe_dispatch.cu``).

Same contracts as :mod:`graphstash.reference.moe` (the oracle): every function writes into
``out`` (allocated by the caller with a static shape) on torch's current stream, reads
nothing back to the host and allocates nothing.
"""
from __future__ import annotations

import numpy as np
import torch

from . import THREADS, VECTOR_WIDTHS, launch, ptr, register_source, vector_width

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
                torch.float64: "f64"}
_PACK = {"bf16": 8, "f16": 8, "f32": 4, "f64": 2}      # elements per 16-byte pack
_WARPS = THREADS // 32

register_source(
    "moe_dispatch", "moe_dispatch.cu",
    tuple(f"gs_moe_gather_v{w}" for w in VECTOR_WIDTHS)
    + tuple(f"gs_moe_combine_{n}_p{p}" for n, pk in _PACK.items() for p in (pk, 1))
    + tuple(f"gs_moe_weight_grad_{n}" for n in _PACK))


def _blocks(elements: int) -> int:
    return max(1, -(-elements // THREADS))


def gather_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """Launch ``gs_moe_gather_v*``: ``out[i] = src[index[i]]`` (zero where ``index[i] < 0``)."""
    rows_out = out.shape[0]
    row_bytes = out[0].numel() * out.element_size() if rows_out else 0
    if rows_out == 0 or row_bytes == 0:
        return
    width = vector_width(row_bytes, out.data_ptr(), src.data_ptr())
    vec_per_row = row_bytes // width
    args = (ptr(out), ptr(src), ptr(index), np.int64(rows_out), np.int64(vec_per_row),
            np.int64(src.shape[0]))
    launch("moe_dispatch", f"gs_moe_gather_v{width}", _blocks(rows_out * vec_per_row),
           out.device.index, args)


def combine_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                 weight: torch.Tensor | None) -> None:
    """Launch ``gs_moe_combine_*``: ``out[i] = sum_k weight[i, k] * src[index[i, k]]``."""
    rows_out, hidden = out.shape
    if rows_out == 0 or hidden == 0:
        return
    name = _DTYPE_NAMES[out.dtype]
    pack = _PACK[name]
    if hidden % pack or out.data_ptr() % 16 or src.data_ptr() % 16:
        pack = 1
    K = index.shape[1]
    wptr = ptr(weight) if weight is not None else np.uint64(0)
    args = (ptr(out), ptr(src), ptr(index), wptr, np.int32(K), np.int64(rows_out),
            np.int64(hidden), np.int64(src.shape[0]))
    launch("moe_dispatch", f"gs_moe_combine_{name}_p{pack}", _blocks(rows_out * (hidden // pack)),
           out.device.index, args)


def weight_grad(out: torch.Tensor, grad: torch.Tensor, src: torch.Tensor,
                index: torch.Tensor) -> None:
    """Launch ``gs_moe_weight_grad_*``: ``out[p] = <grad[p // K], src[index[p]]>``."""
    T, K = index.shape
    pairs = T * K
    if pairs == 0:
        return
    name = _DTYPE_NAMES[grad.dtype]
    args = (ptr(out), ptr(grad), ptr(src), ptr(index), np.int32(K), np.int64(pairs),
            np.int64(grad.shape[1]), np.int64(src.shape[0]))
    launch("moe_dispatch", f"gs_moe_weight_grad_{name}", max(1, -(-pairs // _WARPS)),
           grad.device.index, args)
