"""The expert MLP over the permuted buffer: ``grouped_mm(act(grouped_mm(x, w1)) * w, w2)``,
plain (``act = silu``) or gated (SwiGLU: ``silu(gate) * up``, HuggingFace's weight layout).

NOTE [expert MLP saved tensors]: autograd would keep four budget-sized tensors per MoE layer
for an MLP followed by a weighted combine: the permuted input, the pre-activation, the
activation (the second GEMM's input) and the expert output (combine needs it for the router
weight's gradient; under expert parallelism, as the rows sent back to the token's rank).
:func:`expert_mlp` keeps two, ``[rows, hidden]`` and ``[rows, ffn]`` (``[rows, 2 * ffn]``
gated):

- the router weight of each row multiplies the activation before the second GEMM instead of
  the output after it (the GEMM is linear, so the product is the same; only the rounding
  point moves), so :func:`~graphstash.moe.combine` sums unweighted rows (``weighted=False``)
  and keeps nothing, and the weight's gradient is ``<grad of the scaled activation,
  activation>`` per row, computed in the second GEMM's backward;
- the second GEMM's backward recomputes the scaled activation from the kept pre-activation
  instead of keeping it: the activation's backward kernel, which reads the pre-activation
  anyway, writes it (NOTE [expert backward temporaries]).

Every GEMM runs once forward and twice backward, as without recomputation. Fewer kept rows
mean less for a stash to copy out and back, and less memory with or without one.

NOTE [regathered input]: on one device the permuted input is a gather of the dispatched
tokens, which the step keeps anyway (the router's linear saves them). Given the dispatch's
``handle``, :func:`expert_mlp` keeps those tokens instead of the ``[rows, hidden]`` permuted
buffer and gathers it again in backward for the first GEMM's weight gradient: one gather per
layer in backward buys a budget-sized tensor less per layer, in memory and in what a stash
copies out and back. Under expert parallelism the rows came through an exchange: the permuted
buffer is kept, unless the exchange resends them (NOTE [resent rows] in
``graphstash/moe/exchange/live.py``), which :meth:`~graphstash.moe.DispatchHandle.regather`
then does in place of the gather. The gather gives the input only if ``x`` is the very
tensor the dispatch returned and neither it nor the tokens changed since, so
:func:`expert_mlp` refuses anything else (a ``dropout(permuted)`` gave weight gradients
25.5 off, tokens modified in place between dispatch and the experts 14.2 off): the identity
of ``x`` and the version counters of ``x`` and the tokens at dispatch time are checked in the
forward, and the tokens' version again in backward before the gather (autograd's own in-place
check does not run when saved-tensor hooks hold the tokens). While torch.compile traces,
versions are not graph values; only the identity is checked then.

NOTE [count-aware expert kernels]: the activation, its gate product, the router-weight
scaling, their backward and the per-row weight-gradient dot run as one fused kernel each way
(``raw_kernels/moe_experts.cu``; :mod:`graphstash.reference.experts` is the oracle) that
reads the live row count (the sum of ``tokens_per_expert``) on the device and touches only
rows below it: budget rows past the count cost no time. Their values are left unspecified,
which no grouped GEMM lets reach a result (NOTE [rows past the counts] in ``experts.py``).

NOTE [expert backward temporaries]: under a static budget every temporary of the experts'
backward is budget-sized, and in the first layers of backward they sit beside every other
layer's saved tensors, which is where a step's peak was (the memory-bound configuration of
``graphstash bench moe``, docs/moe-performance.md). So the backward keeps as few alive at
once as the arithmetic allows:

- the first GEMM's weight gradient is computed first and its input (the regathered tokens)
  freed before the input gradient is allocated, which then takes the freed memory
  (:func:`~graphstash.moe.experts.grouped_mm_grads` computes either half);
- the second GEMM's input gradient (the activation's gradient, ``[rows, ffn]``) comes first,
  and one fused kernel reads it with the pre-activation, writes the pre-activation's gradient
  and writes the recomputed, scaled activation over the activation's gradient, which the
  weight gradient then reads. The recomputation costs no pass of its own over the
  pre-activation (it was one until the kernel wrote both: measured on an H200 at
  Qwen3-30B-A3B widths, 8192 tokens, 95 us a layer, docs/moe-performance.md change 8), and
  the activation takes no memory of its own;
- the activation's gradient is written over the pre-activation it is computed from (the
  fused kernel reads each element before it writes it, in the same thread), instead of into
  a new ``[rows, ffn]`` (``[rows, 2 * ffn]`` gated) tensor. Only when the saved tensor is not
  needed again: not when autograd keeps the graph (``retain_graph``, ``create_graph``) or
  outside an autograd graph task (``torch.compile`` tracing its backward ahead of time),
  where it is allocated as before. The saved tensor's version is then bumped, so anything
  that unpacked it and would read it again gets autograd's in-place error, never stale
  values.

At its worst point the second GEMM's backward now holds, beside the ``[rows, hidden]``
output gradient, the pre-activation (then its gradient, in the same memory) and one
``[rows, ffn]`` block (the activation's gradient, then the recomputed activation): two such
blocks instead of three for plain experts, three instead of five for gated ones (whose
pre-activation is ``[rows, 2 * ffn]``). Under an exchange that runs its backward pushes
beside the GEMMs (NOTE [exchange beside the experts] in
``graphstash/moe/exchange/overlap.py``) the order is the one that overlap needs instead: the
first GEMM's input gradient comes right after the pre-activation's, and with the rows resent
they and that gradient are alive at once, one ``[rows, hidden]`` block more.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

from .._checks import describe, require_tensor
from ..reference.arithmetic import acc_dtype
from ..reference.activation import ExpertActivation
from ._dispatch import check_handle
from .backend import kernels_for
from .expert_bias import add_row_bias, bias_row_dot, expert_ends, segment_sum
from .experts import (TRUSTED, check_counts, check_grouped_args, grouped_mm_grads,
                      grouped_mm_resolved, grouped_product, resolve_impl)

__all__ = ["expert_mlp"]


class _Overlap:
    """What the two expert GEMMs' backwards share when the exchange's pushes run beside them
    (NOTE [exchange beside the experts] in ``graphstash/moe/exchange/overlap.py``): made in
    the forward, filled by :class:`_ActivatedGEMM`'s backward (which runs first: the first
    GEMM's output feeds only the second), read and emptied by :class:`_HandledGEMM`'s.

    The second GEMM's backward starts the resend on the side stream (the tokens are kept
    there, not by the first GEMM), computes the first GEMM's input gradient right after the
    pre-activation's (``w1`` is a parameter: keeping it costs nothing) and pushes it home on
    the side stream; both weight gradients then run beside that push, with the SMs it takes
    carved out. So the push home has both weight gradients beside it, the resend both input
    gradients of the second GEMM and the first."""

    def __init__(self, handle, w1, counts, impl, bad, regathers: bool):
        self.handle, self.w1, self.counts, self.impl, self.bad = handle, w1, counts, impl, bad
        # kept outside save_for_backward, so autograd does not check them: checked here
        self.versions = (w1._version, counts._version)
        self.regathers = regathers
        self.beside = self.x = self.resent = self.grad_x = None
        self.grad_pre = None            # (the pre-activation's gradient, its version)

    def backward_of_second(self, source, grad_pre_of):
        """In :class:`_ActivatedGEMM`'s backward: start the resend of ``source`` (the tokens,
        or None), run ``grad_pre_of(carve)`` (the second GEMM's input gradient and the
        activation's backward, GEMMs under ``carve``), the first GEMM's input gradient, and
        push it home. Returns the pre-activation's gradient."""
        handle = self.handle
        if not torch.compiler.is_compiling() and \
                (self.w1._version, self.counts._version) != self.versions:
            raise RuntimeError("expert_mlp: w1 or tokens_per_expert was modified in place "
                               "between the forward and the backward; the input gradient "
                               "would not be the forward's")
        beside = self.beside = handle.beside()
        carve = beside.carved if self.regathers else contextlib.nullcontext
        if self.regathers:
            x = source.new_empty(handle.budget_rows, source.shape[1])   # main stream
            with beside.side():
                handle.regather(source, out=x)
            self.x, self.resent = x, beside.mark()
        grad_pre = grad_pre_of(carve)
        with carve():
            grad_x, _ = grouped_mm_grads(grad_pre, None, self.w1, self.counts, self.impl,
                                         bad=self.bad, need_weight=False)
        self.grad_x = grad_x.contiguous()
        self.grad_pre = (grad_pre, grad_pre._version)
        with beside.side():
            handle.send_home(self.grad_x)
        return grad_pre

    def backward_of_first(self, grad, kept, w1, counts):
        """In :class:`_HandledGEMM`'s backward: ``(grad_x, grad_w1)``, the weight gradient
        beside the push home, then the main stream joins the side stream."""
        beside = self.beside
        if beside is None:
            raise RuntimeError("expert_mlp: the first expert GEMM's backward ran before the "
                               "second's, which the exchange's overlap relies on")
        x = self.x if self.regathers else kept
        sent, version = self.grad_pre
        grad_x = self.grad_x
        if not (grad.data_ptr() == sent.data_ptr() and grad._version == version
                and grad.shape == sent.shape):
            # another gradient than the one pushed: the dispatch's backward sees it is not
            # the tensor sent home and pushes this one (NOTE [exchange beside the experts])
            grad_x, _ = grouped_mm_grads(grad, None, w1, counts, self.impl, bad=self.bad,
                                         need_weight=False)
        beside.wait(self.resent)
        with beside.carved():
            _, grad_w = grouped_mm_grads(grad, x, w1, counts, self.impl, bad=self.bad,
                                         need_x=False)
        beside.join()      # everything the side stream read or wrote stays referenced until here
        self.beside = self.x = self.resent = self.grad_x = self.grad_pre = None
        return grad_x, grad_w


class _HandledGEMM(torch.autograd.Function):
    """``pre = grouped_mm(x, w1)`` given the dispatch's handle: keeping the dispatched tokens
    instead of x when ``source`` is given (NOTE [regathered input]), x otherwise, or neither
    under ``overlap`` with the rows resent (the second GEMM keeps the tokens then); x's
    gradient flows on to the dispatch, the tokens get none here. Under ``overlap`` (an
    :class:`_Overlap`) the backward runs beside the exchange's pushes (NOTE [exchange beside
    the experts] in ``graphstash/moe/exchange/overlap.py``)."""

    @staticmethod
    def forward(ctx, x, source, w1, counts, impl, handle, bad, overlap):
        ctx.regathers = source is not None
        ctx.overlap = overlap
        kept = source if ctx.regathers else (None if overlap and overlap.regathers else x)
        ctx.save_for_backward(kept, w1, counts)
        # the handle without its own reference to the tokens: they reach backward only
        # through save_for_backward (saved-tensor hooks); a weak one checks their version
        ctx.impl, ctx.bad = impl, bad
        ctx.handle = dataclasses.replace(handle, source=None, permuted_ref=None)
        ctx.source_ref = weakref.ref(source) if ctx.regathers else None
        return grouped_product(x, w1, counts, impl, bad)

    @staticmethod
    def backward(ctx, grad):
        kept, w1, counts = ctx.saved_tensors
        handle = ctx.handle
        grad = grad.contiguous()
        if ctx.overlap is not None:
            grad_x, grad_w = ctx.overlap.backward_of_first(grad, kept, w1, counts)
            return grad_x, None, grad_w, None, None, None, None, None
        if ctx.regathers:
            handle.check_source(ctx.source_ref())       # NOTE [regathered input]
        x = handle.regather(kept) if ctx.regathers else kept
        del kept
        # NOTE [expert backward temporaries]: x is freed before x's gradient takes its place
        _, grad_w = grouped_mm_grads(grad, x, w1, counts, ctx.impl, bad=ctx.bad, need_x=False)
        del x
        grad_x, _ = grouped_mm_grads(grad, None, w1, counts, ctx.impl, bad=ctx.bad,
                                     need_weight=False)
        return grad_x, None, grad_w, None, None, None, None, None


class _ActivatedGEMM(torch.autograd.Function):
    """``y = grouped_mm(act(pre + b1) * row_weight, w2) + row_weight * b2``, keeping pre (NOTE
    [expert MLP saved tensors]); the activation runs count-aware (NOTE [count-aware expert
    kernels]); the biases as NOTE [expert biases] in ``expert_bias.py`` says."""

    @staticmethod
    def forward(ctx, pre, row_weight, w2, counts, impl, gated, bad, layout, bias1, bias2,
                source=None, overlap=None):
        act, interleaved = layout
        ops = kernels_for("auto", pre.device)
        live = counts.sum().view(1)
        ends = expert_ends(counts) if bias1 is not None or bias2 is not None else None
        a = pre.new_empty(pre.shape[0], w2.shape[2])
        ops.act_forward(a, pre, row_weight, live, gated=gated, activation=act.kind,
                        constants=act.constants(), interleaved=interleaved, bias=bias1,
                        ends=ends)
        y = grouped_product(a, w2, counts, impl, bad)
        if bias2 is not None:
            y = add_row_bias(y, bias2, ends, row_weight)
        ctx.save_for_backward(pre, row_weight, w2, counts, bias1, bias2, source)
        ctx.impl, ctx.gated, ctx.ops, ctx.bad, ctx.layout = impl, gated, ops, bad, layout
        ctx.overlap = overlap
        ctx.source_ref = weakref.ref(source) if source is not None else None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        pre, row_weight, w2, counts, bias1, bias2, source = ctx.saved_tensors
        ops, impl, gated = ctx.ops, ctx.impl, ctx.gated
        act, interleaved = ctx.layout
        grad_y = grad_y.contiguous()
        live = counts.sum().view(1)
        ends = expert_ends(counts) if bias1 is not None or bias2 is not None else None
        grad_b2 = None
        if bias2 is not None and ctx.needs_input_grad[9]:
            grad_b2 = segment_sum(grad_y, row_weight, counts, impl)
        grad_row = None
        if row_weight is not None and ctx.needs_input_grad[1]:
            grad_row = torch.empty(pre.shape[0], dtype=acc_dtype(pre.dtype), device=pre.device)
        kept_a = []

        def grad_pre_of(carve, grad_y=grad_y):
            # NOTE [expert backward temporaries]: the activation's gradient first; the fused
            # kernel then writes the recomputed activation over it, which lives only for the
            # weight gradient
            with carve():
                grad_a, _ = grouped_mm_grads(grad_y, None, w2, counts, impl, bad=ctx.bad,
                                             need_weight=False)
            grad_a = grad_a.contiguous()
            over = _may_overwrite(pre)
            grad_pre = pre if over else torch.empty_like(pre)
            ops.act_backward(grad_pre, grad_row, grad_a, pre, row_weight, live, gated=gated,
                             write_act=True, activation=act.kind, constants=act.constants(),
                             interleaved=interleaved, bias=bias1, ends=ends)
            if over:
                torch.autograd.graph.increment_version(pre)
            kept_a.append(grad_a)           # now the recomputed activation
            return grad_pre

        overlap = ctx.overlap
        if overlap is None:
            grad_pre = grad_pre_of(contextlib.nullcontext)
        else:
            if source is not None:
                overlap.handle.check_source(ctx.source_ref())   # NOTE [regathered input]
            grad_pre = overlap.backward_of_second(source, grad_pre_of)
        del source, grad_pre_of
        a = kept_a.pop()
        with overlap.beside.carved() if overlap is not None else contextlib.nullcontext():
            _, grad_w2 = grouped_mm_grads(grad_y, a, w2, counts, impl, bad=ctx.bad,
                                          need_x=False)
        del a
        if grad_row is not None:
            if bias2 is not None:          # NOTE [expert biases]: y holds row_weight * b2
                grad_row = grad_row + bias_row_dot(grad_y, bias2, ends)
            # rows past the count carry no router weight (dispatch gives them 0) and were not
            # computed (NOTE [count-aware expert kernels])
            rows = torch.arange(pre.shape[0], device=pre.device)
            grad_row = grad_row.to(row_weight.dtype)
            grad_row = torch.where(rows < live, grad_row, torch.zeros_like(grad_row))
        del grad_y
        grad_b1 = None
        if bias1 is not None and ctx.needs_input_grad[8]:
            grad_b1 = segment_sum(grad_pre, None, counts, impl)
        return (grad_pre, grad_row, grad_w2, None, None, None, None, None, grad_b1, grad_b2,
                None, None)


def _may_overwrite(saved: torch.Tensor) -> bool:
    """Whether a backward may write its gradient over ``saved``, a contiguous tensor it
    unpacked: only when autograd frees the graph after this backward (NOTE [expert backward
    temporaries])."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keep_graph is None or torch.compiler.is_compiling() or keep_graph():
        return False            # unknown (another torch), tracing, or the graph is kept
    return saved.is_contiguous()


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               tokens_per_expert: torch.Tensor, row_weight: torch.Tensor | None = None,
               *, gated: bool = False, activation="silu", impl: str = "auto",
               handle=None, interleaved: bool = False, bias1: torch.Tensor | None = None,
               bias2: torch.Tensor | None = None) -> torch.Tensor:
    """``y[rows of e] = (act(x[rows of e] @ w1[e].T + b1[e]) * row_weight) @ w2[e].T
    + row_weight * b2[e]``.

    Plain: ``act = silu`` (or the activation given). Gated (SwiGLU, HuggingFace's
    ``gate_up_proj`` / ``down_proj`` layout, used as it is): ``h = x @ w1[e].T`` is ``[gate |
    up]`` (``interleaved``: ``g0 u0 g1 u1 ...``, GPT-OSS) and ``act(h) = silu(gate) * up`` (or
    the gate NOTE [expert activations] describes).

    Args:
        x: ``[rows, hidden]`` permuted tokens (the dispatch output), floating.
        w1: ``[num_local_experts, ffn, hidden]`` (plain) or ``[num_local_experts, 2 * ffn,
            hidden]`` (gated: the gate's ``ffn`` rows, then the up projection's), dtype and
            device of x.
        w2: ``[num_local_experts, hidden_out, ffn]``, dtype and device of x.
        tokens_per_expert: int32/int64 ``[num_local_experts]`` rows of each expert, on x's
            device (see :func:`~graphstash.moe.grouped_mm`).
        row_weight: ``[rows]`` router weight of each row, dtype and device of x (from
            :meth:`~graphstash.moe.DispatchHandle.permuted_weights`), or ``None`` for 1.
            Pass it with ``combine(y, handle, weighted=False)``.
        gated: whether w1 holds gate and up projections (see above).
        activation: a kind name (``"silu"``, ``"gelu"``, ...) or a
            :class:`~graphstash.moe.ExpertActivation` with its constants (NOTE [expert
            activations] in ``graphstash/reference/activation.py``).
        interleaved: gated only: w1's rows alternate gate and up (``[g0, u0, g1, u1, ...]``).
        bias1: ``[num_local_experts, w1 rows]`` bias of the first GEMM, or None.
        bias2: ``[num_local_experts, hidden_out]`` bias of the second GEMM (scaled by
            ``row_weight`` as the product is), or None. Both dtype and device of x; their
            gradients come from per-expert sums (NOTE [expert biases] in ``expert_bias.py``).
        impl: as for :func:`~graphstash.moe.grouped_mm`, for each of the two GEMMs.
        handle: the :class:`~graphstash.moe.DispatchHandle` of the dispatch that produced x;
            on one device x is then gathered again in backward instead of being kept (NOTE
            [regathered input]): x must be the very ``permuted`` tensor that dispatch
            returned, and neither it nor the dispatched tokens may be modified since
            (ValueError naming ``handle`` or ``x`` otherwise). Under expert parallelism x is
            kept, unless the exchange resends the rows (NOTE [resent rows]).
    Returns ``[rows, hidden_out]``; rows past the counts are unspecified. Differentiable in
    x, w1, w2 and row_weight. Autograd keeps x and the pre-activation, no more (NOTE [expert
    MLP saved tensors]); the elementwise work touches only the rows inside the counts (NOTE
    [count-aware expert kernels]). Example::

        permuted, counts, handle = dispatch(x, idx, w, E, budget=budget)
        y = expert_mlp(permuted, gate_up_proj, down_proj, counts, handle.permuted_weights(),
                       gated=True, handle=handle)
        out = combine(y, handle, weighted=False)
    """
    if not isinstance(gated, bool):
        raise TypeError(f"gated: expected a bool, got {type(gated).__name__}")
    check_grouped_args(x, w1, tokens_per_expert, weight_name="w1",
                       out_name="2 * ffn" if gated else "ffn")
    act = ExpertActivation.of(activation)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    if interleaved and not gated:
        raise ValueError("interleaved: only gated experts have gate and up rows to interleave")
    if gated and w1.shape[1] % 2:
        raise ValueError(f"w1: gated experts need [experts, 2 * ffn, hidden] (gate rows, then "
                         f"up rows), got an odd row count: {describe(w1)}")
    ffn = w1.shape[1] // 2 if gated else w1.shape[1]
    expected = f"[{w1.shape[0]}, hidden_out, {ffn}] in {x.dtype} on {x.device}"
    require_tensor("w2", w2, f"a 3-D floating tensor {expected}")
    if w2.dtype != x.dtype:
        raise TypeError(f"w2: expected {expected}, got {describe(w2)}")
    if (w2.dim() != 3 or w2.shape[0] != w1.shape[0] or w2.shape[2] != ffn
            or w2.device != x.device):
        raise ValueError(f"w2: expected {expected}, got {describe(w2)}")
    if row_weight is not None:
        require_tensor("row_weight", row_weight, "a 1-D floating tensor")
        if (tuple(row_weight.shape) != (x.shape[0],) or row_weight.dtype != x.dtype
                or row_weight.device != x.device):
            raise ValueError(f"row_weight: expected [{x.shape[0]}] in {x.dtype} on {x.device}, "
                             f"got {describe(row_weight)}")
    for name, bias, width in (("bias1", bias1, w1.shape[1]), ("bias2", bias2, w2.shape[1])):
        if bias is None:
            continue
        expected = f"[{w1.shape[0]}, {width}] in {x.dtype} on {x.device}"
        require_tensor(name, bias, f"a 2-D floating tensor {expected}")
        if (tuple(bias.shape) != (w1.shape[0], width) or bias.dtype != x.dtype
                or bias.device != x.device):
            raise ValueError(f"{name}: expected {expected}, got {describe(bias)}")
    regather = overlap = False
    if handle is not None:
        check_handle(handle)
        regather = handle.regathers and handle.source is not None
        if regather:
            handle.check_expert_input(x)             # NOTE [regathered input]
        overlap = handle.overlaps
    # NOTE [expert counts]: a dispatch's own counts need no check; others are checked once
    impl1 = resolve_impl(x, w1, impl)
    bad = TRUSTED
    if handle is None or not handle.trusts_counts(tokens_per_expert):
        bad = check_counts(tokens_per_expert, x.shape[0], impl1)
    # only where x's gradient goes home (NOTE [exchange beside the experts])
    ahead = None
    if overlap and x.requires_grad and torch.is_grad_enabled():
        ahead = _Overlap(dataclasses.replace(handle, source=None, permuted_ref=None), w1,
                         tokens_per_expert, impl1, bad, regather)
    source = handle.source if regather else None
    if ahead is not None:
        pre = _HandledGEMM.apply(x, None, w1, tokens_per_expert, impl1, handle, bad, ahead)
    elif regather:
        pre = _HandledGEMM.apply(x, source, w1, tokens_per_expert, impl1, handle, bad, None)
    else:
        pre = grouped_mm_resolved(x, w1, tokens_per_expert, impl1, bad)
    # the second GEMM's input is the activation, [rows, w2 columns]: resolved on a view of
    # that width, since its row bytes decide the native op's layout check as x's did the first
    impl2 = resolve_impl(pre.narrow(1, 0, w2.shape[2]), w2, impl)
    return _ActivatedGEMM.apply(pre, row_weight, w2, tokens_per_expert, impl2, gated, bad,
                                (act, interleaved), bias1, bias2,
                                source if ahead is not None else None, ahead)
