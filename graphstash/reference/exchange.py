"""Pure-torch twin of the expert-parallel exchange kernels (``raw_kernels/moe_exchange.cu``).

:func:`layout` and :func:`exchange_map` compute what ``gs_xchg_counts`` (after its barrier)
and ``gs_xchg_map`` compute, from the same inputs, into the same outputs, bit for bit: the
GPU tests compare them. :func:`exchange_counts`, :func:`push_rows`, :func:`barrier` and
:func:`all_reduce_flags_` do what the other kernels do, with gloo collectives over a process
group instead of stores into the peers' regions: every rank writes what it receives into its
own region (a CPU tensor laid out as on the GPU), and the private state counts epochs and bytes
as the kernels do. This is the CPU backend of :mod:`graphstash.moe.exchange`.
"""
from __future__ import annotations

import torch

from .. import _layout as L
from ..moe.exchange import layout as X

_INT32_MAX = 2**31 - 1
_COUNT_MAX = 2**30


def _padded(n: torch.Tensor, pad: int) -> torch.Tensor:
    return (n + pad - 1) // pad * pad if pad > 1 else n


def layout(cube: torch.Tensor, rank: int, world_size: int, num_experts: int, budget: int,
           pad_multiple: int, *, work: torch.Tensor, tokens_per_expert: torch.Tensor,
           live_rows: torch.Tensor, demand_rows: torch.Tensor,
           over_budget: torch.Tensor) -> None:
    """The permuted layout of every receiver, from the counts of every source.

    Args:
        cube: int32 ``[W, E]``: ``cube[s, g]`` rows source rank ``s`` sends to global expert
            ``g`` (expert ``g`` lives on rank ``g // (E / W)``).
        rank: this rank; budget: rows of its permuted buffer; pad_multiple: >= 1.
        work: int64 ``[XW_ARRAYS * E + 1]`` workspace, filled (``gs_exchange.cuh``).
        tokens_per_expert: int32 ``[E / W]``; live_rows: int32 ``[1]``; demand_rows: int64
            ``[1]``; over_budget: bool ``[1]``: this rank's, as the one-GPU plan defines them
            (NOTE [permuted layout] in ``graphstash/moe/_routing.py``).
    """
    W, E = world_size, num_experts
    El = E // W
    c = cube.to(torch.int64)
    total = c.sum(0)
    pad = _padded(total, pad_multiple).view(W, El)
    offs = (torch.cumsum(pad, 1) - pad).reshape(E)
    before_s = torch.cumsum(c, 0) - c                        # rows of earlier sources, [W, E]
    before_g = torch.cumsum(c, 1) - c                        # earlier experts of a source, [W, E]
    mine = slice(rank * El, (rank + 1) * El)
    work.zero_()
    work[X.XW_OFFS * E:(X.XW_OFFS + 1) * E] = offs
    work[X.XW_TOTAL * E:(X.XW_TOTAL + 1) * E] = total
    work[X.XW_DST * E:(X.XW_DST + 1) * E] = offs + before_s[rank]
    work[X.XW_RECV * E:(X.XW_RECV + 1) * E] = (offs[mine] + before_s[:, mine]).reshape(E)
    work[X.XW_SRC * E:(X.XW_SRC + 1) * E] = before_g[:, mine].reshape(E)
    work[X.XW_SLOT * E:X.XW_SLOT * E + E] = before_g[rank]
    work[X.XW_SLOT * E + E] = c[rank].sum()
    ends = offs[mine] + pad[rank]
    tokens_per_expert.copy_((ends.clamp(max=budget) - offs[mine].clamp(max=budget)).to(torch.int32))
    need = pad[rank].sum().view(1)
    demand_rows.copy_(need)
    live_rows.copy_(need.clamp(max=min(budget, _INT32_MAX)).to(torch.int32))
    over_budget.copy_(need > budget)


def raise_status(status: torch.Tensor | None, demand_rows: torch.Tensor, budget: int,
                 bad_index: torch.Tensor | None, failed: bool) -> None:
    """The flags ``gs_xchg_counts`` raises in ``status`` (int32 ``[8]``) after its layout."""
    if status is None:
        return
    peak = status.narrow(0, L.SS_TOKENS_PEAK, 1)
    peak.copy_(torch.maximum(peak, demand_rows.clamp(max=_INT32_MAX).to(torch.int32)))
    status.narrow(0, L.SS_OVER_BUDGET, 1).bitwise_or_((demand_rows > budget).to(torch.int32))
    overflow = status.narrow(0, L.SS_OVERFLOW, 1)
    if bad_index is not None:
        overflow.bitwise_or_(bad_index.to(torch.int32) * L.OVERFLOW_COUNT)
    if failed:
        overflow.bitwise_or_(L.OVERFLOW_EXCHANGE)


def _last_at_most(sorted_values: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per ``v``: the last index i with ``sorted_values[i] <= v`` (0 when none)."""
    return (torch.searchsorted(sorted_values, v, right=True) - 1).clamp(min=0)


def exchange_map(work: torch.Tensor, cube: torch.Tensor, world_size: int, rank: int,
                 num_experts: int, slot_of_pair: torch.Tensor, clip: int,
                 live_rows: torch.Tensor, rows: int, pair_slot: torch.Tensor,
                 slot_peer: torch.Tensor, slot_row: torch.Tensor, slot_self: torch.Tensor,
                 row_src: torch.Tensor, row_peer: torch.Tensor, row_slot: torch.Tensor) -> None:
    """Where each pair, send slot and received row goes or came from (``gs_xchg_map``).

    Args:
        work, cube: from :func:`layout` (int64 ``[XW_ARRAYS * E + 1]``, int32 ``[W, E]``).
        slot_of_pair: int32 ``[P]`` (P = tokens x topk): each pair's slot in this rank's send
            order (experts ascending, pairs in order inside one), -1 for none.
        clip: rows past which a receiver drops (its budget); live_rows: int32 ``[1]``, this
            rank's live received rows; rows: length of the ``row_*`` outputs.
        pair_slot, slot_peer, slot_row, slot_self: int32 ``[P]`` outputs; row_src, row_peer,
            row_slot: int32 ``[rows]`` outputs (see ``raw_kernels/moe_exchange.cu``).
    """
    W, E = world_size, num_experts
    El = E // W
    device = work.device
    P = slot_of_pair.numel()
    offs = work[X.XW_OFFS * E:(X.XW_OFFS + 1) * E]
    total = work[X.XW_TOTAL * E:(X.XW_TOTAL + 1) * E]
    dst = work[X.XW_DST * E:(X.XW_DST + 1) * E]
    recv = work[X.XW_RECV * E:(X.XW_RECV + 1) * E].view(W, El)
    src = work[X.XW_SRC * E:(X.XW_SRC + 1) * E].view(W, El)
    slot = work[X.XW_SLOT * E:X.XW_SLOT * E + E + 1]
    n_slots = torch.clamp(slot[E], max=P)
    none = torch.full((), -1, dtype=torch.int64, device=device)

    def kept_row(q: torch.Tensor):
        g = _last_at_most(slot[:E].contiguous(), q)
        r = dst[g] + (q - slot[g])
        return g, r, (q >= 0) & (q < n_slots) & (r < clip) & (r >= 0)

    q = torch.arange(P, dtype=torch.int64, device=device)
    g, r, keep = kept_row(q)
    slot_peer.copy_(torch.where(keep, g // El, none).to(torch.int32))
    slot_row.copy_(torch.where(keep, r, none).to(torch.int32))
    slot_self.copy_(torch.where(keep, q, none).to(torch.int32))
    qq = slot_of_pair.reshape(-1).to(torch.int64)
    _, _, keep_pair = kept_row(qq.clamp(min=0))
    pair_slot.copy_(torch.where(keep_pair & (qq >= 0), qq, none).to(torch.int32).view_as(pair_slot))

    i = torch.arange(rows, dtype=torch.int64, device=device)
    n_live = min(max(int(live_rows.reshape(-1)[0]), 0), rows) if rows else 0
    mine = offs[rank * El:(rank + 1) * El].contiguous()
    e = _last_at_most(mine, i) if El else torch.zeros_like(i)
    gg = rank * El + e
    in_expert = (i - offs[gg]) < total[gg]
    later = recv[1:, :].t()[e] if W > 1 else i.new_zeros(rows, 0)   # [rows, W - 1]
    s = (later <= i.unsqueeze(1)).sum(1)
    j = i - recv[s, e]
    ok = (i < n_live) & in_expert & (j >= 0) & (j < cube.to(torch.int64)[s, gg])
    row_src.copy_(torch.where(ok, i, none).to(torch.int32))
    row_peer.copy_(torch.where(ok, s, none).to(torch.int32))
    row_slot.copy_(torch.where(ok, src[s, e] + j, none).to(torch.int32))


# ---- the collectives, over gloo --------------------------------------------------------------
def barrier(state: torch.Tensor, world_size: int, status: torch.Tensor | None = None) -> None:
    """What ``gs_xchg_barrier`` counts: one epoch, ``8 x W`` signal bytes, and the failure in
    ``status``. gloo's collectives are synchronous, so nothing else has to wait."""
    state[X.XS_EPOCH] += 1
    state[X.XS_META_BYTES] += 8 * world_size
    if status is not None and int(state[X.XS_ERROR]) != 0:
        status.narrow(0, L.SS_OVERFLOW, 1).bitwise_or_(L.OVERFLOW_EXCHANGE)


def exchange_counts(group, rank: int, world_size: int, state: torch.Tensor,
                    counts_field: torch.Tensor, send_counts: torch.Tensor, num_experts: int,
                    budget: int, pad_multiple: int, row_bytes: int,
                    bad_index: torch.Tensor | None, status: torch.Tensor | None, *,
                    cube: torch.Tensor, work: torch.Tensor, tokens_per_expert: torch.Tensor,
                    live_rows: torch.Tensor, demand_rows: torch.Tensor,
                    over_budget: torch.Tensor) -> None:
    """``gs_xchg_counts`` over gloo: all-gather every rank's header and counts into
    ``counts_field`` (int32 ``[W, X_HEADER + max_experts]``, this rank's COUNTS), check the
    headers, then :func:`layout` and :func:`raise_status`."""
    import torch.distributed as dist

    W, E = world_size, num_experts
    budget32 = min(budget, _INT32_MAX)
    header = torch.tensor([E, budget32, pad_multiple, row_bytes], dtype=torch.int32)
    row = torch.cat([header, send_counts.to(torch.int32).clamp(min=0).cpu()])
    gathered = [torch.empty_like(row) for _ in range(W)]
    dist.all_gather(gathered, row, group=group)
    counts_field[:, :X.X_HEADER + E] = torch.stack(gathered).to(counts_field.device)
    state[X.XS_META_BYTES] += 4 * W * (X.X_HEADER + E)
    barrier(state, W)
    for s in range(W):
        if counts_field[s, :X.X_HEADER].tolist() != header.tolist():
            _record_error(state, X.XE_MISMATCH, s)
    cube.copy_(counts_field[:, X.X_HEADER:X.X_HEADER + E].clamp(0, _COUNT_MAX))
    layout(cube, rank, W, E, budget, pad_multiple, work=work,
           tokens_per_expert=tokens_per_expert, live_rows=live_rows, demand_rows=demand_rows,
           over_budget=over_budget)
    raise_status(status, demand_rows, budget, bad_index, bool(state[X.XS_ERROR] != 0))


def _record_error(state: torch.Tensor, code: int, peer: int) -> None:
    if int(state[X.XS_ERROR]) == 0:
        state[X.XS_ERROR] = code
        state[X.XS_ERROR_PEER] = peer
        state[X.XS_ERROR_EPOCH] = state[X.XS_EPOCH]


def push_rows(group, rank: int, world_size: int, state: torch.Tensor, field: torch.Tensor,
              src: torch.Tensor, src_index: torch.Tensor | None, dest_peer: torch.Tensor,
              dest_row: torch.Tensor, count: torch.Tensor, window_lo: int,
              window_hi: int, extra=None) -> None:
    """``gs_xchg_push`` over gloo: item ``i < count`` sends row ``src_index[i]`` (or ``i``) of
    ``src`` to rank ``dest_peer[i]``, which writes it at row ``dest_row[i] - window_lo`` of its
    ``field`` (uint8 ``[capacity_rows, row_bytes]``, this rank's, ``row_bytes`` those of a
    ``src`` row) when ``window_lo <=
    dest_row[i] < window_hi``. A collective: every rank calls it, with or without rows.

    Args:
        src: ``[N, ...]`` contiguous rows; dest_peer, dest_row: int32 ``[M]``; count: int32
            ``[1]``, how many of the M items are live.
        extra: ``(field2, values, index)``: each sent item also sends ``values[index[i]]``
            (or ``values[i]``; 2, 4 or 8 bytes), written at the same row of ``field2`` (uint8
            ``[capacity_rows, element bytes]``), as the push kernel moves a row's weight.
    """
    import torch.distributed as dist

    W = world_size
    rows_src = src.shape[0]
    capacity, row_bytes = field.shape
    data = src.contiguous().view(torch.uint8).view(rows_src, row_bytes)
    n = min(max(int(count.reshape(-1)[0]), 0), dest_peer.shape[0])
    peer = dest_peer[:n].to(torch.int64)
    row = dest_row[:n].to(torch.int64)
    s = src_index[:n].to(torch.int64) if src_index is not None else torch.arange(n)
    ok = ((peer >= 0) & (peer < W) & (row >= window_lo) & (row < window_hi)
          & (row - window_lo < capacity) & (s >= 0) & (s < rows_src))
    order = torch.sort(torch.where(ok, peer, torch.full_like(peer, W)), stable=True)
    picked = order.indices[:int(ok.sum())]
    send_counts = torch.bincount(peer[picked], minlength=W)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_rows = (row[picked] - window_lo).contiguous()
    recv_rows = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
    splits_out, splits_in = recv_counts.tolist(), send_counts.tolist()
    dist.all_to_all_single(recv_rows, send_rows, splits_out, splits_in, group=group)
    send_data = data[s[picked]].contiguous().view(torch.int32 if row_bytes % 4 == 0 else torch.uint8)
    recv_data = torch.empty(recv_rows.shape[0], *send_data.shape[1:], dtype=send_data.dtype)
    dist.all_to_all_single(recv_data, send_data, splits_out, splits_in, group=group)
    if recv_rows.numel():
        field[recv_rows] = recv_data.view(torch.uint8).view(-1, row_bytes)
    sent_bytes = torch.full((picked.numel(),), row_bytes, dtype=torch.int64)
    if extra is not None:
        field2, values, index = extra
        elem = values.element_size()
        flat = values.contiguous().view(torch.uint8).view(-1, elem)
        s2 = (index[:n].to(torch.int64) if index is not None else torch.arange(n))[picked]
        ok2 = (s2 >= 0) & (s2 < flat.shape[0])
        sent_bytes += ok2.to(torch.int64) * elem
        counts2 = torch.bincount(peer[picked][ok2], minlength=W)
        recv2 = torch.empty_like(counts2)
        dist.all_to_all_single(recv2, counts2, group=group)
        out2, in2 = recv2.tolist(), counts2.tolist()
        rows2 = torch.empty(int(recv2.sum()), dtype=torch.int64)
        dist.all_to_all_single(rows2, send_rows[ok2].contiguous(), out2, in2, group=group)
        data2 = torch.empty(rows2.shape[0], elem, dtype=torch.uint8)
        dist.all_to_all_single(data2, flat[s2[ok2]].contiguous(), out2, in2, group=group)
        if rows2.numel():
            field2[rows2] = data2
    mine = peer[picked] == rank
    state[X.XS_ROW_BYTES_LOCAL] += int(sent_bytes[mine].sum())
    state[X.XS_ROW_BYTES_REMOTE] += int(sent_bytes[~mine].sum())
    state[X.XS_ROWS_SENT] += picked.numel()


def all_reduce_flags_(group, world_size: int, state: torch.Tensor, flags: torch.Tensor,
                      peaks: torch.Tensor | None = None) -> None:
    """``gs_xchg_flags`` over gloo: ``flags`` (int32 ``[n]``) summed over the ranks in place;
    at least 1 each after a failed exchange; ``peaks`` (int32 ``[m]`` or None) replaced by
    their maximum over the ranks."""
    import torch.distributed as dist

    m = 0 if peaks is None else peaks.numel()
    state[X.XS_META_BYTES] += 4 * world_size * (flags.numel() + m)
    summed = flags.to(torch.int64)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    if m:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    barrier(state, world_size)
    if int(state[X.XS_ERROR]) != 0:
        summed = summed.clamp(min=1)
    flags.copy_(summed.clamp(max=_INT32_MAX).to(torch.int32))
