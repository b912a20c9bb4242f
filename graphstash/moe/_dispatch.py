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
from typing import Protocol, runtime_checkable
import weakref

import torch

from .._checks import (describe, forbid_capture, normalize_device, require_float,
                       require_positive_int, require_tensor)
from .._mode import is_dropless
from ..reference.arithmetic import acc_dtype
from ..status import reading_allowed, resolve, warn_at_call_site
from .backend import Kernels, kernels_for
from ._routing import RoutingPlan, plan_expert_parallel, plan_local

__all__ = ["DispatchHandle", "NcclChunks", "OneDevice", "RowExchange", "as_exchange",
           "budget_rows", "check_routing", "combine", "default_status", "dispatch",
           "register_transport_adapter"]


def default_status(device) -> torch.Tensor:
    """The int32 ``[8]`` status tensor dispatch and the expert GEMMs use on ``device`` when
    given no ``status=``.

    Inside a running :func:`graphstash.graph_step` on ``device`` (warmup, capture, the eager
    rerun) it is that step's status, inside ``with manager:`` the
    :class:`~graphstash.StashManager`'s (NOTE [current step] in ``graphstash/status.py``), so
    an over-budget dispatch makes the step rerun dropless or the manager's ``end_step()``
    report it; elsewhere a tensor per device that nobody reads for you (NOTE [eager over
    budget]). Index ``graphstash._layout.SS_OVER_BUDGET`` is raised (sticky) when a budget
    dropped rows, ``SS_TOKENS_PEAK`` holds the most rows one dispatch asked for, and
    ``SS_OVERFLOW`` gets ``OVERFLOW_COUNT`` when a top-k index was out of range on the GPU.
    Create the per-device one before capturing a graph yourself (or pass your own
    ``status=``). ValueError naming ``device`` for a device torch cannot use.
    """
    device = normalize_device(device)
    tensor, _ = resolve(None, device)
    return tensor


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
    hidden]`` tokens that were dispatched, or what the exchange keeps instead to take the rows
    from (NOTE [row exchange]): what :meth:`regather` gathers again;
    ``kernels`` the backend the dispatch chose (NOTE [moe kernels] in ``backend.py``).
    """
    plan: RoutingPlan
    topk_weight: torch.Tensor
    num_experts: int
    hidden: int
    dtype: torch.dtype
    device: torch.device
    kernels: Kernels
    source: torch.Tensor | None = None
    # NOTE [regathered input] in mlp.py: what expert_mlp(..., handle=) checks before it
    # trusts that gathering `source` again gives its input: the permuted output (held
    # weakly: the handle must not keep a budget-sized tensor alive) and both versions
    source_version: int = 0
    permuted_ref: weakref.ref | None = None
    permuted_version: int = 0
    counts_version: int = 0
    exchanged_weights: torch.Tensor | None = None    # [R] router weights that came with the rows
    exchange: "RowExchange | None" = None             # what moved the rows (NOTE [row exchange])

    @property
    def backend(self) -> str:
        """``"cupy"`` or ``"reference"``: the kernels this dispatch runs on."""
        return self.kernels.name

    @property
    def local(self) -> bool:
        """True for a one-device dispatch (no expert-parallel exchange)."""
        return self.exchange is None or self.exchange.world_size == 1

    @property
    def regathers(self) -> bool:
        """Whether :meth:`regather` can give the permuted rows again: on one device (a
        gather), or through an exchange that resends them (NOTE [resent rows] in
        ``graphstash/moe/exchange/live.py``) or takes them from what it kept (NOTE [row
        exchange])."""
        if self.local:
            return True
        decides = getattr(self.exchange, "regathers", None)
        if decides is not None:
            return bool(decides(self.plan))
        return bool(getattr(self.exchange, "resend", False))

    def regather(self, source: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The permuted rows of ``source`` (the handle's ``source``: ``[num_tokens, hidden]``,
        the dispatched tokens, or what the exchange kept instead, on their device, in their
        dtype), as the dispatch computed them, without autograd: one
        gather on one device; under expert parallelism, the exchange's resend, a collective
        (NOTE [resent rows]), written into ``out`` (``[budget_rows, hidden]``, source's dtype
        and device) when given. Other expert-parallel dispatches: refused."""
        if not self.regathers:
            raise ValueError("handle: regather() needs a one-device dispatch or an exchange "
                             "that resends its rows; this one is expert-parallel over "
                             f"{self.exchange!r}")
        source = source.detach().contiguous()
        if not self.local:
            return self.exchange.resend_rows(source, self.plan, self.kernels, out)
        rows = _tokens_to_rows(source, self.plan, self.kernels)
        return rows if out is None else out.copy_(rows)

    @property
    def overlaps(self) -> bool:
        """Whether :meth:`beside` gives something (without making it)."""
        return (not self.local and not torch.compiler.is_compiling()
                and bool(getattr(self.exchange, "overlap_sms", 0)))

    def beside(self):
        """What runs this dispatch's backward pushes beside the experts' GEMMs (a
        :class:`~graphstash.moe.exchange.overlap.Beside`: NOTE [exchange beside the experts]
        in ``graphstash/moe/exchange/overlap.py``), or None: on one device, through an
        exchange that does not overlap, or while torch.compile traces."""
        return self.exchange.beside() if self.overlaps else None

    def send_home(self, grad_rows: torch.Tensor) -> None:
        """Push ``grad_rows`` (``[budget_rows, hidden]``, contiguous, the gradient of the
        permuted rows, on their device) home ahead of the dispatch's backward, which then
        pushes only the router weights' gradients; a collective (NOTE [exchange beside the
        experts]). Only for an exchange whose :meth:`beside` is not None."""
        if not self.overlaps:
            raise ValueError(f"handle: send_home() needs an expert-parallel exchange that "
                             f"overlaps its pushes; this dispatch went through "
                             f"{self.exchange!r}")
        self.exchange.send_home(grad_rows, self.plan)

    def check_expert_input(self, x: torch.Tensor) -> None:
        """Refuse (ValueError naming ``handle`` or ``x``) unless ``x`` is the very permuted
        tensor this dispatch returned, unmodified, and the dispatched tokens are unmodified
        since: then gathering the tokens again gives ``x`` (NOTE [regathered input])."""
        if tuple(x.shape) != (self.budget_rows, self.hidden) or x.device != self.device:
            raise ValueError(f"handle: x must be the permuted output of that dispatch "
                             f"([{self.budget_rows}, {self.hidden}] on {self.device}), got "
                             f"{describe(x)}")
        permuted = self.permuted_ref() if self.permuted_ref is not None else None
        if permuted is not x:
            raise ValueError(
                "handle: x must be the very tensor this dispatch returned as its permuted "
                "output: a copy, a view or a function of it (dropout(permuted), "
                "permuted * s) is not what gathering the tokens again gives, so its weight "
                "gradients would be wrong; pass handle=None (x is then kept for backward) or "
                "apply the function to the tokens before dispatch")
        if torch.compiler.is_compiling():
            return                   # versions are not graph values (NOTE [regathered input])
        if x._version != self.permuted_version:
            raise ValueError("x: the permuted output was modified in place after dispatch; "
                             "with handle= the backward gathers the tokens again and would "
                             "not see that change: pass handle=None or do not modify it")
        self.check_source(self.source)

    def check_source(self, source: torch.Tensor | None) -> None:
        """Refuse (ValueError naming ``handle``) if the dispatched tokens ``source`` were
        modified in place since the dispatch (a gather of them would give other rows)."""
        if source is None or torch.compiler.is_compiling():
            return
        if source._version != self.source_version:
            raise ValueError(
                "handle: the tokens given to dispatch were modified in place after it (their "
                "version went from {} to {}); gathering them again for the experts' backward "
                "would give other rows than the experts computed with: do not modify the "
                "dispatched tokens, or pass handle=None".format(self.source_version,
                                                                 source._version))

    def trusts_counts(self, tokens_per_expert) -> bool:
        """Whether ``tokens_per_expert`` is this dispatch's own, unmodified counts (valid by
        construction: NOTE [expert counts] in experts.py)."""
        if tokens_per_expert is not self.plan.tokens_per_expert:
            return False
        return torch.compiler.is_compiling() or tokens_per_expert._version == self.counts_version

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
        return _PermuteWeights.apply(self.topk_weight, self.plan, self.kernels)


def check_handle(handle, name: str = "handle") -> "DispatchHandle":
    """``handle`` if it is a :class:`DispatchHandle`, else TypeError naming ``name``."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"{name}: expected the DispatchHandle returned by dispatch(), got "
                        f"{type(handle).__name__}")
    return handle


# ---------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------
def _check_float(name: str, t, device=None) -> torch.Tensor:
    require_float(name, t, "a floating-point tensor")
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


def _check_dispatch_args(x, topk_idx, topk_weight, num_experts, budget, pad_multiple,
                         exchange: "RowExchange"):
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
    world = exchange.world_size
    if num_experts % world:
        raise ValueError(f"num_experts: expected a multiple of the exchange's {world} ranks "
                         f"(experts are split evenly over the ranks), got {num_experts}")


@runtime_checkable
class RowExchange(Protocol):
    """How :func:`dispatch` and :func:`combine` move rows between tokens and experts: the one
    protocol of the three exchanges (NOTE [row exchange]): :class:`OneDevice`,
    :class:`NcclChunks` and :class:`graphstash.moe.exchange.LiveRows`.

    NOTE [row exchange]: an exchange plans a dispatch (``plan_dispatch``: the counts, every
    row's place, the budget's flags; a collective under expert parallelism; its
    ``tokens_per_expert``, ``live_rows``, ``budget_rows`` are this rank's), moves the tokens'
    rows to their experts (``dispatch_rows``: the permuted rows, and each row's router weight
    when they travel with the rows, else None; differentiable, its backward the combine's
    movement) and moves the expert outputs back, summed per token (``combine_rows``, weighted
    by ``topk_weight`` unless None). ``world_size`` is the ranks the experts are spread over;
    ``for_tokens(x)`` is the exchange that moves tokens like ``x``, after refusing what it
    cannot move (itself, or, for one built where the model runs, the one it built). One whose
    region cannot grow may say how many rows a rank receives at most (``capacity_rows``): an
    adaptive budget stops growing there (NOTE [adaptive budgets]). One whose plans can leave
    the rows past the first ``n`` of a rank's budget out (``plan.keep_rows(n)``, for
    ``dispatch(keep_rows=)``) says so with ``keeps_rows = True``; without it, False. One that
    can push a dispatch's rows again in backward (NOTE [resent rows] in
    ``graphstash/moe/exchange/live.py``) says so with ``resend`` True and does it in
    ``resend_rows(x, plan, kernels, out)``; without it, the experts keep what arrived. One
    that decides per dispatch gives ``regathers(plan)``, and one that takes the rows again
    from something of its own rather than the tokens gives it from ``regather_source(x,
    plan)`` (the dispatch's handle keeps that as its ``source`` and passes it to
    ``resend_rows``; NOTE [gathered tokens] in ``graphstash/moe/exchange/gathered.py``). One
    that can run its backward pushes beside the experts' GEMMs (NOTE [exchange beside the
    experts] in ``graphstash/moe/exchange/overlap.py``) gives what runs them from
    ``beside()`` (None when it does not) and pushes the input gradients home early in
    ``send_home(grad_rows, plan)``. The live-row exchange lives above this
    module, so dispatch knows it only through this protocol and never imports it; a
    :class:`~graphstash.moe.exchange.Transport` given as ``exchange=`` is turned into one by
    the adapter its package registers (:func:`register_transport_adapter`).
    """

    world_size: int

    def for_tokens(self, x: torch.Tensor) -> "RowExchange": ...

    def plan_dispatch(self, topk_idx: torch.Tensor, num_experts: int, budget: int | None,
                      pad_multiple: int | None, *, row_bytes: int, status, kernels): ...

    def dispatch_rows(self, x: torch.Tensor, topk_weight: torch.Tensor, plan, kernels): ...

    def combine_rows(self, y: torch.Tensor, topk_weight, plan, kernels): ...


class _GatheredRows:
    """Rows moved by gathers along a :class:`RoutingPlan` (with a group: one
    ``all_to_all_single`` between them, NOTE [send layout] in ``_routing.py``)."""

    world_size = 1

    def for_tokens(self, x: torch.Tensor) -> "_GatheredRows":
        return self

    def dispatch_rows(self, x, topk_weight, plan, kernels):
        return _Dispatch.apply(x, plan, kernels), None

    def combine_rows(self, y, topk_weight, plan, kernels):
        if topk_weight is None:
            return _CombineUnweighted.apply(y, plan, kernels)
        return _Combine.apply(y, topk_weight, plan, kernels)

    def permuted_weights(self, topk_weight, plan, kernels):
        """``[budget_rows]``: the router weight (``topk_weight`` ``[T, K]``) of the pair
        feeding each permuted row of ``plan``, 0 for none; differentiable."""
        return _PermuteWeights.apply(topk_weight, plan, kernels)


class OneDevice(_GatheredRows):
    """Every expert on this device: the rows are gathered locally (:func:`plan_local`)."""

    kind = "one device"

    def __repr__(self) -> str:
        return "OneDevice()"

    def plan_dispatch(self, topk_idx, num_experts, budget, pad_multiple, *, row_bytes, status,
                      kernels):
        return plan_local(topk_idx, num_experts, budget, pad_multiple, kernels=kernels,
                          status=status)


class NcclChunks(_GatheredRows):
    """Expert parallel over ``group`` with NCCL's ``all_to_all_single``: each rank sends every
    other a chunk of ``chunk_rows`` rows (NOTE [send layout] in ``_routing.py``), the budget's
    worth when None (``min(budget, tokens x min(topk, E / W))``, which never drops a row the
    budget would keep). Rank ``r`` owns experts ``[r * E / W, (r + 1) * E / W)``."""

    kind = "nccl chunks"

    def __init__(self, group, chunk_rows: int | None = None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call "
                             "init_process_group() first or pass group=None")
        if chunk_rows is not None:
            require_positive_int("chunk_rows", chunk_rows)
        self.group = group
        self.chunk_rows = chunk_rows
        self.world_size = dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"NcclChunks(world_size={self.world_size}, chunk_rows={self.chunk_rows})"

    def plan_dispatch(self, topk_idx, num_experts, budget, pad_multiple, *, row_bytes, status,
                      kernels):
        chunk = None
        if budget is not None:
            chunk = self.chunk_rows or max(1, min(budget, topk_idx.shape[0] * min(
                topk_idx.shape[1], num_experts // self.world_size)))
        return plan_expert_parallel(topk_idx, num_experts, budget, pad_multiple, self.group,
                                    chunk, status=status)


ONE_DEVICE = OneDevice()
_ADAPTERS: list = []


def register_transport_adapter(kind: type, adapter) -> None:
    """Let ``exchange=`` take a ``kind`` object, turned into an exchange by ``adapter(obj)``
    (NOTE [row exchange]: how :mod:`graphstash.moe.exchange` makes a Transport one)."""
    _ADAPTERS.append((kind, adapter))


def as_exchange(exchange, group=None, chunk_rows=None, *, caller: str = "dispatch"):
    """The :class:`RowExchange` of ``exchange=`` (None: :data:`ONE_DEVICE`; a registered
    kind, such as a Transport, adapted); ``group``/``chunk_rows``, deprecated, become
    :class:`NcclChunks` with a DeprecationWarning naming the new call. TypeError/ValueError
    naming the argument otherwise."""
    if group is not None or chunk_rows is not None:
        if exchange is not None:
            raise ValueError(f"{caller}: give exchange= alone; group= and chunk_rows= are its "
                             "deprecated spelling (exchange=NcclChunks(group, chunk_rows))")
        if group is None:
            raise ValueError("chunk_rows: NCCL's chunks need a group; pass "
                             "exchange=NcclChunks(group, chunk_rows)")
        import warnings

        warnings.warn(f"{caller}(group=..., chunk_rows=...) is deprecated and will be removed "
                      f"in the next release: pass exchange=graphstash.moe.NcclChunks(group, "
                      f"chunk_rows) (or a graphstash.moe.exchange.LiveRows)",
                      DeprecationWarning, stacklevel=3)
        return NcclChunks(group, chunk_rows)
    if exchange is None:
        return ONE_DEVICE
    for kind, adapter in _ADAPTERS:
        if isinstance(exchange, kind):
            return adapter(exchange)
    if not callable(getattr(exchange, "for_tokens", None)) or \
            not isinstance(getattr(exchange, "world_size", None), int):
        raise TypeError(f"exchange: expected None, a graphstash.moe.RowExchange (OneDevice, "
                        f"NcclChunks, graphstash.moe.exchange.LiveRows) or a "
                        f"graphstash.moe.exchange.Transport, got {type(exchange).__name__}")
    return exchange      # a RowExchange, or one that resolves to one (GroupExchange)


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
    # NOTE [spread rows] (raw_kernels/moe_dispatch.cu): with the inverse map, the kernel reads
    # each token once instead of once per slot
    ops.gather_rows(stage, x, plan.token_of_slot, inverse=plan.slot_of_pair)
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
        weight = topk_weight.detach().to(acc_dtype(y.dtype)).contiguous()
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
            flat = torch.empty(plan.num_tokens * plan.topk, dtype=acc_dtype(grad.dtype),
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
# NOTE [eager over budget]: a budget that drops rows changes the layer's output, and only a
# device flag says so. Inside graph_step the step reads it and reruns dropless; inside `with
# manager:` the StashManager's end_step() reads it (NOTE [current step] in
# graphstash/status.py); a status passed explicitly is the caller's to read. Outside all of
# them (an eval pass, generate(), a plain eager loop) nobody would read the per-device default:
# there dispatch reads the flag itself and warns once per call site. That read is a host sync,
# taken only where it can be needed: eagerly (never while a stream captures or torch.compile
# traces), with a budget, and only when the budget can be exceeded at all (on one device a
# budget of at least T*K rows plus every expert's padding holds any routing:
# :func:`_fits_any_routing`), so the dropless-sized budgets of the presets and of the
# transformers backend on one GPU never pay it.
def _fits_any_routing(num_tokens: int, topk: int, num_local_experts: int, budget: int,
                      pad_multiple: int | None, local: bool) -> bool:
    """Whether a one-device budget holds every routing (no dispatch can exceed it)."""
    pad = (pad_multiple or 1) - 1
    return local and budget >= num_tokens * topk + num_local_experts * pad


def _warn_over_budget(plan: RoutingPlan, budget: int) -> None:
    if bool(plan.over_budget.any()):      # one host read (NOTE [eager over budget])
        warn_at_call_site(
            f"graphstash.moe.dispatch: the routing asked for more rows than the budget of "
            f"{budget} and the rest were dropped, so this output differs from a dropless "
            "one; no graph_step or StashManager was running to rerun or report the step and "
            "no status= was given (NOTE [eager over budget] in graphstash/moe/_dispatch.py): "
            "raise the budget (capacity_factor), run under graphstash.dropless(), or pass "
            "status= and read it")


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
             num_experts: int, *, budget: int | None, pad_multiple: int | None = None,
             exchange=None, status: torch.Tensor | None = None, backend: str = "auto",
             group=None, chunk_rows: int | None = None, keep_rows: int | None = None):
    """Permute tokens by expert into a static buffer of ``budget`` rows.

    Args:
        x: ``[num_tokens, hidden]`` tokens (bfloat16, float16, float32 or float64), on the
            GPU (CuPy kernels) or the CPU (reference backend).
        topk_idx: int32/int64 ``[num_tokens, topk]`` expert of each slot, same device.
        topk_weight: floating ``[num_tokens, topk]`` router weight of each slot, same device;
            used by :func:`combine` (and differentiated there).
        num_experts: experts in total (over all ranks of the exchange).
        budget: rows of the permuted buffer (padding included; see :func:`budget_rows`), or
            ``None`` for a dropless, exactly sized buffer (eager only, reads counts back).
            Dropless mode (:func:`graphstash.dropless`) ignores the budget the same way.
        pad_multiple: round every expert's row count up to this multiple (grouped GEMM
            alignment); padding rows are zero.
        exchange: how rows reach the experts (NOTE [row exchange]): None (every expert on this
            device), :class:`NcclChunks` (expert parallel over NCCL's fixed chunks), or
            :class:`graphstash.moe.exchange.LiveRows` (only the live rows, straight into the
            experts' ranks; a :class:`~graphstash.moe.exchange.Transport` is taken as the live
            rows over it). Under expert parallelism rank ``r`` owns experts
            ``[r * E / W, (r + 1) * E / W)`` and every rank calls dispatch and combine in the
            same order.
        status: int32 ``[8]`` status tensor on x's device, or its
            :class:`~graphstash.status.StepStatus` (default: the running step's, see
            :func:`default_status`).
        backend: ``"auto"``, ``"cupy"`` or ``"reference"``.
        group, chunk_rows: deprecated: ``exchange=NcclChunks(group, chunk_rows)``.
        keep_rows: through a :class:`~graphstash.moe.exchange.LiveRows` exchange with a
            budget, the rows this rank's experts compute on (an int in ``[1, budget]``; None:
            the budget): ``permuted``, the counts and what combine sends back are its first
            ``keep_rows`` rows, and a routing that fills more sets ``OVERFLOW_POOL`` in the
            status (NOTE [rows the stash keeps] in ``graphstash/stash/plan.py``). Ignored
            when dropless.

    Returns:
        ``(permuted, tokens_per_expert, handle)``: ``permuted`` is ``[budget, hidden]`` in
        x's dtype (NOTE [permuted layout] in ``graphstash/moe/_routing.py``),
        ``tokens_per_expert`` int32 ``[num_local_experts]`` on the device (padded counts,
        clamped to the budget: their sum never exceeds ``budget``), ``handle`` a
        :class:`DispatchHandle` for :func:`combine`.

    Rows past the budget are not written; the status gets ``SS_OVER_BUDGET``, so
    :func:`graphstash.graph_step` reruns the step dropless and a ``StashManager``'s
    ``end_step()`` reports it. With neither running and no ``status=``, an eager dispatch
    whose budget can be exceeded reads the flag back (one sync) and warns (NOTE [eager over
    budget]). Example::

        permuted, counts, handle = dispatch(x, idx, w, 8, budget=budget_rows(T, 2, 8))
        y = grouped_mm(permuted, w1, counts)
        out = combine(y, handle)
    """
    exchange = as_exchange(exchange, group, chunk_rows, caller="dispatch")
    _check_dispatch_args(x, topk_idx, topk_weight, num_experts, budget, pad_multiple, exchange)
    if keep_rows is not None:
        require_positive_int("keep_rows", keep_rows)
        if budget is not None and keep_rows > budget:
            raise ValueError(f"keep_rows: expected at most the budget ({budget} rows), got "
                             f"{keep_rows}")
    exchange = exchange.for_tokens(x)
    if keep_rows is not None and not getattr(exchange, "keeps_rows", False):
        raise ValueError(f"keep_rows: only a live-row exchange computes on fewer rows than its "
                         f"budget; exchange={exchange!r} does not (pass None)")
    dropless = budget is None or is_dropless()
    status, source = resolve(status, x.device)
    kernels = kernels_for(backend, x.device)
    if dropless:
        forbid_capture("a dropless MoE dispatch (it reads the expert counts back to the host)")
    if dropless or x.device.type == "cpu":
        check_routing(topk_idx, num_experts)
    plan = exchange.plan_dispatch(topk_idx.contiguous(), num_experts,
                                  None if dropless else budget, pad_multiple,
                                  row_bytes=x.shape[1] * x.element_size(), status=status,
                                  kernels=kernels)
    if keep_rows is not None and not dropless:
        plan = plan.keep_rows(keep_rows)
    local = exchange is ONE_DEVICE
    if (source == "default" and not dropless and reading_allowed()
            and not _fits_any_routing(x.shape[0], topk_idx.shape[1],
                                      num_experts // exchange.world_size, budget,
                                      pad_multiple, local)):
        _warn_over_budget(plan, budget)
    permuted, weights = exchange.dispatch_rows(x, topk_weight, plan, kernels)
    own_source = getattr(exchange, "regather_source", None)      # NOTE [row exchange]
    handle = DispatchHandle(plan=plan, topk_weight=topk_weight, num_experts=num_experts,
                            hidden=x.shape[1], dtype=x.dtype, device=x.device,
                            kernels=kernels, exchange=exchange, exchanged_weights=weights,
                            source=x if own_source is None else own_source(x, plan))
    if handle.regathers:         # NOTE [regathered input] in mlp.py, NOTE [resent rows]
        handle.source_version = _version(handle.source)
        handle.permuted_ref = weakref.ref(permuted)
        handle.permuted_version = _version(permuted)
        handle.counts_version = _version(plan.tokens_per_expert)
    return permuted, plan.tokens_per_expert, handle


def _version(t: torch.Tensor) -> int:
    """``t._version`` eagerly; 0 while torch.compile traces (not a graph value there)."""
    return 0 if torch.compiler.is_compiling() else t._version


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
    check_handle(handle)
    _check_float("y", y, handle.device)
    if y.dim() != 2 or y.shape[0] != handle.budget_rows:
        raise ValueError(f"y: expected a 2-D tensor of {handle.budget_rows} rows (the budget "
                         f"rows of the dispatch), got {describe(y)}")
    if y.dtype != handle.dtype:
        raise TypeError(f"y: expected dtype {handle.dtype} (that of the dispatched tokens), "
                        f"got {describe(y)}")
    if not isinstance(weighted, bool):
        raise TypeError(f"weighted: expected a bool, got {type(weighted).__name__}")
    return handle.exchange.combine_rows(y, handle.topk_weight if weighted else None,
                                        handle.plan, handle.kernels)
