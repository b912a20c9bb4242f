"""Expert parallelism that moves each token once per rank: the tokens are gathered on every
rank, each rank's experts take the rows routed to them from the gathered tokens, and the
partial outputs are summed back onto their tokens' ranks.

NOTE [gathered tokens]: the live rows move a token once for each of its top-K experts: at
qwen3-30b-a3b widths (top-8 of 128 experts) over two ranks, four rows of every token cross
the links in each of the four pushes of a layer, and those bytes are what the live rows' step
spends beyond the step with no exchange (docs/exchange.md, "The push on 16 SMs"). Summed over
its experts on a rank, a token needs to cross to that rank only once, and its output to come
back once. :class:`GatheredTokens` does that with two collectives of fixed size that NCCL
runs inside a CUDA graph: ``all_gather_into_tensor`` of the ``[T, H]`` tokens (every rank
then holds the ``[W * T, H]`` tokens of the group, and their routing), the one-device
dispatch, experts and combine over its own experts (:class:`~graphstash.moe.OneDevice`, the
same kernels and budget as one GPU), and ``reduce_scatter_tensor`` of the ``[W * T, H]``
partial outputs, each token's sum of the experts this rank holds. Backward is the same
movement reversed (the gradients of the outputs gathered, those of the tokens summed back).

Bytes: a rank receives ``(W - 1) x T`` rows per collective, where the live rows carry about
``T x K x (W - 1) / W``: at top-8 of 128 over two ranks 4x fewer, over four 2x fewer, over
eight the same; at top-2 (mixtral-8x7b widths) over two ranks the same and over four 1.5x
more. The buffer is the group's tokens, not a budget, so no routing overflows it; the
experts' budget (their permuted rows) is the one-device budget of the rows this rank
receives, flagged and rerun as on one GPU.

A token routed to no expert of a rank still travels to it (the gather is dense); its partial
output is zero. Sums: each token's output is the sum over ranks of the sum over each rank's
experts, so in bfloat16 it is rounded once per rank where one device rounds once: within
the rounding of a bfloat16 sum of ``W`` terms of the one-device output.

What the experts keep for their first GEMM's weight gradient: the rows are a gather of the
``[W * T, H]`` gathered tokens along the local plan, as on one device, so where the gathered
tokens have fewer rows than the budget (``W * T < budget_rows``: at top-8 with capacity
factor 1.25, up to nine ranks) the experts keep those tokens and take their rows from them
again in backward (NOTE [regathered input] in ``graphstash/moe/mlp.py``), with no
collective; otherwise they keep the ``[budget, H]`` rows. At qwen3-30b-a3b widths over four
ranks that is 128 MiB a layer kept where the rows were 320 (and 1280 once skew grew the
budget to the worst case); at mixtral-8x7b widths (top-2) over four ranks the rows are the
smaller and stay kept. Each rank decides for its own plan (in dropless reruns the budget is
each rank's own demand); no rank waits on another for it.

With ``resend=True`` the experts' backward gathers the tokens again (one more
``all_gather`` of ``[T, H]``) and takes their rows from them: only the ``[T, H]`` tokens are
kept, which the router keeps anyway, at the price of one collective a layer in backward.
"""
from __future__ import annotations

import dataclasses

import torch

from ... import _layout as L
from ..._checks import require_positive_int
from ...status import raise_flag, raise_peak
from .. import OneDevice
from .._routing import RoutingPlan, plan_local

__all__ = ["GatheredPlan", "GatheredTokens"]

_ONE_DEVICE = OneDevice()


@dataclasses.dataclass
class GatheredPlan:
    """One dispatch through :class:`GatheredTokens`: ``local`` is the one-device plan of the
    group's ``[W * T]`` gathered tokens over this rank's experts (its counts, budget and
    flags are this rank's); ``num_tokens`` is this rank's ``T``. ``keeps_tokens``: the
    experts keep the gathered tokens (fewer rows than the budget) and take their rows from
    them again in backward (NOTE [gathered tokens]); ``kept_tokens`` holds them from the
    dispatch until :meth:`GatheredTokens.regather_source` hands them to the dispatch's
    handle."""
    num_tokens: int
    topk: int
    num_experts: int
    local: RoutingPlan
    keeps_tokens: bool = False
    kept_tokens: torch.Tensor | None = None

    @property
    def budget_rows(self) -> int:
        return self.local.budget_rows

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.local.tokens_per_expert

    @property
    def live_rows(self) -> torch.Tensor:
        return self.local.live_rows

    @property
    def demand_rows(self) -> torch.Tensor:
        return self.local.demand_rows

    @property
    def over_budget(self) -> torch.Tensor:
        return self.local.over_budget


def _gather(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[W * N, ...]``: every rank's ``x`` (``[N, ...]``), in rank order."""
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty(world * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _sum_back(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[N, ...]``: the sum over ranks of this rank's block of every rank's ``x``
    (``[W * N, ...]``)."""
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty(x.shape[0] // world, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class _Gather(torch.autograd.Function):
    """x [N, ...] -> [W * N, ...]; backward sums each rank's block back onto it."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _gather(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _sum_back(grad, ctx.group, ctx.world), None, None


class _SumBack(torch.autograd.Function):
    """x [W * N, ...] -> [N, ...] summed over ranks; backward gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _sum_back(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.world), None, None


class GatheredTokens:
    """Expert parallel over ``group`` by gathering the tokens and summing the outputs back
    (NOTE [gathered tokens]): rank ``r`` owns experts ``[r * E / W, (r + 1) * E / W)``; every
    rank calls dispatch and combine in the same order. ``resend=True``: the experts' backward
    gathers the tokens again instead of keeping their rows. On the GPU the group is NCCL's
    (both collectives are captured in a CUDA graph); on the CPU, gloo's. Example::

        exchange = GatheredTokens(group)
        permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, exchange=exchange)
    """

    kind = "gathered tokens"
    keeps_rows = False
    transport = None            # no region: nothing bounds an adaptive budget

    def __init__(self, group=None, *, resend: bool = False):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call "
                             "init_process_group() first")
        if not isinstance(resend, bool):
            raise TypeError(f"resend: expected a bool, got {type(resend).__name__}")
        self.group = group
        self.resend = resend
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __repr__(self) -> str:
        return (f"GatheredTokens(world_size={self.world_size}"
                f"{', resend=True' if self.resend else ''})")

    def for_tokens(self, x: torch.Tensor) -> "GatheredTokens":
        return self

    def plan_dispatch(self, topk_idx, num_experts, budget, pad_multiple, *, row_bytes, status,
                      kernels) -> GatheredPlan:
        """Gather every rank's routing (a collective) and plan the one-device dispatch of the
        group's tokens over this rank's experts; raises this rank's flags in ``status``."""
        T, K = topk_idx.shape
        W = self.world_size
        local_experts = num_experts // W
        require_positive_int("num_experts", local_experts)
        first = self.rank * local_experts
        idx = topk_idx.to(torch.int32)
        bad = ((idx < 0) | (idx >= num_experts)).any().view(1)
        gathered = _gather(idx, self.group, W) - first
        # another rank's expert: out of this rank's range, so the routing drops it
        mine = torch.where((gathered >= 0) & (gathered < local_experts), gathered,
                           torch.full_like(gathered, local_experts))
        scratch = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=idx.device)
        local = plan_local(mine, local_experts, budget, pad_multiple, kernels=kernels,
                           status=scratch)
        if status is not None:
            raise_peak(status, L.SS_TOKENS_PEAK, local.demand_rows)
            if budget is not None:
                raise_flag(status, L.SS_OVER_BUDGET, local.over_budget)
                raise_flag(status, L.SS_OVERFLOW, bad.to(torch.int32) * L.OVERFLOW_COUNT)
        return GatheredPlan(num_tokens=T, topk=K, num_experts=num_experts, local=local,
                            keeps_tokens=not self.resend and W * T < local.budget_rows)

    def dispatch_rows(self, x, topk_weight, plan: GatheredPlan, kernels):
        """``(permuted [R, H], row weights [R])`` of this rank's experts, from the group's
        gathered tokens; differentiable in ``x`` ``[T, H]`` and ``topk_weight`` ``[T, K]``."""
        xs = _Gather.apply(x, self.group, self.world_size)
        if plan.keeps_tokens:
            plan.kept_tokens = xs
        permuted, _ = _ONE_DEVICE.dispatch_rows(xs, None, plan.local, kernels)
        weights = _Gather.apply(topk_weight, self.group, self.world_size)
        return permuted, _ONE_DEVICE.permuted_weights(weights, plan.local, kernels)

    def combine_rows(self, y, topk_weight, plan: GatheredPlan, kernels):
        """``[T, H]``: each token's sum over the group's experts of its rows of ``y``
        (``[R, H]``, this rank's experts' outputs), weighted by ``topk_weight`` ``[T, K]``
        unless None."""
        weights = None
        if topk_weight is not None:
            weights = _Gather.apply(topk_weight, self.group, self.world_size)
        partial = _ONE_DEVICE.combine_rows(y, weights, plan.local, kernels)
        return _SumBack.apply(partial, self.group, self.world_size)

    def regathers(self, plan: GatheredPlan) -> bool:
        """Whether the experts of ``plan``'s dispatch take their rows again in backward
        (:meth:`resend_rows`) instead of keeping them."""
        return self.resend or plan.keeps_tokens

    def regather_source(self, x: torch.Tensor, plan: GatheredPlan) -> torch.Tensor:
        """What the experts keep to take their rows from again: the ``[W * T, H]``
        gathered tokens where ``plan`` keeps them (handed over once: the plan holds them no
        longer), else this rank's tokens ``x`` (``[T, H]``)."""
        kept, plan.kept_tokens = plan.kept_tokens, None
        return x if kept is None else kept

    def resend_rows(self, source, plan: GatheredPlan, kernels, out=None):
        """The permuted rows ``[R, H]`` taken again, without autograd, into ``out`` when
        given, from ``source``, unchanged since the dispatch: the ``[W * T, H]`` gathered
        tokens where ``plan`` keeps them (a gather on this rank), else this rank's ``[T, H]``
        tokens, gathered again first (a collective)."""
        with torch.no_grad():
            if not plan.keeps_tokens:
                source = _gather(source, self.group, self.world_size)
            elif source.shape[0] != self.world_size * plan.num_tokens:
                raise ValueError(f"source: expected the {self.world_size * plan.num_tokens} "
                                 f"gathered tokens this plan keeps, got {source.shape[0]} rows")
            rows, _ = _ONE_DEVICE.dispatch_rows(source, None, plan.local, kernels)
        return rows if out is None else out.copy_(rows)
