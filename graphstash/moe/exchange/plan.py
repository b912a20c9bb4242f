"""The plan of one expert-parallel dispatch through a transport: where every pair, send slot
and received row goes, computed on the device (``gs_xchg_counts`` + ``gs_xchg_map``).

NOTE [live-row exchange layout]: a sender orders its (token, slot) pairs by global expert,
stably (its *send slots*, the one-device routing plan over all experts with room for every
pair). Every rank pushes its per-expert counts into every rank, so after one barrier each
holds all W x E counts and lays out every receiver itself: receiver ``d`` keeps the permuted
layout of one device (NOTE [permuted layout] in ``graphstash/moe/_routing.py``) over its
local experts, the rows of one expert ordered by source rank, then by the source's pair order,
padded per expert, dropped at the budget. A sender therefore knows the row of each of its
pairs in its receiver's buffer and copies it straight there: only live rows move, and the
received buffer is already the permuted one. Combine sends row ``r`` back to slot
``row_slot[r]`` of rank ``row_peer[r]``, where it is summed into its token.
"""
from __future__ import annotations

import dataclasses

import torch

from . import layout as X
from ... import _layout as L
from ..._checks import forbid_capture
from ...status import raise_flag
from .._routing import plan_local
from .transport import NO_BUDGET, Transport


@dataclasses.dataclass
class ExchangePlan:
    """Index tensors of one dispatch through a transport (int32 on its device unless noted);
    NOTE [live-row exchange layout]. The attributes a ``DispatchHandle`` reads have the names
    and meanings of a ``RoutingPlan``'s."""
    num_tokens: int
    topk: int
    budget_rows: int                  # rows of the permuted buffer of this rank
    num_experts: int
    transport: Transport
    windows: tuple                    # ((lo, hi), ...): receive rounds (one with a budget)
    slot_of_pair: torch.Tensor        # [T, K] send slot of each pair (-1: bad index)
    pair_of_slot: torch.Tensor        # [T * K] pair of each send slot (-1: none)
    token_of_slot: torch.Tensor       # [T * K] token of each send slot (-1: none)
    live_slots: torch.Tensor          # [1] pairs with a valid expert
    bad_index: torch.Tensor           # bool [1]
    cube: torch.Tensor                # [W, E] rows rank s sends to expert g
    work: torch.Tensor                # int64 [XW_ARRAYS * E + 1] (gs_exchange.cuh)
    tokens_per_expert: torch.Tensor   # [E / W] padded rows per local expert, clamped
    live_rows: torch.Tensor           # [1] rows in use in this rank's permuted buffer
    demand_rows: torch.Tensor         # int64 [1] rows the routing asked of this rank
    over_budget: torch.Tensor         # bool [1] this rank's budget dropped rows
    pair_slot: torch.Tensor           # [T, K] send slot of each kept pair, -1 dropped
    slot_peer: torch.Tensor           # [T * K] rank each kept slot goes to, -1 none
    slot_row: torch.Tensor            # [T * K] row there, -1 none
    slot_self: torch.Tensor           # [T * K] the slot itself when kept, -1 otherwise
    row_src: torch.Tensor             # [R] region row of each live received row, -1 padding
    row_peer: torch.Tensor            # [R] rank each received row came from, -1 none
    row_slot: torch.Tensor            # [R] its send slot there
    status: torch.Tensor | None = None  # int32 [8] that every later barrier raises a failure in
    status_updated: bool = True       # gs_xchg_counts raised the status flags
    # [(rows [R, H], their version)]: input gradients the experts' backward already pushed
    # home (NOTE [exchange beside the experts] in overlap.py); one list shared by keep_rows
    sent_home: list = dataclasses.field(default_factory=list)

    @property
    def group(self) -> Transport:
        """What makes the dispatch expert-parallel (a ``DispatchHandle`` is ``local`` when
        this is None): the transport."""
        return self.transport

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def pairs(self) -> int:
        return self.num_tokens * self.topk

    def keep_rows(self, rows: int) -> "ExchangePlan":
        """This plan with this rank's experts computing on the first ``rows`` rows of its
        budget only (NOTE [rows the stash keeps] in ``graphstash/stash/plan.py``): the
        permuted buffer, the counts (clamped so their sum never exceeds ``rows``) and the rows
        sent back shrink to them. Every rank still pushes into the others' whole budget (the
        receive rounds, and so the barriers, stay those of every rank). Where the routing
        filled more than ``rows`` rows of this rank, the rows past them go back to no token:
        the status gets ``OVERFLOW_POOL`` (a step to rerun, as a stash too small for its
        rows). Capturable: no host read.

        Args:
            rows: an int in ``[1, budget_rows]``.
        """
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= self.budget_rows:
            raise ValueError(f"rows: expected an int in [1, {self.budget_rows}] (the plan's "
                             f"budget rows), got {rows!r}")
        if rows == self.budget_rows:
            return self
        ends = torch.cumsum(self.tokens_per_expert, 0, dtype=torch.int64).clamp_(max=rows)
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).to(torch.int32)
        if self.status is not None:
            raise_flag(self.status, L.SS_OVERFLOW,
                       (self.live_rows > rows).to(torch.int32) * L.OVERFLOW_POOL)
        return dataclasses.replace(
            self, budget_rows=rows, tokens_per_expert=counts,
            live_rows=self.live_rows.clamp(max=rows), row_src=self.row_src[:rows],
            row_peer=self.row_peer[:rows], row_slot=self.row_slot[:rows])


def plan_exchange(topk_idx: torch.Tensor, num_experts: int, budget_rows: int | None,
                  pad_multiple: int | None, transport: Transport, *, row_bytes: int,
                  status: torch.Tensor | None, moe_ops) -> ExchangePlan:
    """Exchange the counts and plan one dispatch of this rank's pairs (a collective).

    Args:
        topk_idx: int32/int64 ``[T, K]`` expert of each slot, on the transport's device.
        num_experts: experts over all ranks (rank ``r`` owns ``[r * E / W, (r + 1) * E / W)``).
        budget_rows: rows of this rank's permuted buffer (the same on every rank), or None
            for dropless: each rank's buffer is sized from the counts (one host read; eager
            only), received in rounds of the transport's capacity.
        pad_multiple: round each expert's rows up to it (None: 1).
        transport: the exchange's transport.
        row_bytes: bytes of one dispatched row (every rank must dispatch the same).
        status: int32 ``[8]`` status the counts kernel raises (over budget, tokens peak, bad
            index, exchange failure), or None.
        moe_ops: the dispatch kernels (``graphstash._kernels.moe`` or the reference).
    """
    T, K = topk_idx.shape
    P = T * K
    W = transport.world_size
    E = num_experts
    pad = pad_multiple or 1
    device = topk_idx.device
    dropless = budget_rows is None
    transport.require(rows=P, row_bytes=row_bytes, num_experts=E, name="topk_idx")
    if not dropless:
        transport.require(rows=budget_rows, row_bytes=row_bytes, num_experts=E, name="budget")
    # every pair has a send slot (budget P): only out-of-range experts are left out
    scratch = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    route = plan_local(topk_idx, E, max(P, 1), None, kernels=moe_ops, status=scratch)

    def i32(*shape):
        return torch.empty(shape, dtype=torch.int32, device=device)

    cube, work = i32(W, E), torch.empty(X.work_size(E), dtype=torch.int64, device=device)
    tpe, live = i32(E // W), i32(1)
    demand = torch.empty(1, dtype=torch.int64, device=device)
    over = torch.empty(1, dtype=torch.bool, device=device)
    transport.exchange_counts(route.tokens_per_expert, E, NO_BUDGET if dropless else budget_rows,
                              pad, row_bytes, route.bad_index, status, cube=cube, work=work,
                              tokens_per_expert=tpe, live_rows=live, demand_rows=demand,
                              over_budget=over)
    if dropless:
        rows, clip, windows = _dropless_rows(cube, transport, pad)
    else:
        rows, clip, windows = budget_rows, budget_rows, ((0, budget_rows),)
    pair_slot, slot_peer, slot_row, slot_self = i32(T, K), i32(P), i32(P), i32(P)
    row_src, row_peer, row_slot = i32(rows), i32(rows), i32(rows)
    transport.exchange_map(work, cube, W, transport.rank, E, route.slot_of_pair.reshape(-1),
                           clip, live, rows, pair_slot, slot_peer, slot_row, slot_self, row_src,
                           row_peer, row_slot)
    return ExchangePlan(
        num_tokens=T, topk=K, budget_rows=rows, num_experts=E, transport=transport,
        windows=windows, slot_of_pair=route.slot_of_pair, pair_of_slot=route.pair_of_slot,
        token_of_slot=route.token_of_slot, live_slots=route.live_rows,
        bad_index=route.bad_index, cube=cube, work=work, tokens_per_expert=tpe, live_rows=live,
        demand_rows=demand, over_budget=over, pair_slot=pair_slot, slot_peer=slot_peer,
        slot_row=slot_row, slot_self=slot_self, row_src=row_src, row_peer=row_peer,
        row_slot=row_slot, status=status)


def _dropless_rows(cube: torch.Tensor, transport: Transport, pad: int):
    """Rows of this rank's dropless buffer and the receive rounds every rank runs: windows of
    ``capacity_rows`` over the largest receiver (one host read of the counts)."""
    forbid_capture("a dropless expert-parallel dispatch (it reads the counts back)")
    transport.check()
    W, E = cube.shape
    El = E // W
    total = cube.to(torch.int64).cpu().sum(0)
    padded = (total + pad - 1) // pad * pad
    demand = padded.view(W, El).sum(1).tolist()
    cap = transport.capacity_rows
    rounds = max(1, -(-max(demand) // cap))
    windows = tuple((i * cap, (i + 1) * cap) for i in range(rounds))
    return demand[transport.rank], NO_BUDGET, windows
