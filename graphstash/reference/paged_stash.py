"""Pure-torch paged stash: the CPU backend and the oracle for the CUDA kernels.

Same arguments, same page order (NOTE [page order] in ``raw_kernels/paged_stash.cu``), same
record, ring and status updates as ``gs_stash_v*`` / ``gs_reload_v*``. It reads counts and
ring counters back to the host, so it is neither fast nor capturable: that is the kernels' job.
"""
from __future__ import annotations

import torch

from .. import _layout as L


def _pages_per_segment(counts: list[int], page_rows: int) -> list[int]:
    return [(n + page_rows - 1) // page_rows for n in counts]


def _page_view(pool, page_id: int) -> torch.Tensor:
    """uint8 [page_bytes] view of one page, device or host tier."""
    if page_id < pool.num_dev:
        return pool.dev_pages[page_id]
    return pool.host_pages[page_id - pool.num_dev]


def stash(pool, src: torch.Tensor, counts: torch.Tensor, rec_offset: int) -> None:
    """Stash the live rows of ``src`` into pages of ``pool``; write the handle record.

    Args:
        pool: the buffer's ``_Pool`` (pages, rings, state, status, record table).
        src: uint8 ``[S, cap, row_bytes]`` byte view of the tensor, on the pool's device.
        counts: int32/int64 ``[S]`` live rows per segment, on the pool's device.
        rec_offset: start of this handle's record in ``pool.table``.
    """
    S, cap, row_bytes = src.shape
    P = pool.page_rows
    raw = [int(v) for v in counts.tolist()]
    bad = any(n < 0 or n > cap for n in raw)
    n = [0 if (v < 0 or v > cap) else v for v in raw]
    pages = _pages_per_segment(n, P)
    total = sum(pages)
    st = pool.state.tolist()
    dev_head, dev_tail = st[L.ST_DEV_HEAD], st[L.ST_DEV_TAIL]
    host_head, host_tail = st[L.ST_HOST_HEAD], st[L.ST_HOST_TAIL]
    dev_take = 0 if bad else min(total, dev_tail - dev_head)
    host_take = 0 if bad else total - dev_take
    stored = not bad and host_take <= host_tail - host_head

    rec = pool.table[rec_offset: rec_offset + L.H_HEADER + S + S * ((cap + P - 1) // P)]
    status = pool.status
    if stored:
        dev_ring = pool.dev_ring.tolist()
        host_ring = pool.host_ring.tolist()
        ids = [dev_ring[(dev_head + g) % pool.num_dev] for g in range(dev_take)]
        ids += [host_ring[(host_head + k) % pool.num_host] for k in range(host_take)]
        g = 0
        for s in range(S):
            for lp in range(pages[s]):
                rows = min(P, n[s] - lp * P)
                chunk = src[s, lp * P: lp * P + rows].reshape(-1)
                _page_view(pool, ids[g])[: rows * row_bytes].copy_(chunk)
                g += 1
        if total:
            rec[L.H_HEADER + S: L.H_HEADER + S + total] = torch.tensor(ids, dtype=torch.int32)
        st[L.ST_DEV_HEAD] = dev_head + dev_take
        st[L.ST_HOST_HEAD] = host_head + host_take
        dev_used = pool.num_dev - (dev_tail - st[L.ST_DEV_HEAD])
        host_used = pool.num_host - (host_tail - st[L.ST_HOST_HEAD])
        st[L.ST_DEV_PEAK] = max(st[L.ST_DEV_PEAK], dev_used)
        st[L.ST_HOST_PEAK] = max(st[L.ST_HOST_PEAK], host_used)
        if host_take > 0:
            status[L.SS_HOST_SPILL] = 1
    else:
        reason = L.OVERFLOW_COUNT if bad else L.OVERFLOW_POOL
        status[L.SS_OVERFLOW] = int(status[L.SS_OVERFLOW]) | reason
    if S:
        rec[L.H_COUNTS: L.H_COUNTS + S] = torch.tensor(n, dtype=torch.int32)
    rec[L.H_VALID] = 1 if stored else 0
    rec[L.H_PAGES] = 0 if bad else total
    rec[L.H_DEV_PAGES] = dev_take if stored else 0
    rec[L.H_HOST_PAGES] = host_take if stored else 0
    if not bad:
        st[L.ST_DEMAND] += total
        st[L.ST_DEMAND_PEAK] = max(st[L.ST_DEMAND_PEAK], st[L.ST_DEMAND])
        rows_total = sum(n)
        st[L.ST_TOKENS_PEAK] = max(st[L.ST_TOKENS_PEAK], rows_total)
        status[L.SS_TOKENS_PEAK] = max(int(status[L.SS_TOKENS_PEAK]), min(rows_total, 2**31 - 1))
    pool.state.copy_(torch.tensor(st, dtype=torch.int64))


def reload(pool, dst: torch.Tensor, rec_offset: int, zero_tail: bool) -> None:
    """Copy a stashed tensor back into ``dst`` and return its pages to their rings.

    Args:
        pool: the buffer's ``_Pool``.
        dst: uint8 ``[S, cap, row_bytes]`` byte view of the output, on the pool's device.
        rec_offset: start of the handle's record in ``pool.table``.
        zero_tail: also write zeros into rows ``[n_s, cap)`` of every segment.
    """
    S, cap, row_bytes = dst.shape
    P = pool.page_rows
    head = pool.table[rec_offset: rec_offset + L.H_HEADER + S].tolist()
    valid, total = head[L.H_VALID], head[L.H_PAGES]
    dev_pages, host_pages = head[L.H_DEV_PAGES], head[L.H_HOST_PAGES]
    n = head[L.H_COUNTS: L.H_COUNTS + S]
    st = pool.state.tolist()
    if valid == 1:
        ids = pool.table[rec_offset + L.H_HEADER + S: rec_offset + L.H_HEADER + S + total].tolist()
        g = 0
        for s in range(S):
            for lp in range((n[s] + P - 1) // P):
                rows = min(P, n[s] - lp * P)
                page = _page_view(pool, ids[g])[: rows * row_bytes]
                dst[s, lp * P: lp * P + rows].copy_(page.view(rows, row_bytes))
                g += 1
            if zero_tail:
                dst[s, n[s]:].zero_()
        dev_tail, host_tail = st[L.ST_DEV_TAIL], st[L.ST_HOST_TAIL]
        if dev_pages:
            slots = [(dev_tail + k) % pool.num_dev for k in range(dev_pages)]
            pool.dev_ring[slots] = torch.tensor(ids[:dev_pages], dtype=torch.int32,
                                                device=pool.dev_ring.device)
        if host_pages:
            slots = [(host_tail + k) % pool.num_host for k in range(host_pages)]
            pool.host_ring[slots] = torch.tensor(ids[dev_pages:], dtype=torch.int32,
                                                 device=pool.host_ring.device)
        st[L.ST_DEV_TAIL] = dev_tail + dev_pages
        st[L.ST_HOST_TAIL] = host_tail + host_pages
    if valid >= 0:
        st[L.ST_DEMAND] -= total
    pool.table[rec_offset + L.H_VALID] = -1
    pool.state.copy_(torch.tensor(st, dtype=torch.int64))
