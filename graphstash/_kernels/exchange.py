"""Launchers of the expert-parallel exchange kernels (``raw_kernels/moe_exchange.cu``).

Each is the operator ``torch.ops.graphstash.<name>`` (NOTE [kernels as operators] in
``_library.py``): it launches on torch's current stream, writes into tensors its caller
allocated, reads nothing back to the host and allocates nothing. The kernels also write into
the regions of the other ranks through the peer table (``table``, int64 ``[XF_FIELDS, W]`` on
the device); the schema names this rank's own region as mutated. The operators that talk to
peers have no CPU kernel: on the CPU the same exchange runs over gloo
(:mod:`graphstash.reference.exchange`); :func:`exchange_map` has the reference as its CPU
kernel.
"""
from __future__ import annotations

import numpy as np
import torch

from ..reference import exchange as _reference
from . import THREADS, VECTOR_WIDTHS, launch, ptr, register_source, vector_width
from . import XCHG_UNROLL as _UNROLL         # vectors a lane moves per pass (gs_tunables.cuh)
from ._library import kernel_op

_MODULE = "moe_exchange"
_INT32_MAX = 2**31 - 1            # rows, items and windows are int32 in the push kernels

register_source(_MODULE, "moe_exchange.cu",
                ("gs_xchg_barrier", "gs_xchg_counts", "gs_xchg_map", "gs_xchg_flags")
                + tuple(f"gs_xchg_push_v{w}" for w in VECTOR_WIDTHS))


def _no_ptr() -> np.uint64:
    return np.uint64(0)


def _barrier(table: torch.Tensor, state: torch.Tensor, region: torch.Tensor, world_size: int,
             rank: int, timeout_ns: int, status: torch.Tensor | None) -> None:
    """Launch ``gs_xchg_barrier`` (one block): raise this rank's next epoch at every rank and
    wait for theirs, at most ``timeout_ns`` (NOTE [exchange signals], [exchange timeout]).

    Args:
        table: int64 ``[XF_FIELDS, W]`` peer addresses; state: int64 ``[XS_SIZE]`` private
            state; region: uint8 ``[nbytes]`` this rank's region (all on this device).
        status: int32 ``[8]`` that gets ``OVERFLOW_EXCHANGE`` if the exchange failed, or None.
    """
    launch(_MODULE, "gs_xchg_barrier", 1, state.device.index,
           (ptr(table), ptr(state), np.int32(world_size), np.int32(rank), np.int64(timeout_ns),
            ptr(status) if status is not None else _no_ptr()))


def _exchange_counts(table: torch.Tensor, state: torch.Tensor, region: torch.Tensor,
                     world_size: int, rank: int, timeout_ns: int, send_counts: torch.Tensor,
                     num_experts: int, count_stride: int, budget: int, pad_multiple: int,
                     row_bytes: int, bad_index: torch.Tensor | None,
                     status: torch.Tensor | None, cube: torch.Tensor, work: torch.Tensor,
                     tokens_per_expert: torch.Tensor, live_rows: torch.Tensor,
                     demand_rows: torch.Tensor, over_budget: torch.Tensor) -> None:
    """Launch ``gs_xchg_counts`` (one block): push the counts, barrier, lay out, raise flags.

    Args:
        send_counts: int32 ``[E]`` rows this rank sends to each global expert.
        count_stride: int32 entries of one count row of the region (header + max experts).
        budget: rows past which this rank drops (``2**62`` for no budget); pad_multiple >= 1;
            row_bytes: bytes of one dispatched row (checked equal on every rank).
        bad_index: bool ``[1]`` (a top-k index was out of range) or None; status: int32
            ``[8]`` or None.
        cube: int32 ``[W, E]``; work: int64 ``[XW_ARRAYS * E + 1]``; tokens_per_expert: int32
            ``[E / W]``; live_rows: int32 ``[1]``; demand_rows: int64 ``[1]``; over_budget:
            bool ``[1]``: outputs (:func:`graphstash.reference.exchange.layout`).
    """
    launch(_MODULE, "gs_xchg_counts", 1, state.device.index,
           (ptr(table), ptr(state), np.int32(world_size), np.int32(rank), np.int64(timeout_ns),
            ptr(send_counts), np.int32(num_experts), np.int32(count_stride), np.int64(budget),
            np.int32(pad_multiple), np.int32(row_bytes),
            ptr(bad_index) if bad_index is not None else _no_ptr(),
            ptr(status) if status is not None else _no_ptr(), ptr(cube), ptr(work),
            ptr(tokens_per_expert), ptr(live_rows), ptr(demand_rows), ptr(over_budget)))


def _exchange_map(work: torch.Tensor, cube: torch.Tensor, world_size: int, rank: int,
                  num_experts: int, slot_of_pair: torch.Tensor, clip: int,
                  live_rows: torch.Tensor, rows: int, pair_slot: torch.Tensor,
                  slot_peer: torch.Tensor, slot_row: torch.Tensor, slot_self: torch.Tensor,
                  row_src: torch.Tensor, row_peer: torch.Tensor, row_slot: torch.Tensor) -> None:
    """Launch ``gs_xchg_map``: the arguments and outputs of
    :func:`graphstash.reference.exchange.exchange_map` (its CPU kernel)."""
    pairs = slot_of_pair.numel()
    items = max(pairs, rows)
    if items == 0:
        return
    launch(_MODULE, "gs_xchg_map", max(1, -(-items // THREADS)), work.device.index,
           (ptr(work), ptr(cube), np.int32(world_size), np.int32(rank), np.int32(num_experts),
            ptr(slot_of_pair), np.int64(pairs), np.int64(clip), ptr(live_rows), np.int64(rows),
            ptr(pair_slot), ptr(slot_peer), ptr(slot_row), ptr(slot_self), ptr(row_src),
            ptr(row_peer), ptr(row_slot)))


def lanes_per_row(vec_per_row: int) -> int:
    """Lanes that copy one row together: the power of two covering the row's vectors, at
    most a warp."""
    lanes = 1
    while lanes < 32 and lanes < vec_per_row:
        lanes *= 2
    return lanes


def _exchange_push(table: torch.Tensor, state: torch.Tensor, region: torch.Tensor,
                   world_size: int, rank: int, field: int, field_base: int, src: torch.Tensor,
                   src_index: torch.Tensor | None, dest_peer: torch.Tensor,
                   dest_row: torch.Tensor, count: torch.Tensor, window_lo: int, window_hi: int,
                   capacity_rows: int, extra_field: int, extra: torch.Tensor | None,
                   extra_index: torch.Tensor | None, max_blocks: int = 0) -> None:
    """Launch ``gs_xchg_push_v*``: copy the live rows of ``src`` into the peers' ``field``.

    Args:
        field: ``XF_ROWS`` or ``XF_WEIGHTS``; field_base: this rank's address of that field
            (every rank's has the same alignment), for the vector width.
        src: ``[N, ...]`` contiguous rows on this device.
        src_index: int32 ``[M]`` source row of each item, or None (item i is row i).
        dest_peer, dest_row: int32 ``[M]`` the rank and row each item goes to (-1: nowhere);
            count: int32 ``[1]`` live items (read on the device).
        window_lo, window_hi: only rows in ``[lo, hi)`` are sent, to row ``row - lo``.
        capacity_rows: rows of the field.
        extra_field, extra, extra_index: with ``extra`` (``[N2]`` or ``[N2, 1]`` of 2, 4 or 8
            bytes per element, contiguous), each item also copies ``extra[extra_index[i]]``
            (or ``extra[i]``) into ``extra_field`` at the same row (the router weights beside
            their rows: one launch).
        max_blocks: at most this many thread blocks (the kernel strides over the items), so
            the push leaves the other multiprocessors to work beside it; 0: one lane group
            per item.
    """
    rows = src.shape[0]
    items = dest_peer.shape[0]
    row_bytes = src[0].numel() * src.element_size() if rows else 0
    if items == 0 or row_bytes == 0:
        return
    width = vector_width(row_bytes, src.data_ptr(), field_base)
    vec_per_row = row_bytes // width
    lanes = lanes_per_row(-(-vec_per_row // _UNROLL))
    blocks = max(1, -(-items * lanes // THREADS))
    if max_blocks > 0:
        blocks = min(blocks, max_blocks)
    launch(_MODULE, f"gs_xchg_push_v{width}", blocks,
           state.device.index,
           (ptr(table), ptr(state), np.int32(world_size), np.int32(rank), np.int32(field),
            ptr(src), np.int32(rows), ptr(src_index) if src_index is not None else _no_ptr(),
            ptr(dest_peer), ptr(dest_row), ptr(count), np.int32(items),
            np.int32(vec_per_row), np.int32(lanes.bit_length() - 1),
            np.int32(min(window_lo, _INT32_MAX)), np.int32(min(window_hi, _INT32_MAX)),
            np.int32(capacity_rows), np.int32(extra_field),
            ptr(extra) if extra is not None else _no_ptr(),
            np.int32(extra.shape[0] if extra is not None else 0),
            ptr(extra_index) if extra_index is not None else _no_ptr(),
            np.int32(extra.element_size() if extra is not None else 0)))


def _exchange_flags(table: torch.Tensor, state: torch.Tensor, region: torch.Tensor,
                    world_size: int, rank: int, timeout_ns: int, flags: torch.Tensor,
                    peaks: torch.Tensor | None = None) -> None:
    """Launch ``gs_xchg_flags`` (one block): ``flags`` (int32 ``[n]``, n <= X_MAX_FLAGS)
    summed over the ranks in place, ``peaks`` (int32 ``[m]``, m <= X_MAX_PEAKS, or None)
    replaced by their maximum over the ranks."""
    launch(_MODULE, "gs_xchg_flags", 1, state.device.index,
           (ptr(table), ptr(state), np.int32(world_size), np.int32(rank), np.int64(timeout_ns),
            ptr(flags), np.int32(flags.numel()),
            ptr(peaks) if peaks is not None else _no_ptr(),
            np.int32(peaks.numel() if peaks is not None else 0)))


barrier = kernel_op("exchange_barrier", _barrier, mutates_args=("state", "region", "status"),
                    cpu=None)
exchange_counts = kernel_op(
    "exchange_counts", _exchange_counts, cpu=None,
    mutates_args=("state", "region", "status", "cube", "work", "tokens_per_expert",
                  "live_rows", "demand_rows", "over_budget"))
exchange_map = kernel_op(
    "exchange_map", _exchange_map, cpu=_reference.exchange_map,
    mutates_args=("pair_slot", "slot_peer", "slot_row", "slot_self", "row_src", "row_peer",
                  "row_slot"))
exchange_push = kernel_op("exchange_push", _exchange_push, mutates_args=("state", "region"),
                          cpu=None)
exchange_flags = kernel_op("exchange_flags", _exchange_flags,
                           mutates_args=("state", "region", "flags", "peaks"), cpu=None)
