"""Static-budget MoE dispatch and combine, on one GPU or expert-parallel over torch.distributed.

``dispatch`` permutes the tokens by expert into a buffer of ``budget`` rows (static shape)
and returns the device counts per expert; ``combine`` is its inverse, weighted by the router
weights. Both are differentiable (in the tokens, the expert outputs and the router weights),
allocate only their static-shape outputs, and never read back to the host unless the step
runs dropless (``budget=None`` or :func:`graphstash.dropless`), which is eager only.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import _backend
from .. import _layout as L
from .._checks import describe, forbid_capture, require_positive_int, require_tensor
from .._mode import is_dropless
from ._routing import RoutingPlan, plan_expert_parallel, plan_local

__all__ = ["DispatchHandle", "budget_rows", "check_routing", "combine", "default_status",
           "dispatch"]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_default_status: dict[torch.device, torch.Tensor] = {}


def default_status(device) -> torch.Tensor:
    """The int32 ``[8]`` status tensor dispatch uses on ``device`` when given no ``status=``.

    Inside a running :func:`graphstash.graph_step` on ``device`` (warmup, capture, the eager
    rerun) it is that step's status (NOTE [current step] in ``graphstash/_mode.py``), so an
    over-budget dispatch makes the step rerun dropless; elsewhere a module-level tensor per
    device. Index ``graphstash._layout.SS_OVER_BUDGET`` is raised (sticky) when a budget
    dropped rows, ``SS_TOKENS_PEAK`` holds the most rows one dispatch asked for, and
    ``SS_OVERFLOW`` gets ``OVERFLOW_COUNT`` when a top-k index was out of range on the GPU.
    Create the module-level one before capturing a graph yourself (or pass your own
    ``status=``).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from .._mode import current_step_status

    status = current_step_status(device)
    if status is not None:
        return status
    status = _default_status.get(device)
    if status is None:
        status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
        _default_status[device] = status
    return status


def budget_rows(num_tokens: int, topk: int, num_experts: int, *, capacity_factor: float = 1.25,
                pad_multiple: int | None = None, world_size: int = 1) -> int:
    """Rows of a static dispatch buffer: ``capacity_factor`` x the average rows of one rank,
    plus room for each local expert's padding, rounded up to ``pad_multiple``.

    ``num_tokens`` counts the tokens of the whole expert-parallel group (``world_size``
    ranks): with ``T`` tokens per rank pass ``T * world_size``; a rank then receives
    ``T * topk`` rows on average, and ``capacity_factor=world_size`` fits any routing.
    On one GPU ``capacity_factor=1.0`` gives exactly the dropless rows, ``T * topk`` plus
    padding: no routing goes over that budget.
    """
    require_positive_int("num_tokens", num_tokens)
    require_positive_int("topk", topk)
    require_positive_int("num_experts", num_experts)
    require_positive_int("world_size", world_size)
    if pad_multiple is not None:
        require_positive_int("pad_multiple", pad_multiple)
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise TypeError(f"capacity_factor: expected a float, got {type(capacity_factor).__name__}")
    if not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor: expected a finite float > 0, got {capacity_factor}")
    if topk > num_experts:
        raise ValueError(f"topk: expected at most num_experts={num_experts}, got {topk}")
    if num_experts % world_size:
        raise ValueError(f"num_experts: expected a multiple of world_size={world_size}, "
                         f"got {num_experts}")
    local_experts = num_experts // world_size
    rows = math.ceil(capacity_factor * num_tokens * topk / world_size)
    if pad_multiple and pad_multiple > 1:
        rows += local_experts * (pad_multiple - 1)
        rows = -(-rows // pad_multiple) * pad_multiple
    return max(1, rows)


@dataclasses.dataclass
class DispatchHandle:
    """What :func:`combine` needs to undo a :func:`dispatch`.

    ``live_rows`` (int32 ``[1]``, device) is the number of rows in use at the top of the
    permuted buffer: the ``num_tokens`` to give ``stash_activations``. ``over_budget`` (bool
    ``[1]``, device) says whether this dispatch dropped rows. ``source`` is the ``[num_tokens,
    hidden]`` tokens that were dispatched (what :meth:`regather` gathers again).
    """
    plan: RoutingPlan
    topk_weight: torch.Tensor
    num_experts: int
    hidden: int
    dtype: torch.dtype
    device: torch.device
    backend: str
    source: torch.Tensor | None = None
    exchanged_weights: torch.Tensor | None = None    # [R] router weights that came with the rows

    @property
    def local(self) -> bool:
        """True for a one-device dispatch (no expert-parallel exchange)."""
        return self.plan.group is None

    def regather(self, source: torch.Tensor) -> torch.Tensor:
        """The permuted rows of ``source`` (``[num_tokens, hidden]``, the dispatched tokens or
        a tensor of their shape), as the dispatch computed them, without autograd: one gather
        on one device. Expert parallel dispatches would need the exchange again: refused."""
        if not self.local:
            raise ValueError("handle: regather() needs a one-device dispatch; this one is "
                             "expert-parallel")
        _, ops = _ops(self.backend, self.device)
        return _tokens_to_rows(source.detach().contiguous(), self.plan, ops)

    @property
    def budget_rows(self) -> int:
        """Rows of the permuted buffer (the static budget, padding included)."""
        return self.plan.budget_rows

    @property
    def num_tokens(self) -> int:
        """Tokens dispatched (rows of ``x``)."""
        return self.plan.num_tokens

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """int32 ``[num_local_experts]`` padded rows per expert, on the device."""
        return self.plan.tokens_per_expert

    @property
    def live_rows(self) -> torch.Tensor:
        """int32 ``[1]`` rows in use at the top of the permuted buffer, on the device."""
        return self.plan.live_rows

    @property
    def over_budget(self) -> torch.Tensor:
        """bool ``[1]`` on the device: True when this dispatch dropped rows."""
        return self.plan.over_budget

    def permuted_weights(self) -> torch.Tensor:
        """The router weight of every permuted row: ``[budget_rows]`` in ``topk_weight``'s
        dtype on the device, 0 for padding and unused rows; differentiable in
        ``topk_weight``. Under expert parallelism the weights travel to the expert's rank
        with one extra (small) all-to-all, and their gradients back with another.

        Scale the expert activations with it and combine with ``weighted=False`` (what
        :func:`~graphstash.moe.expert_mlp` does): the combine then keeps no budget-sized
        tensor for the weights' gradient (NOTE [expert MLP saved tensors] in ``mlp.py``).
        Through a live-row exchange the weights came with the rows: no extra exchange.
        """
        if self.exchanged_weights is not None:
            return self.exchanged_weights
        _, ops = _ops(self.backend, self.device)
        return _PermuteWeights.apply(self.topk_weight, self.plan, ops)


# ---------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------
def _check_float(name: str, t, device=None) -> torch.Tensor:
    require_tensor(name, t, "a floating-point tensor")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a bfloat16, float16, float32 or float64 tensor, "
                        f"got {describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of x), "
                         f"got {describe(t)}")
    return t


def check_routing(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError if any top-k index is outside ``[0, num_experts)``.

    Reads the indices back to the host (a sync): :func:`dispatch` calls it itself only for
    CPU tensors and in dropless mode; on the GPU with a budget, out-of-range pairs are
    dropped on the device and flagged in ``status[SS_OVERFLOW]`` instead. While
    ``torch.compile`` traces, the check becomes a graph op (NOTE [routing check under
    torch.compile]).
    """
    if topk_idx.numel() == 0:
        return
    if torch.compiler.is_compiling():
        # NOTE [routing check under torch.compile]: the eager check reads the indices back
        # (a graph break). Traced, it is ``torch._assert_async``: it stays in the graph,
        # reads nothing back while tracing, and raises RuntimeError with this message when
        # the compiled code runs on bad indices (a graph op cannot raise ValueError, nor
        # name the bad value).
        in_range = ((topk_idx >= 0) & (topk_idx < num_experts)).all()
        torch._assert_async(in_range, f"topk_idx: expected expert indices in "
                                      f"[0, {num_experts}) (num_experts={num_experts})")
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(f"topk_idx: expected expert indices in [0, {num_experts}) "
                         f"(num_experts={num_experts}), got {bad}")


def _check_status(status, device) -> torch.Tensor:
    expected = f"an int32 tensor of shape ({L.STATUS_SIZE},) on {device}"
    require_tensor("status", status, expected)
    if (status.dtype != torch.int32 or tuple(status.shape) != (L.STATUS_SIZE,)
            or status.device != device):
        raise ValueError(f"status: expected {expected}, got {describe(status)}")
    return status


def _check_dispatch_args(x, topk_idx, topk_weight, num_experts, budget, pad_multiple, group,
                         chunk_rows):
    _check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [num_tokens, hidden] tensor, got {describe(x)}")
    require_tensor("topk_idx", topk_idx, "an int32 or int64 tensor")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx: expected an int32 or int64 tensor, got {describe(topk_idx)}")
    if topk_idx.device != x.device:
        raise ValueError(f"topk_idx: expected a tensor on {x.device} (the device of x), "
                         f"got {describe(topk_idx)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx: expected shape ({x.shape[0]}, topk) to match "
                         f"x {tuple(x.shape)}, got {describe(topk_idx)}")
    if topk_idx.shape[1] == 0:
        raise ValueError(f"topk_idx: expected at least one expert per token (topk >= 1), got "
                         f"{describe(topk_idx)}")
    _check_float("topk_weight", topk_weight, x.device)
    if tuple(topk_weight.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_weight: expected shape {tuple(topk_idx.shape)} (that of "
                         f"topk_idx), got {describe(topk_weight)}")
    require_positive_int("num_experts", num_experts)
    if budget is not None:
        require_positive_int("budget", budget)
    if pad_multiple is not None:
        require_positive_int("pad_multiple", pad_multiple)
    if chunk_rows is not None:
        require_positive_int("chunk_rows", chunk_rows)
    if group is not None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call "
                             "init_process_group() first or pass group=None")
        world = dist.get_world_size(group)
        if num_experts % world:
            raise ValueError(f"num_experts: expected a multiple of the group size {world} "
                             f"(experts are split evenly over the ranks), got {num_experts}")


def _check_exchange(exchange, group, chunk_rows, x) -> None:
    from .exchange import Transport

    if not isinstance(exchange, Transport):
        raise TypeError(f"exchange: expected a graphstash.moe.exchange.Transport, got "
                        f"{type(exchange).__name__}")
    if group is not None and group is not exchange.group:
        raise ValueError("group: expected None or the group the exchange was built over "
                         f"({exchange.group!r}), got {group!r}")
    if chunk_rows is not None:
        raise ValueError("chunk_rows: the live-row exchange sends no chunks; leave it None")
    if exchange.closed:
        raise ValueError("exchange: the transport was closed")
    _check_float("x", x)
    if x.device != exchange.device:
        raise ValueError(f"x: expected a tensor on {exchange.device} (the exchange's device), "
                         f"got {describe(x)}")


def _ops(backend: str, device: torch.device):
    name, _ = _backend.resolve(backend, device)
    if name == "cupy":
        from .._kernels import moe as ops
    else:
        from ..reference import moe as ops
    return name, ops


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_to_all(src: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty_like(src)
    dist.all_to_all_single(out, src.contiguous(), group=group)
    return out


def _stage_to_rows(stage: torch.Tensor, plan: RoutingPlan, ops) -> torch.Tensor:
    """Send-side stage rows -> permuted rows ``[R, ...]`` of the local experts (expert
    parallel: one all-to-all, then a gather; one device: the stage is the permuted layout)."""
    if plan.group is None:
        return stage
    received = _all_to_all(stage, plan.group)
    rows = stage.new_empty(plan.budget_rows, *stage.shape[1:])
    ops.gather_rows(rows, received, plan.recv_of_row)
    return rows


def _rows_to_stage(rows: torch.Tensor, plan: RoutingPlan, ops) -> torch.Tensor:
    """Permuted rows ``[R, ...]`` -> the send-side stage of the ranks that sent them (the
    inverse of :func:`_stage_to_rows`; unused stage rows are zero)."""
    if plan.group is None:
        return rows
    back = rows.new_empty(plan.row_of_recv.shape[0], *rows.shape[1:])
    ops.gather_rows(back, rows, plan.row_of_recv)
    return _all_to_all(back, plan.group)


def _tokens_to_rows(x: torch.Tensor, plan: RoutingPlan, ops) -> torch.Tensor:
    """Tokens ``[T, H]`` -> permuted rows ``[R, H]``: each row a copy of its token (zero for
    padding and unused rows). The adjoint of :func:`_rows_to_tokens`."""
    stage = x.new_empty(plan.stage_rows, x.shape[1])
    ops.gather_rows(stage, x, plan.token_of_slot)
    return _stage_to_rows(stage, plan, ops)


def _rows_to_tokens(rows: torch.Tensor, plan: RoutingPlan, ops) -> torch.Tensor:
    """Permuted rows ``[R, H]`` -> tokens ``[T, H]``: each token the unweighted sum of its
    kept slots' rows. The adjoint of :func:`_tokens_to_rows`."""
    stage = _rows_to_stage(rows, plan, ops)
    out = rows.new_empty(plan.num_tokens, rows.shape[1])
    ops.combine_rows(out, stage, plan.slot_of_pair, None)
    return out


# ---------------------------------------------------------------------------------------
# autograd functions
# ---------------------------------------------------------------------------------------
class _Dispatch(torch.autograd.Function):
    """x [T, H] -> permuted [R, H]; backward sums each token's slots (unweighted)."""

    @staticmethod
    def forward(ctx, x, plan: RoutingPlan, ops):
        ctx.plan, ctx.ops = plan, ops
        return _tokens_to_rows(x.contiguous(), plan, ops)

    @staticmethod
    def backward(ctx, grad):
        return _rows_to_tokens(grad.contiguous(), ctx.plan, ctx.ops), None, None


class _CombineUnweighted(torch.autograd.Function):
    """y [R, H] -> out [T, H] = sum_k y[row of (t, k)]; keeps nothing for backward."""

    @staticmethod
    def forward(ctx, y, plan: RoutingPlan, ops):
        ctx.plan, ctx.ops = plan, ops
        return _rows_to_tokens(y.contiguous(), plan, ops)

    @staticmethod
    def backward(ctx, grad):
        return _tokens_to_rows(grad.contiguous(), ctx.plan, ctx.ops), None, None


class _Combine(torch.autograd.Function):
    """y [R, H] and weights [T, K] -> out [T, H] = sum_k w[t, k] * y[row of (t, k)]."""

    @staticmethod
    def forward(ctx, y, topk_weight, plan: RoutingPlan, ops):
        y = y.contiguous()
        stage = _rows_to_stage(y, plan, ops)
        weight = topk_weight.detach().to(_acc_dtype(y.dtype)).contiguous()
        out = y.new_empty(plan.num_tokens, y.shape[1])
        ops.combine_rows(out, stage, plan.slot_of_pair, weight)
        ctx.save_for_backward(stage, weight)
        ctx.plan, ctx.ops, ctx.weight_dtype = plan, ops, topk_weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        plan, ops = ctx.plan, ctx.ops
        stage, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_y = grad_w = None
        # Under expert parallelism every rank runs the all-to-all, whatever it needs.
        if ctx.needs_input_grad[0] or plan.group is not None:
            pair = plan.pair_of_slot
            flat_w = weight.reshape(-1)
            if flat_w.numel():
                w_slot = torch.where(pair >= 0, flat_w[pair.clamp(min=0).long()],
                                     torch.zeros((), dtype=flat_w.dtype, device=flat_w.device))
            else:
                w_slot = flat_w.new_zeros(pair.shape[0])
            g_stage = grad.new_empty(plan.stage_rows, grad.shape[1])
            ops.combine_rows(g_stage, grad, plan.token_of_slot.view(-1, 1).contiguous(),
                             w_slot.view(-1, 1).contiguous())
            grad_y = _stage_to_rows(g_stage, plan, ops)
        if ctx.needs_input_grad[1]:
            flat = torch.empty(plan.num_tokens * plan.topk, dtype=_acc_dtype(grad.dtype),
                               device=grad.device)
            ops.weight_grad(flat, grad, stage, plan.slot_of_pair)
            grad_w = flat.view(plan.num_tokens, plan.topk).to(ctx.weight_dtype)
        return grad_y, grad_w, None, None


class _PermuteWeights(torch.autograd.Function):
    """topk_weight [T, K] -> [R]: the weight of the pair feeding each permuted row (0: none)."""

    @staticmethod
    def forward(ctx, topk_weight, plan: RoutingPlan, ops):
        flat = topk_weight.detach().reshape(-1, 1).contiguous()
        stage = flat.new_empty(plan.stage_rows, 1)
        ops.gather_rows(stage, flat, plan.pair_of_slot)
        ctx.plan, ctx.ops, ctx.shape = plan, ops, topk_weight.shape
        return _stage_to_rows(stage, plan, ops).view(-1)

    @staticmethod
    def backward(ctx, grad):
        plan, ops = ctx.plan, ctx.ops
        grad = grad.reshape(-1, 1).contiguous()
        g_stage = _rows_to_stage(grad, plan, ops)
        # Each kept pair feeds exactly one stage row: its gradient is that row's (a gather).
        grad_w = grad.new_empty(plan.num_tokens * plan.topk, 1)
        ops.gather_rows(grad_w, g_stage, plan.slot_of_pair.reshape(-1).contiguous())
        return grad_w.view(ctx.shape), None, None


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------
def _update_status(status: torch.Tensor, plan: RoutingPlan, dropless: bool) -> None:
    """Raise the sticky flags and the demand high-water mark on the device (no host read)."""
    demand = plan.demand_rows.clamp(max=2**31 - 1).to(torch.int32)
    peak = status.narrow(0, L.SS_TOKENS_PEAK, 1)
    peak.copy_(torch.maximum(peak, demand))
    if not dropless:
        status.narrow(0, L.SS_OVER_BUDGET, 1).bitwise_or_(plan.over_budget.to(torch.int32))
        status.narrow(0, L.SS_OVERFLOW, 1).bitwise_or_(
            plan.bad_index.to(torch.int32) * L.OVERFLOW_COUNT)


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
             num_experts: int, *, budget: int | None, pad_multiple: int | None = None,
             group=None, chunk_rows: int | None = None, status: torch.Tensor | None = None,
             backend: str = "auto", exchange=None):
    """Permute tokens by expert into a static buffer of ``budget`` rows.

    Args:
        x: ``[num_tokens, hidden]`` tokens (bfloat16, float16, float32 or float64), on the
            GPU (CuPy kernels) or the CPU (reference backend).
        topk_idx: int32/int64 ``[num_tokens, topk]`` expert of each slot, same device.
        topk_weight: floating ``[num_tokens, topk]`` router weight of each slot, same device;
            used by :func:`combine` (and differentiated there).
        num_experts: experts in total (over all ranks of ``group``).
        budget: rows of the permuted buffer (padding included; see :func:`budget_rows`), or
            ``None`` for a dropless, exactly sized buffer (eager only, reads counts back).
            Dropless mode (:func:`graphstash.dropless`) ignores the budget the same way.
        pad_multiple: round every expert's row count up to this multiple (grouped GEMM
            alignment); padding rows are zero.
        group: ``torch.distributed`` process group for expert parallelism; rank ``r`` owns
            experts ``[r * E / W, (r + 1) * E / W)``.
        chunk_rows: rows of each per-rank chunk of the all-to-all (expert parallel only);
            default ``min(budget, num_tokens * min(topk, E / W))``, which never drops a row
            the budget would keep.
        status: int32 ``[8]`` status tensor on x's device (default :func:`default_status`).
        backend: ``"auto"``, ``"cupy"`` or ``"reference"``.
        exchange: a :class:`graphstash.moe.exchange.Transport`: the expert-parallel exchange
            moves only the live rows, straight into the experts' ranks, through it (its ranks
            are the group; ``group`` may be omitted). Every rank calls dispatch and combine in
            the same order.

    Returns:
        ``(permuted, tokens_per_expert, handle)``: ``permuted`` is ``[budget, hidden]`` in
        x's dtype (NOTE [permuted layout] in ``graphstash/moe/_routing.py``),
        ``tokens_per_expert`` int32 ``[num_local_experts]`` on the device (padded counts,
        clamped to the budget: their sum never exceeds ``budget``), ``handle`` a
        :class:`DispatchHandle` for :func:`combine`.

    Rows past the budget are not written; the step's status gets ``SS_OVER_BUDGET`` so the
    graph manager reruns it dropless. Example::

        permuted, counts, handle = dispatch(x, idx, w, 8, budget=budget_rows(T, 2, 8))
        y = grouped_mm(permuted, w1, counts)
        out = combine(y, handle)
    """
    if exchange is not None:
        _check_exchange(exchange, group, chunk_rows, x)
        group = None
    _check_dispatch_args(x, topk_idx, topk_weight, num_experts, budget, pad_multiple, group,
                         chunk_rows)
    dropless = budget is None or is_dropless()
    if status is None:
        status = default_status(x.device)
    else:
        _check_status(status, x.device)
    backend_name, ops = _ops(backend, x.device)
    if dropless:
        forbid_capture("a dropless MoE dispatch (it reads the expert counts back to the host)")
    if dropless or x.device.type == "cpu":
        check_routing(topk_idx, num_experts)

    if exchange is not None:
        from .exchange import exchange_dispatch, plan_exchange

        plan = plan_exchange(topk_idx.contiguous(), num_experts, None if dropless else budget,
                             pad_multiple, exchange, row_bytes=x.shape[1] * x.element_size(),
                             status=None if dropless else status, moe_ops=ops)
        permuted, weights = exchange_dispatch(x, topk_weight, plan, ops)
        handle = DispatchHandle(plan=plan, topk_weight=topk_weight, num_experts=num_experts,
                                hidden=x.shape[1], dtype=x.dtype, device=x.device,
                                backend=backend_name, source=x, exchanged_weights=weights)
        return permuted, plan.tokens_per_expert, handle
    if group is None:
        plan = plan_local(topk_idx, num_experts, None if dropless else budget, pad_multiple,
                          ops=ops, status=None if dropless else status)
    else:
        import torch.distributed as dist

        W = dist.get_world_size(group)
        if not dropless and chunk_rows is None:
            chunk_rows = max(1, min(budget, x.shape[0] * min(topk_idx.shape[1],
                                                             num_experts // W)))
        plan = plan_expert_parallel(topk_idx, num_experts, None if dropless else budget,
                                    pad_multiple, group, None if dropless else chunk_rows)
    if not plan.status_updated:
        _update_status(status, plan, dropless)
    permuted = _Dispatch.apply(x, plan, ops)
    handle = DispatchHandle(plan=plan, topk_weight=topk_weight, num_experts=num_experts,
                            hidden=x.shape[1], dtype=x.dtype, device=x.device,
                            backend=backend_name, source=x)
    return permuted, plan.tokens_per_expert, handle


def combine(y: torch.Tensor, handle: DispatchHandle, *, weighted: bool = True) -> torch.Tensor:
    """Undo a dispatch: ``out[t] = sum_k topk_weight[t, k] * y[row of (t, k)]``.

    Args:
        y: ``[budget_rows, hidden_out]`` expert outputs in the permuted layout, dtype of the
            dispatched tokens, on their device.
        handle: the :class:`DispatchHandle` returned by :func:`dispatch`.
        weighted: ``False`` sums the rows unweighted, for expert outputs already scaled by
            :meth:`DispatchHandle.permuted_weights` (then nothing is kept for backward).

    Returns ``[num_tokens, hidden_out]`` in y's dtype. Differentiable in ``y`` and (when
    ``weighted``) in the handle's ``topk_weight``; dropped pairs contribute nothing. The
    weighted form keeps ``y`` (under expert parallelism, its rows sent back) for the
    weights' gradient. Example::

        out = combine(expert_out, handle)
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle: expected the DispatchHandle returned by dispatch(), got "
                        f"{type(handle).__name__}")
    _check_float("y", y, handle.device)
    if y.dim() != 2 or y.shape[0] != handle.budget_rows:
        raise ValueError(f"y: expected a 2-D tensor of {handle.budget_rows} rows (the budget "
                         f"rows of the dispatch), got {describe(y)}")
    if y.dtype != handle.dtype:
        raise TypeError(f"y: expected dtype {handle.dtype} (that of the dispatched tokens), "
                        f"got {describe(y)}")
    if not isinstance(weighted, bool):
        raise TypeError(f"weighted: expected a bool, got {type(weighted).__name__}")
    _, ops = _ops(handle.backend, handle.device)
    if handle.exchanged_weights is not None:          # dispatched through an exchange
        from .exchange import exchange_combine

        return exchange_combine(y, handle.topk_weight if weighted else None, handle.plan, ops)
    if not weighted:
        return _CombineUnweighted.apply(y, handle.plan, ops)
    return _Combine.apply(y, handle.topk_weight, handle.plan, ops)
