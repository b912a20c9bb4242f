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


def paged_stash(pool, src_ptr: int, S: int, cap: int, row_bytes: int, counts: torch.Tensor,
                rec_offset: int, device_index: int, max_blocks: int | None = None) -> None:
    """Launch ``gs_stash_v*``; same contract as :func:`graphstash.reference.paged_stash.stash`,
    with the tensor given as its address and ``[S, cap, row_bytes]`` geometry; at most
    ``max_blocks`` blocks if given (NOTE [dynamic units]: any grid size copies everything)."""
    width = vector_width(row_bytes, src_ptr, pool.dev_pages_ptr, pool.host_pages_ptr)
    args = (np.uint64(src_ptr), np.int64(cap * row_bytes), np.int64(row_bytes), np.int32(S),
            np.int32(cap), ptr(counts), np.int32(counts.dtype == torch.int64),
            *pool.kernel_args[0], np.uint64(pool.table_ptr + 4 * rec_offset))
    launch("paged_stash", f"gs_stash_v{width}", _chunks(S * cap * row_bytes, width),
           device_index, args, shared_mem=_segment_smem(S), max_blocks=max_blocks)


def paged_reload(pool, dst_ptr: int, S: int, cap: int, row_bytes: int, rec_offset: int,
                 zero_tail: bool, device_index: int, max_blocks: int | None = None) -> None:
    """Launch ``gs_reload_v*``; same contract as :func:`graphstash.reference.paged_stash.reload`,
    with the output given as its address and ``[S, cap, row_bytes]`` geometry; at most
    ``max_blocks`` blocks if given."""
    width = vector_width(row_bytes, dst_ptr, pool.dev_pages_ptr, pool.host_pages_ptr)
    args = (np.uint64(dst_ptr), np.int64(cap * row_bytes), np.int64(row_bytes), np.int32(S),
            np.int32(cap), *pool.kernel_args[1], np.uint64(pool.table_ptr + 4 * rec_offset),
            np.int32(bool(zero_tail)))
    launch("paged_stash", f"gs_reload_v{width}", _chunks(S * cap * row_bytes, width),
           device_index, args, shared_mem=_segment_smem(S), max_blocks=max_blocks)


def pool_kernel_args(pool) -> tuple[tuple, tuple]:
    """The pool's part of the stash and of the reload argument lists (fixed per allocation)."""
    pages = (ptr(pool.dev_pages), ptr(pool.host_pages), np.int32(pool.num_dev),
             np.int32(pool.num_host), ptr(pool.dev_ring), ptr(pool.host_ring), ptr(pool.state))
    geometry = (np.int32(pool.page_rows), np.int64(pool.page_bytes))
    return (geometry + pages + (ptr(pool.status),), geometry + pages)
