"""Launchers of the paged stash kernels (``raw_kernels/paged_stash.cu``)."""
from __future__ import annotations

import numpy as np
import torch

from . import VECTOR_WIDTHS, chunk_bytes, launch, ptr, register_source, vector_width

register_source("paged_stash", "paged_stash.cu",
                tuple(f"gs_{op}_v{w}" for op in ("stash", "reload") for w in VECTOR_WIDTHS))


def _chunks(max_bytes: int, width: int) -> int:
    """Blocks worth launching for at most ``max_bytes`` of rows (NOTE [dynamic units])."""
    return -(-max_bytes // chunk_bytes(width))


def _segment_smem(S: int) -> int:
    """Dynamic shared memory of the segment table for S segments (SegmentTable in the .cu)."""
    return (S + 1) * 8 + (S + 1) * 4 + S * 4


def _pool_args(pool):
    return (ptr(pool.dev_pages), ptr(pool.host_pages), np.int32(pool.num_dev),
            np.int32(pool.num_host))


def paged_stash(pool, src: torch.Tensor, counts: torch.Tensor, rec_offset: int) -> None:
    """Launch ``gs_stash_v*``; same contract as :func:`graphstash.reference.paged_stash.stash`."""
    S, cap, row_bytes = src.shape
    width = vector_width(row_bytes, src.data_ptr(), pool.dev_pages.data_ptr(),
                         pool.host_pages.data_ptr())
    rec_ptr = np.uint64(pool.table.data_ptr() + 4 * rec_offset)
    args = (ptr(src), np.int64(cap * row_bytes), np.int64(row_bytes), np.int32(S), np.int32(cap),
            ptr(counts), np.int32(counts.dtype == torch.int64), np.int32(pool.page_rows),
            np.int64(pool.page_bytes), *_pool_args(pool), ptr(pool.dev_ring),
            ptr(pool.host_ring), ptr(pool.state), ptr(pool.status), rec_ptr)
    launch("paged_stash", f"gs_stash_v{width}", _chunks(S * cap * row_bytes, width),
           src.device.index, args, shared_mem=_segment_smem(S))


def paged_reload(pool, dst: torch.Tensor, rec_offset: int, zero_tail: bool) -> None:
    """Launch ``gs_reload_v*``; same contract as :func:`graphstash.reference.paged_stash.reload`."""
    S, cap, row_bytes = dst.shape
    width = vector_width(row_bytes, dst.data_ptr(), pool.dev_pages.data_ptr(),
                         pool.host_pages.data_ptr())
    rec_ptr = np.uint64(pool.table.data_ptr() + 4 * rec_offset)
    args = (ptr(dst), np.int64(cap * row_bytes), np.int64(row_bytes), np.int32(S), np.int32(cap),
            np.int32(pool.page_rows), np.int64(pool.page_bytes), *_pool_args(pool),
            ptr(pool.dev_ring), ptr(pool.host_ring), ptr(pool.state), rec_ptr,
            np.int32(bool(zero_tail)))
    launch("paged_stash", f"gs_reload_v{width}", _chunks(S * cap * row_bytes, width),
           dst.device.index, args, shared_mem=_segment_smem(S))

