"""Launchers of the paged stash kernels (``raw_kernels/paged_stash.cu``).

``stash`` and ``reload`` are the operators ``torch.ops.graphstash.paged_stash`` and
``torch.ops.graphstash.paged_reload`` (NOTE [kernels as operators] in ``_library.py``): they
take the pool as its tensors, write into them, and have the reference
(:mod:`graphstash.reference.paged_stash`) as their CPU kernel.
"""
from __future__ import annotations

import types

import numpy as np
import torch

from ..reference import paged_stash as _reference
from . import VECTOR_WIDTHS, chunk_bytes, launch, ptr, register_source, vector_width
from ._library import kernel_op

register_source("paged_stash", "paged_stash.cu",
                tuple(f"gs_{op}_v{w}" for op in ("stash", "reload") for w in VECTOR_WIDTHS))


def _chunks(max_bytes: int, width: int) -> int:
    """Blocks worth launching for at most ``max_bytes`` of rows (NOTE [dynamic units])."""
    return -(-max_bytes // chunk_bytes(width))


def _segment_smem(S: int) -> int:
    """Dynamic shared memory of the segment table for S segments (SegmentTable in the .cu)."""
    return (S + 1) * 8 + (S + 1) * 4 + S * 4


def _pages_args(dev_pages: torch.Tensor, host_pages: torch.Tensor, dev_ring: torch.Tensor,
                host_ring: torch.Tensor, state: torch.Tensor, page_rows: int) -> tuple:
    """The pool's part of both argument lists: geometry, pages, rings, state."""
    return (np.int32(page_rows), np.int64(dev_pages.shape[1]), ptr(dev_pages), ptr(host_pages),
            np.int32(dev_pages.shape[0]), np.int32(host_pages.shape[0]), ptr(dev_ring),
            ptr(host_ring), ptr(state))


def _stash(src: torch.Tensor, counts: torch.Tensor, dev_pages: torch.Tensor,
           host_pages: torch.Tensor, dev_ring: torch.Tensor, host_ring: torch.Tensor,
           state: torch.Tensor, status: torch.Tensor, table: torch.Tensor, page_rows: int,
           rec_offset: int, max_blocks: int | None = None) -> None:
    """Launch ``gs_stash_v*``: the live rows of ``src`` into pages, the record at
    ``table[rec_offset:]``; same contract as :func:`graphstash.reference.paged_stash.stash`.

    Args:
        src: uint8 ``[S, cap, row_bytes]`` byte view of the tensor, on the device.
        counts: int32/int64 ``[S]`` live rows per segment, on the device.
        dev_pages: uint8 ``[num_dev, page_rows * row_bytes]`` device pages (written).
        host_pages: uint8 ``[num_host, page_rows * row_bytes]`` pinned host pages (written).
        dev_ring, host_ring: int32 ``[num_dev]``, ``[num_host]`` free lists, on the device.
        state: int64 ``[STATE_SIZE]`` ring counters and peaks, on the device (written).
        status: int32 ``[STATUS_SIZE]`` sticky flags, on the device (written).
        table: int32 ``[entries]`` handle records, on the device (written).
        page_rows: rows per page; rec_offset: start of the record in ``table``.
        max_blocks: at most this many blocks (NOTE [dynamic units]: any grid copies all).
    """
    S, cap, row_bytes = src.shape
    width = vector_width(row_bytes, src.data_ptr(), dev_pages.data_ptr(), host_pages.data_ptr())
    args = (ptr(src), np.int64(cap * row_bytes), np.int64(row_bytes), np.int32(S),
            np.int32(cap), ptr(counts), np.int32(counts.dtype == torch.int64),
            *_pages_args(dev_pages, host_pages, dev_ring, host_ring, state, page_rows),
            ptr(status), np.uint64(table.data_ptr() + 4 * rec_offset))
    launch("paged_stash", f"gs_stash_v{width}", _chunks(S * cap * row_bytes, width),
           src.device.index, args, shared_mem=_segment_smem(S), max_blocks=max_blocks)


def _reload(dst: torch.Tensor, dev_pages: torch.Tensor, host_pages: torch.Tensor,
            dev_ring: torch.Tensor, host_ring: torch.Tensor, state: torch.Tensor,
            table: torch.Tensor, page_rows: int, rec_offset: int, zero_tail: bool,
            max_blocks: int | None = None) -> None:
    """Launch ``gs_reload_v*``: a stashed tensor back into ``dst``, its pages back to their
    rings; same contract as :func:`graphstash.reference.paged_stash.reload`.

    Args:
        dst: uint8 ``[S, cap, row_bytes]`` byte view of the output, on the device (written).
        dev_pages, host_pages: the pages, as for :func:`stash` (read).
        dev_ring, host_ring: the free lists (written: the pages come back).
        state: ring counters (written); table: handle records (written: marked reloaded).
        page_rows: rows per page; rec_offset: start of the record in ``table``.
        zero_tail: also write zeros into rows ``[n_s, cap)`` of every segment.
        max_blocks: at most this many blocks.
    """
    S, cap, row_bytes = dst.shape
    width = vector_width(row_bytes, dst.data_ptr(), dev_pages.data_ptr(), host_pages.data_ptr())
    args = (ptr(dst), np.int64(cap * row_bytes), np.int64(row_bytes), np.int32(S),
            np.int32(cap), *_pages_args(dev_pages, host_pages, dev_ring, host_ring, state,
                                        page_rows),
            np.uint64(table.data_ptr() + 4 * rec_offset), np.int32(bool(zero_tail)))
    launch("paged_stash", f"gs_reload_v{width}", _chunks(S * cap * row_bytes, width),
           dst.device.index, args, shared_mem=_segment_smem(S), max_blocks=max_blocks)


def _pool_view(dev_pages, host_pages, dev_ring, host_ring, state, table, page_rows,
               status=None):
    """The attributes :mod:`graphstash.reference.paged_stash` reads from a pool."""
    return types.SimpleNamespace(
        dev_pages=dev_pages, host_pages=host_pages, dev_ring=dev_ring, host_ring=host_ring,
        state=state, status=status, table=table, page_rows=page_rows,
        num_dev=dev_pages.shape[0], num_host=host_pages.shape[0])


def _reference_stash(src, counts, dev_pages, host_pages, dev_ring, host_ring, state, status,
                     table, page_rows, rec_offset, max_blocks=None) -> None:
    pool = _pool_view(dev_pages, host_pages, dev_ring, host_ring, state, table, page_rows,
                      status)
    _reference.stash(pool, src, counts, rec_offset)


def _reference_reload(dst, dev_pages, host_pages, dev_ring, host_ring, state, table,
                      page_rows, rec_offset, zero_tail, max_blocks=None) -> None:
    pool = _pool_view(dev_pages, host_pages, dev_ring, host_ring, state, table, page_rows)
    _reference.reload(pool, dst, rec_offset, zero_tail)


stash = kernel_op("paged_stash", _stash, cpu=_reference_stash,
                  mutates_args=("dev_pages", "host_pages", "state", "status", "table"))
reload = kernel_op("paged_reload", _reload, cpu=_reference_reload,
                   mutates_args=("dst", "dev_ring", "host_ring", "state", "table"))
