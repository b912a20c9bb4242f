"""Dispatch and combine through a transport, as autograd functions: the backward of dispatch
is the combine's exchange and the backward of combine is the dispatch's.

NOTE [receive buffer lifetime]: a rank's region is one buffer that every layer's exchange,
forward and backward, and every replay reuse, while autograd keeps what a layer received until
that layer's backward. So nothing autograd keeps lives in the region: the receiver copies its
live rows out into a tensor of the step (the permuted buffer, from torch's allocator, so a
CUDA graph's pool holds it and the stash can page it out to its live rows), and the combine
sums the rows it received straight out of the region into the token outputs (a weighted
combine first copies them into a kept tensor, as the one-device combine keeps its stage).
The region is free again once every rank is past the next barrier: each push into it is
preceded by one (the dispatch's count barrier serves as the first), and every rank enters a
barrier only after its own copy-out in stream order.

Moves in the dispatch direction follow ``slot_peer`` / ``slot_row`` (only live, kept pairs),
in the combine direction ``row_peer`` / ``row_slot`` (only live, non-padding rows). The router
weights travel beside the rows in the same round (the ``WEIGHTS`` field), so
``permuted_weights()`` costs no exchange of its own (the push kernel copies a row's weight
with the row, in the same launch).

NOTE [resent own rows]: a push also moves the rows a rank routes to its own experts, into its
own region, and the copy-out reads them back. On the whole grid that costs nothing: the push
waits on the links, and the own rows move meanwhile (leaving them out of every push, and
placing each from where it was, made the live rows' step 1.75 ms slower on two H200,
docs/exchange.md, "The push on 16 SMs"). The resend is the push held to a few SMs beside the
experts' GEMMs (NOTE [exchange beside the experts] in ``overlap.py``), where the own rows take
those SMs from the rows that cross (on 16 SMs, 4 KiB rows, half of them a rank's own: 0.75
of the copy engine's bandwidth, against 0.86 when every row crosses). So the resend alone
leaves them out of its push (receivers at -1) and places each from the tokens after the
copy-out (``place_rows``, on the whole grid), where it costs one copy instead of two.
"""
from __future__ import annotations

import torch

from . import layout as X
from .plan import ExchangePlan


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dispatch_direction(plan: ExchangePlan, moe_ops, rows, weights=None, *,
                        fresh: bool, own_rows_home: bool = False) -> None:
    """Push rows from senders to their receivers and copy them out (NOTE [receive buffer
    lifetime]). ``rows``: ``(src [N, H], src_index [P] or None, out [R, H])``; ``weights``
    (optional): ``(src [N2], src_index [P] or None, out [R])``, moved in the same launch;
    ``fresh``: the count barrier just passed, so the first round needs no barrier of its own;
    ``own_rows_home`` (without ``weights``): this rank's own rows are not pushed but placed
    from ``src`` after the copy-out (NOTE [resent own rows])."""
    t = plan.transport
    R = plan.budget_rows
    src, index, out = rows
    w_src, w_index, w_out = weights if weights is not None else (None, None, None)
    peer, row_src = plan.slot_peer, plan.row_src
    if own_rows_home:
        own = plan.row_peer == t.rank
        peer = torch.where(plan.slot_peer == t.rank, -1, plan.slot_peer)
        row_src = torch.where(own, -1, plan.row_src)
    for i, (lo, hi) in enumerate(plan.windows):
        if i or not fresh:
            t.barrier(plan.status)
        t.push(X.XF_ROWS, src, index, peer, plan.slot_row, plan.live_slots, lo, hi,
               weights=w_src, weights_index=w_index)
        t.barrier(plan.status)
        top = min(hi, R)
        if top <= lo:
            continue
        where = row_src
        if (lo, top) != (0, R):
            window = row_src[lo:top]
            where = torch.where(window >= 0, window - lo, window)
        moe_ops.gather_rows(out[lo:top], t.field_view(X.XF_ROWS, out.dtype, out.shape[1],
                                                      top - lo), where)
        if w_out is not None:
            moe_ops.gather_rows(w_out.view(-1, 1)[lo:top],
                                t.field_view(X.XF_WEIGHTS, w_out.dtype, 1, top - lo), where)
    if own_rows_home:
        slot = plan.row_slot.clamp(min=0).long()
        moe_ops.place_rows(out, src, torch.where(own, slot if index is None else index[slot],
                                                 -1).to(torch.int32))


def _combine_direction(plan: ExchangePlan, rows=None, weights=None) -> None:
    """Push each live received row (``rows``, ``[R, H]``) and/or its weight (``weights``,
    ``[R]``) back to its sender's slot, in one launch; afterwards this rank's region holds its
    own slots (``[T * K, H]`` rows, ``[T * K]`` weights)."""
    t = plan.transport
    t.barrier(plan.status)
    if rows is not None:
        t.push(X.XF_ROWS, rows, None, plan.row_peer, plan.row_slot, plan.live_rows, 0,
               t.capacity_rows, weights=weights)
    elif weights is not None:
        t.push(X.XF_WEIGHTS, weights.view(-1, 1), None, plan.row_peer, plan.row_slot,
               plan.live_rows, 0, t.capacity_rows)
    t.barrier(plan.status)


def _sent_home(plan: ExchangePlan, rows: torch.Tensor | None) -> bool:
    """Whether ``rows`` (``[R, H]``, or None) are the input gradients the experts' backward
    pushed home already, unchanged since (:func:`exchange_send_home`); forgets them either
    way."""
    sent, plan.sent_home[:] = list(plan.sent_home), []
    if rows is None:
        return False
    return any(s.data_ptr() == rows.data_ptr() and s.shape == rows.shape
               and s.stride() == rows.stride() and s.dtype == rows.dtype
               and rows._version == version for s, version in sent)


class _DispatchExchange(torch.autograd.Function):
    """x [T, H], topk_weight [T, K] -> permuted [R, H], row weights [R]."""

    @staticmethod
    def forward(ctx, x, topk_weight, plan: ExchangePlan, moe_ops):
        ctx.set_materialize_grads(False)
        ctx.plan, ctx.moe_ops = plan, moe_ops
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, topk_weight.dtype
        R = plan.budget_rows
        permuted = x.new_empty(R, x.shape[1])
        row_weight = topk_weight.new_empty(R)
        _dispatch_direction(plan, moe_ops, (x.detach().contiguous(), plan.token_of_slot, permuted),
                            (topk_weight.detach().reshape(-1).contiguous(), plan.pair_of_slot,
                             row_weight), fresh=True)
        return permuted, row_weight

    @staticmethod
    def backward(ctx, grad_rows, grad_weight):
        plan, moe_ops = ctx.plan, ctx.moe_ops
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return None, None, None, None
        T, H = ctx.x_shape
        R, P, t = plan.budget_rows, plan.pairs, plan.transport
        device = plan.live_rows.device
        rows = weights = None
        if need_x:
            if grad_rows is None:
                grad_rows = torch.zeros(R, H, dtype=ctx.x_dtype, device=device)
            rows = grad_rows.contiguous()
        if need_w:
            if grad_weight is None:
                grad_weight = torch.zeros(R, dtype=ctx.w_dtype, device=device)
            weights = grad_weight.reshape(R).contiguous()
        if _sent_home(plan, rows):
            rows = None     # already home (NOTE [exchange beside the experts] in overlap.py)
            if weights is not None:
                _combine_direction(plan, None, weights)
        else:
            _combine_direction(plan, rows, weights)
        grad_x = grad_w = None
        if need_x:              # each token: the unweighted sum of its kept pairs' rows
            grad_x = torch.empty(T, H, dtype=ctx.x_dtype, device=device)
            moe_ops.combine_rows(grad_x, t.field_view(X.XF_ROWS, ctx.x_dtype, H, P),
                                 plan.pair_slot, None)
        if need_w:              # each kept pair: its row weight's gradient
            flat = torch.empty(P, 1, dtype=ctx.w_dtype, device=device)
            moe_ops.gather_rows(flat, t.field_view(X.XF_WEIGHTS, ctx.w_dtype, 1, P),
                                plan.pair_slot.reshape(-1))
            grad_w = flat.view(plan.num_tokens, plan.topk)
        return grad_x, grad_w, None, None


class _CombineExchange(torch.autograd.Function):
    """y [R, H] (and topk_weight [T, K] when weighted) -> out [T, H]."""

    @staticmethod
    def forward(ctx, y, topk_weight, plan: ExchangePlan, moe_ops):
        ctx.set_materialize_grads(False)
        ctx.plan, ctx.moe_ops = plan, moe_ops
        ctx.y_shape, ctx.y_dtype = y.shape, y.dtype
        H = y.shape[1]
        P, t = plan.pairs, plan.transport
        _combine_direction(plan, y.detach().contiguous())
        received = t.field_view(X.XF_ROWS, y.dtype, H, P)
        out = y.new_empty(plan.num_tokens, H)
        ctx.weighted = topk_weight is not None
        if not ctx.weighted:
            moe_ops.combine_rows(out, received, plan.pair_slot, None)
            return out
        stage = y.new_empty(P, H)                   # kept for the weights' gradient
        moe_ops.gather_rows(stage, received, plan.slot_self)
        weight = topk_weight.detach().to(_acc_dtype(y.dtype)).contiguous()
        moe_ops.combine_rows(out, stage, plan.pair_slot, weight)
        ctx.save_for_backward(stage, weight)
        ctx.weight_dtype = topk_weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        plan, moe_ops = ctx.plan, ctx.moe_ops
        R, H = ctx.y_shape
        device = plan.live_rows.device
        if grad is None:
            grad = torch.zeros(plan.num_tokens, H, dtype=ctx.y_dtype, device=device)
        grad = grad.contiguous()
        grad_y = grad_w = None
        stage = weight = None
        if ctx.weighted:
            stage, weight = ctx.saved_tensors
        if ctx.needs_input_grad[0]:
            if ctx.weighted:
                pair = plan.pair_of_slot
                flat_w = weight.reshape(-1)
                w_slot = torch.where(pair >= 0, flat_w[pair.clamp(min=0).long()],
                                     torch.zeros((), dtype=flat_w.dtype, device=device))
                src = grad.new_empty(plan.pairs, H)
                moe_ops.combine_rows(src, grad, plan.token_of_slot.view(-1, 1).contiguous(),
                                     w_slot.view(-1, 1).contiguous())
                index = None
            else:
                src, index = grad, plan.token_of_slot
            grad_y = torch.empty(R, H, dtype=ctx.y_dtype, device=device)
            _dispatch_direction(plan, moe_ops, (src, index, grad_y), fresh=False)
        if ctx.weighted and ctx.needs_input_grad[1]:
            flat = torch.empty(plan.pairs, dtype=_acc_dtype(grad.dtype), device=device)
            moe_ops.weight_grad(flat, grad, stage, plan.pair_slot)
            grad_w = flat.view(plan.num_tokens, plan.topk).to(ctx.weight_dtype)
        return grad_y, grad_w, None, None


def exchange_dispatch(x: torch.Tensor, topk_weight: torch.Tensor, plan: ExchangePlan,
                      moe_ops) -> tuple[torch.Tensor, torch.Tensor]:
    """``(permuted, row_weight)``: the permuted rows ``[R, H]`` of this rank's experts,
    received through the plan's transport (NOTE [live-row exchange layout]), and the router
    weight of each row (``[R]``, topk_weight's dtype; 0 for padding). Differentiable in ``x``
    ``[T, H]`` and ``topk_weight`` ``[T, K]`` (both on the transport's device). A collective.

    The plan does not keep the outputs (they hold the autograd graph that holds the plan)."""
    return _DispatchExchange.apply(x, topk_weight, plan, moe_ops)


def exchange_resend(x: torch.Tensor, plan: ExchangePlan, moe_ops,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The permuted rows ``[R, H]`` of this rank's experts pushed again from the tokens ``x``
    (``[T, H]``, the very tokens the plan's dispatch sent, unchanged since), without autograd
    and without the router weights: what :func:`exchange_dispatch` received, row for row
    (NOTE [resent rows] in ``live.py``), written into ``out`` (``[R, H]``, x's dtype and
    device) when given. A collective, inside a CUDA graph too: every rank calls it at the same
    point of its step (a layer's backward)."""
    if out is None:
        out = x.new_empty(plan.budget_rows, x.shape[1])
    _dispatch_direction(plan, moe_ops, (x.detach().contiguous(), plan.token_of_slot, out),
                        fresh=False, own_rows_home=True)   # NOTE [resent own rows]
    return out


def exchange_send_home(grad_rows: torch.Tensor, plan: ExchangePlan) -> None:
    """Push the input gradients of the permuted rows (``[R, H]``, contiguous, the dtype and
    device of the rows the plan's dispatch received) home now, ahead of the dispatch's
    backward, which then finds them there and pushes only the router weights' gradients
    (NOTE [exchange beside the experts] in ``overlap.py``). Only if ``grad_rows`` reaches that
    backward unchanged (the same tensor, the same version); anything else is pushed again
    there. A collective: every rank calls it at the same point of its backward."""
    _combine_direction(plan, grad_rows)
    plan.sent_home[:] = [(grad_rows, grad_rows._version)]


def exchange_combine(y: torch.Tensor, topk_weight: torch.Tensor | None, plan: ExchangePlan,
                     moe_ops) -> torch.Tensor:
    """``out[t] = sum_k (topk_weight[t, k] *) y[row of (t, k)]`` with the rows ``y``
    (``[R, H]``, this rank's experts' outputs) sent back to their tokens' ranks; ``[T, H]``.
    Unweighted when ``topk_weight`` is None (nothing kept for backward). A collective."""
    return _CombineExchange.apply(y, topk_weight, plan, moe_ops)
