"""Launchers of the MoE dispatch/combine kernels (``raw_kernels/moe_dispatch.cu``).

Same contracts as :mod:`graphstash.reference.moe` (the oracle): every function writes into
``out`` (allocated by the caller with a static shape) on torch's current stream, reads
nothing back to the host and allocates nothing (``route_local``: two small scratch tensors,
``[chunks * (E + 1)]`` int32 and ``[E]`` int64, from torch's allocator, so a graph's pool
holds them). Each is the operator
``torch.ops.graphstash.<name>`` (NOTE [kernels as operators] in ``_library.py``), with the
reference as its CPU kernel (``route_local``: CUDA only).
"""
from __future__ import annotations

import numpy as np
import torch

from raw_kernels import int_defines

from ..reference import moe as _reference
from . import THREADS, VECTOR_WIDTHS, launch, ptr, register_source, vector_width
from ._library import kernel_op

_DTYPES = {torch.bfloat16: ("bf16", 2), torch.float16: ("f16", 2), torch.float32: ("f32", 4),
           torch.float64: ("f64", 8)}     # name in the kernel names, element size
_WARPS = THREADS // 32

register_source(
    "moe_dispatch", "moe_dispatch.cu",
    tuple(f"gs_moe_gather_v{w}" for w in VECTOR_WIDTHS)
    + tuple(f"gs_moe_place_v{w}" for w in VECTOR_WIDTHS)
    + tuple(f"gs_moe_spread_v{w}" for w in VECTOR_WIDTHS)
    + tuple(f"gs_moe_combine_{n}_v{w}" for n, size in _DTYPES.values() for w in (16, size))
    + tuple(f"gs_moe_weight_grad_{n}" for n, _ in _DTYPES.values()))


def _blocks(elements: int) -> int:
    return max(1, -(-elements // THREADS))


SPREAD_MAX_K = 32          # slots per source row the spread kernel takes (one lane each)


def _gather_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor, *,
                 inverse: torch.Tensor | None = None) -> None:
    """Launch ``gs_moe_gather_v*``: ``out[i] = src[index[i]]`` (zero where ``index[i] < 0``);
    given ``inverse`` (int32 ``[src rows, K]``, the rows each source row feeds), the same
    result from ``gs_moe_spread_v*``, which reads each source row once (NOTE [spread rows])."""
    rows_out = out.shape[0]
    row_bytes = out[0].numel() * out.element_size() if rows_out else 0
    if rows_out == 0 or row_bytes == 0:
        return
    width = vector_width(row_bytes, out.data_ptr(), src.data_ptr())
    vec_per_row = row_bytes // width
    _reference.check_inverse(inverse, src)
    if inverse is not None and 0 < inverse.shape[1] <= SPREAD_MAX_K and src.shape[0]:
        args = (ptr(out), ptr(src), ptr(index), ptr(inverse), np.int32(inverse.shape[1]),
                np.int64(rows_out), np.int64(vec_per_row), np.int64(src.shape[0]))
        launch("moe_dispatch", f"gs_moe_spread_v{width}",
               -(-max(rows_out, src.shape[0]) // _WARPS), out.device.index, args)
        return
    args = (ptr(out), ptr(src), ptr(index), np.int64(rows_out), np.int64(vec_per_row),
            np.int64(src.shape[0]))
    launch("moe_dispatch", f"gs_moe_gather_v{width}", _blocks(rows_out * vec_per_row),
           out.device.index, args)


def _place_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """Launch ``gs_moe_place_v*``: ``out[i] = src[index[i]]`` where ``index[i]`` is a row of
    ``src``; the other rows of ``out`` keep what they hold."""
    rows_out = out.shape[0]
    row_bytes = out[0].numel() * out.element_size() if rows_out else 0
    if rows_out == 0 or row_bytes == 0:
        return
    width = vector_width(row_bytes, out.data_ptr(), src.data_ptr())
    launch("moe_dispatch", f"gs_moe_place_v{width}", _blocks(rows_out * (row_bytes // width)),
           out.device.index, (ptr(out), ptr(src), ptr(index), np.int64(rows_out),
                              np.int64(row_bytes // width), np.int64(src.shape[0])))


def _combine_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                 weight: torch.Tensor | None) -> None:
    """Launch ``gs_moe_combine_*``: ``out[i] = sum_k weight[i, k] * src[index[i, k]]``."""
    rows_out, hidden = out.shape
    if rows_out == 0 or hidden == 0:
        return
    name, size = _DTYPES[out.dtype]
    width = 16       # bytes a thread moves at once (NOTE [kernel names] in raw_kernels/__init__.py)
    if (hidden * size) % width or out.data_ptr() % width or src.data_ptr() % width:
        width = size
    K = index.shape[1]
    wptr = ptr(weight) if weight is not None else np.uint64(0)
    args = (ptr(out), ptr(src), ptr(index), wptr, np.int32(K), np.int64(rows_out),
            np.int64(hidden), np.int64(src.shape[0]))
    launch("moe_dispatch", f"gs_moe_combine_{name}_v{width}",
           _blocks(rows_out * (hidden * size // width)), out.device.index, args)


def _weight_grad(out: torch.Tensor, grad: torch.Tensor, src: torch.Tensor,
                index: torch.Tensor) -> None:
    """Launch ``gs_moe_weight_grad_*``: ``out[p] = <grad[p // K], src[index[p]]>``."""
    T, K = index.shape
    pairs = T * K
    if pairs == 0:
        return
    name = _DTYPES[grad.dtype][0]
    args = (ptr(out), ptr(grad), ptr(src), ptr(index), np.int32(K), np.int64(pairs),
            np.int64(grad.shape[1]), np.int64(src.shape[0]))
    launch("moe_dispatch", f"gs_moe_weight_grad_{name}", max(1, -(-pairs // _WARPS)),
           grad.device.index, args)


# ---- routing plan of a one-device dispatch (raw_kernels/moe_routing.cu) --------------------
_CHUNK = int_defines("moe_routing.cu")["CHUNK"]     # pairs per warp chunk
_SMEM_LIMIT = 48 * 1024        # default dynamic shared memory a block may take

register_source("moe_routing", "moe_routing.cu",
                ("gs_route_layout",) + tuple(f"gs_route_{w}_{n}" for w in ("count", "place")
                                             for n in ("i32", "i64")))


def route_fits(num_experts: int) -> bool:
    """Whether :func:`route_local` handles ``num_experts`` (its per-warp counts fit in the
    default shared memory of a block)."""
    return _WARPS * (num_experts + 1) * 4 <= _SMEM_LIMIT


def _route_local(topk_idx: torch.Tensor, num_experts: int, budget_rows: int,
                 pad_multiple: int | None, status: torch.Tensor | None, *,
                 slot_of_pair: torch.Tensor, pair_of_slot: torch.Tensor,
                 token_of_slot: torch.Tensor, tokens_per_expert: torch.Tensor,
                 live_rows: torch.Tensor, demand_rows: torch.Tensor, over_budget: torch.Tensor,
                 bad_index: torch.Tensor) -> None:
    """Launch the three routing kernels: the plan :func:`graphstash.moe._routing.plan_local`
    computes, into the given outputs (int32 ``[T, K]``, ``[R]``, ``[R]``, ``[E]``, ``[1]``;
    int64 ``[1]``; bool ``[1]``, ``[1]``), and, given a status, the flags dispatch raises.
    Allocates its two scratch tensors (per-chunk counts, expert offsets) per call.

    Args:
        topk_idx: int32/int64 ``[T, K]`` contiguous expert ids on the device.
        status: int32 ``[8]`` status or ``None``.

    CUDA only: the operator has no CPU kernel (on the CPU, ``plan_local``'s torch path, its
    oracle, builds the plan).
    """
    T, K = topk_idx.shape
    pairs = T * K
    E = num_experts
    device = topk_idx.device
    chunks = max(1, -(-pairs // _CHUNK))
    counts = torch.empty(chunks * (E + 1), dtype=torch.int32, device=device)
    offs = torch.empty(E, dtype=torch.int64, device=device)
    name = "i64" if topk_idx.dtype == torch.int64 else "i32"
    smem = _WARPS * (E + 1) * 4
    index = device.index
    launch("moe_routing", f"gs_route_count_{name}",
           max(-(-chunks // _WARPS), _blocks(budget_rows)), index,
           (ptr(topk_idx), np.int64(pairs), np.int32(E), ptr(counts), np.int64(chunks),
            ptr(pair_of_slot), ptr(token_of_slot), np.int64(budget_rows)), shared_mem=smem)
    launch("moe_routing", "gs_route_layout", 1, index,
           (ptr(counts), np.int64(chunks), np.int32(E), np.int64(budget_rows),
            np.int32(pad_multiple or 1), ptr(offs), ptr(tokens_per_expert), ptr(live_rows),
            ptr(demand_rows), ptr(over_budget), ptr(bad_index),
            ptr(status) if status is not None else np.uint64(0)), shared_mem=(E + 1) * 8)
    launch("moe_routing", f"gs_route_place_{name}", -(-chunks // _WARPS), index,
           (ptr(topk_idx), np.int64(pairs), np.int32(K), np.int32(E), ptr(counts),
            np.int64(chunks), ptr(offs), np.int64(budget_rows), ptr(slot_of_pair),
            ptr(pair_of_slot), ptr(token_of_slot)), shared_mem=smem)


gather_rows = kernel_op("gather_rows", _gather_rows, mutates_args=("out",),
                        cpu=_reference.gather_rows)
place_rows = kernel_op("place_rows", _place_rows, mutates_args=("out",),
                       cpu=_reference.place_rows)
combine_rows = kernel_op("combine_rows", _combine_rows, mutates_args=("out",),
                         cpu=_reference.combine_rows)
weight_grad = kernel_op("weight_grad", _weight_grad, mutates_args=("out",),
                        cpu=_reference.weight_grad)
route_local = kernel_op(
    "route_local", _route_local, cpu=None,
    mutates_args=("status", "slot_of_pair", "pair_of_slot", "token_of_slot",
                  "tokens_per_expert", "live_rows", "demand_rows", "over_budget", "bad_index"))
