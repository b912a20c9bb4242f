"""Routing plans: where every (token, slot) pair goes, computed on the device with torch ops.

A plan holds only small int32 index tensors of static shape (given a static budget), so
building it never reads back to the host and is recorded by a CUDA graph capture. Dropless
plans (no budget) read the row count back once to size the buffer: eager only.

NOTE [permuted layout]: the permuted buffer has ``budget_rows`` rows. Expert ``e`` owns rows
``[offs[e], offs[e] + padded[e])`` where ``padded[e]`` is its row count rounded up to
``pad_multiple`` and ``offs`` is the exclusive prefix sum of ``padded``. Inside an expert the
rows follow the token order (token-major, then slot); under expert parallelism they follow
the source rank first, then the token order on that rank. Padding rows and the tail past the
last expert are zero. Rows that would land at or past ``budget_rows`` are dropped: they are
not written, their pairs contribute nothing to combine, and the over-budget flag is raised.

NOTE [send layout]: under expert parallelism tokens first go to a send buffer of ``W``
fixed chunks of ``chunk_rows`` rows, chunk ``d`` holding the pairs routed to rank ``d``'s
experts, sorted by expert. ``all_to_all_single`` with equal splits swaps the chunks (a
static shape, so it can be captured), and a second gather moves the received rows into the
permuted layout. Pairs past ``chunk_rows`` for one destination are dropped (flag raised).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _layout as L
from ..status import raise_flag, raise_peak


@dataclasses.dataclass
class RoutingPlan:
    """Index tensors (int32, on the tokens' device) of one dispatch; see NOTE [send layout].

    The *stage* is the layout filled straight from the tokens: the permuted buffer itself on
    one GPU, the send buffer under expert parallelism.
    """
    num_tokens: int
    topk: int
    budget_rows: int
    slot_of_pair: torch.Tensor        # [T, K] stage row of each pair, -1 dropped
    token_of_slot: torch.Tensor       # [S] token feeding each stage row, -1 none
    pair_of_slot: torch.Tensor        # [S] pair (t * K + k) feeding each stage row, -1 none
    tokens_per_expert: torch.Tensor   # [E_local] rows of each local expert (padded, clamped)
    live_rows: torch.Tensor           # [1] rows in use in the permuted buffer (<= budget)
    demand_rows: torch.Tensor         # [1] int64 rows the routing asked for (may exceed budget)
    over_budget: torch.Tensor         # [1] bool: some pair was dropped
    bad_index: torch.Tensor           # [1] bool: some topk index was out of range
    # expert parallel only
    group: object = None
    world_size: int = 1
    chunk_rows: int = 0
    row_of_recv: torch.Tensor | None = None   # [W * C] permuted row of each received row
    recv_of_row: torch.Tensor | None = None   # [R] received row feeding each permuted row

    @property
    def stage_rows(self) -> int:
        return self.token_of_slot.shape[0]


def _pad(counts: torch.Tensor, pad_multiple: int | None) -> torch.Tensor:
    if not pad_multiple or pad_multiple == 1:
        return counts
    return (counts + (pad_multiple - 1)) // pad_multiple * pad_multiple


def _sort_pairs(topk_idx: torch.Tensor, num_experts: int):
    """Stable sort of the pairs by expert; out-of-range indices go to an extra last bin."""
    flat = topk_idx.reshape(-1).long()
    device = flat.device
    bad = (flat < 0) | (flat >= num_experts)
    key = torch.where(bad, torch.full_like(flat, num_experts), flat)
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts               # [E + 1] unpadded starts
    rank = torch.arange(flat.numel(), device=device) - starts[sorted_key]
    bad_any = bad.any().view(1) if flat.numel() else torch.zeros(1, dtype=torch.bool,
                                                                 device=device)
    return sorted_key, order, rank, counts[:num_experts], starts[:num_experts], bad_any


def _scatter_inverse(keys: torch.Tensor, keep: torch.Tensor, rows: int, values: torch.Tensor):
    """int32 [rows]: out[keys[i]] = values[i] where keep[i], -1 elsewhere (keys unique)."""
    out = torch.full((rows + 1,), -1, dtype=torch.int32, device=keys.device)
    target = torch.where(keep, keys, torch.full_like(keys, rows))
    out.scatter_(0, target, values.to(torch.int32))
    return out[:rows]


def _by_order(order: torch.Tensor, values: torch.Tensor, shape) -> torch.Tensor:
    """Undo the sort: out[order[i]] = values[i], int32 of ``shape``."""
    out = torch.empty_like(values)
    out.scatter_(0, order, values)
    return out.to(torch.int32).view(shape)


def _layout(totals: torch.Tensor, pad_multiple, budget_rows: int | None):
    """Padded offsets of the permuted layout (NOTE [permuted layout]) and the budget."""
    padded = _pad(totals, pad_multiple)
    ends = torch.cumsum(padded, 0)
    offs = ends - padded
    demand = ends[-1:] if ends.numel() else torch.zeros(1, dtype=torch.long,
                                                        device=totals.device)
    if budget_rows is None:                                  # dropless: eager host read
        budget_rows = int(demand.item())
    tokens_per_expert = (ends.clamp(max=budget_rows) - offs.clamp(max=budget_rows)).to(torch.int32)
    live = demand.clamp(max=budget_rows).to(torch.int32)
    return offs, budget_rows, tokens_per_expert, live, demand


def raise_plan_flags(status: torch.Tensor, plan: RoutingPlan, dropless: bool) -> None:
    """What a dispatch raises in its status (int32 ``[8]``), on the device: the rows it asked
    for (``SS_TOKENS_PEAK``, a high-water mark) and, with a budget, the sticky over-budget
    flag and ``OVERFLOW_COUNT`` for an expert index out of range. The routing kernels raise
    the same from inside ``gs_route_layout``."""
    raise_peak(status, L.SS_TOKENS_PEAK, plan.demand_rows)
    if not dropless:
        raise_flag(status, L.SS_OVER_BUDGET, plan.over_budget)
        raise_flag(status, L.SS_OVERFLOW, plan.bad_index.to(torch.int32) * L.OVERFLOW_COUNT)


def plan_local(topk_idx: torch.Tensor, num_experts: int, budget_rows: int | None,
               pad_multiple: int | None, *, kernels, status: torch.Tensor) -> RoutingPlan:
    """Plan of a one-GPU dispatch; ``budget_rows=None`` sizes the buffer exactly (dropless).
    The plan's flags are raised in ``status`` (int32 ``[8]``, :func:`raise_plan_flags`).

    With a budget and ``kernels`` that have routing kernels (the CUDA operators, NOTE [moe
    kernels] in ``backend.py``), they build the same plan in three launches instead of some
    fifty small torch operations (``raw_kernels/moe_routing.cu``; this function's torch path
    is their oracle) and raise the flags themselves.
    """
    if (budget_rows is not None and kernels.route_local is not None and topk_idx.is_cuda
            and kernels.route_fits(num_experts)):
        return _plan_local_kernels(topk_idx.contiguous(), num_experts, budget_rows,
                                   pad_multiple, kernels, status)
    T, K = topk_idx.shape
    sorted_key, order, rank, counts, _, bad = _sort_pairs(topk_idx, num_experts)
    offs, R, tpe, live, demand = _layout(counts, pad_multiple, budget_rows)
    valid = sorted_key < num_experts
    row = offs[sorted_key.clamp(max=max(num_experts - 1, 0))] + rank
    keep = valid & (row < R)
    row = torch.where(keep, row, torch.full_like(row, -1))
    pair_of_slot = _scatter_inverse(row, keep, R, order)
    token_of_slot = torch.where(pair_of_slot >= 0, pair_of_slot // K, pair_of_slot)
    plan = RoutingPlan(
        num_tokens=T, topk=K, budget_rows=R, slot_of_pair=_by_order(order, row, (T, K)),
        token_of_slot=token_of_slot, pair_of_slot=pair_of_slot, tokens_per_expert=tpe,
        live_rows=live, demand_rows=demand, over_budget=demand > R, bad_index=bad)
    raise_plan_flags(status, plan, dropless=budget_rows is None)
    return plan


def _plan_local_kernels(topk_idx, num_experts, budget_rows, pad_multiple, ops, status):
    T, K = topk_idx.shape
    device = topk_idx.device

    def i32(*shape):
        return torch.empty(shape, dtype=torch.int32, device=device)

    plan = RoutingPlan(
        num_tokens=T, topk=K, budget_rows=budget_rows, slot_of_pair=i32(T, K),
        token_of_slot=i32(budget_rows), pair_of_slot=i32(budget_rows),
        tokens_per_expert=i32(num_experts), live_rows=i32(1),
        demand_rows=torch.empty(1, dtype=torch.int64, device=device),
        over_budget=torch.empty(1, dtype=torch.bool, device=device),
        bad_index=torch.empty(1, dtype=torch.bool, device=device))
    ops.route_local(topk_idx, num_experts, budget_rows, pad_multiple, status,
                    slot_of_pair=plan.slot_of_pair, pair_of_slot=plan.pair_of_slot,
                    token_of_slot=plan.token_of_slot, tokens_per_expert=plan.tokens_per_expert,
                    live_rows=plan.live_rows, demand_rows=plan.demand_rows,
                    over_budget=plan.over_budget, bad_index=plan.bad_index)
    return plan


def plan_expert_parallel(topk_idx: torch.Tensor, num_experts: int, budget_rows: int | None,
                         pad_multiple: int | None, group, chunk_rows: int | None, *,
                         status: torch.Tensor) -> RoutingPlan:
    """Plan of an expert-parallel dispatch over ``group`` (NOTE [send layout]); its flags are
    raised in ``status`` (int32 ``[8]``, :func:`raise_plan_flags`).

    Runs one ``all_to_all_single`` of the per-expert counts (int32 ``[W, E_local]``) on the
    device; dropless plans (``budget_rows=None``) also all-reduce the largest chunk and read
    it back (eager only).
    """
    import torch.distributed as dist

    T, K = topk_idx.shape
    device = topk_idx.device
    W = dist.get_world_size(group)
    E_l = num_experts // W
    sorted_key, order, rank, counts, starts, bad = _sort_pairs(topk_idx, num_experts)
    valid = sorted_key < num_experts

    # ---- send side: chunk d holds the pairs for rank d's experts, sorted by expert
    per_dst = counts.view(W, E_l).sum(1)                                    # [W]
    dst_start = torch.cumsum(per_dst, 0) - per_dst
    dst = (sorted_key // E_l).clamp(max=W - 1)
    pos = torch.arange(sorted_key.numel(), device=device) - dst_start[dst]
    if chunk_rows is None:
        if budget_rows is not None:
            raise AssertionError("chunk_rows is chosen by dispatch() when a budget is given")
        biggest = per_dst.max().view(1) if W else torch.zeros(1, dtype=torch.long, device=device)
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
        chunk_rows = max(1, int(biggest.item()))
    C = chunk_rows
    keep_send = valid & (pos < C)
    slot = torch.where(keep_send, dst * C + pos, torch.full_like(pos, -1))
    pair_of_slot = _scatter_inverse(slot, keep_send, W * C, order)
    token_of_slot = torch.where(pair_of_slot >= 0, pair_of_slot // K, pair_of_slot)
    start_in_chunk = starts - dst_start.view(W, 1).expand(W, E_l).reshape(-1)   # [E]
    sent = (torch.clamp(start_in_chunk + counts, max=C) - start_in_chunk).clamp(min=0)
    send_over = (per_dst > C).any().view(1)

    # ---- counts exchange: recv_counts[s, e] = rows source rank s sends to local expert e
    recv_counts = torch.empty(W, E_l, dtype=torch.int32, device=device)
    dist.all_to_all_single(recv_counts, sent.to(torch.int32).view(W, E_l).contiguous(),
                           group=group)
    recv_counts = recv_counts.long()

    # ---- receive side: permuted layout of the local experts (NOTE [permuted layout])
    offs, R, tpe, live, demand = _layout(recv_counts.sum(0), pad_multiple, budget_rows)
    chunk_end = torch.cumsum(recv_counts, 1)                                # [W, E_l]
    chunk_start = chunk_end - recv_counts
    from_earlier = torch.cumsum(recv_counts, 0) - recv_counts               # [W, E_l]
    q = torch.arange(C, device=device).expand(W, C).contiguous()
    expert = torch.searchsorted(chunk_end, q, right=True)                   # [W, C]
    in_use = expert < E_l
    e = expert.clamp(max=E_l - 1)
    row = offs[e] + from_earlier.gather(1, e) + q - chunk_start.gather(1, e)
    keep = in_use & (row < R)
    row = torch.where(keep, row, torch.full_like(row, -1)).reshape(-1)
    keep = keep.reshape(-1)
    recv_of_row = _scatter_inverse(row, keep, R, torch.arange(W * C, device=device))
    plan = RoutingPlan(
        num_tokens=T, topk=K, budget_rows=R, slot_of_pair=_by_order(order, slot, (T, K)),
        token_of_slot=token_of_slot, pair_of_slot=pair_of_slot, tokens_per_expert=tpe,
        live_rows=live, demand_rows=demand, over_budget=send_over | (demand > R),
        bad_index=bad, group=group, world_size=W, chunk_rows=C,
        row_of_recv=row.to(torch.int32), recv_of_row=recv_of_row)
    raise_plan_flags(status, plan, dropless=budget_rows is None)
    return plan
