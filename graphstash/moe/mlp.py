"""The expert MLP over the permuted buffer: ``grouped_mm(silu(grouped_mm(x, w1)) * w, w2)``.

NOTE [expert MLP saved tensors]: autograd would keep four budget-sized tensors per MoE layer
for a SiLU MLP followed by a weighted combine: the permuted input, the pre-activation, the
activation (the second GEMM's input) and the expert output (combine needs it for the router
weight's gradient; under expert parallelism, as the rows sent back to the token's rank). :func:`expert_mlp` keeps two, ``[rows, hidden]`` and ``[rows, ffn]``:

- the router weight of each row multiplies the activation before the second GEMM instead of
  the output after it (the GEMM is linear, so the product is the same; only the rounding
  point moves), so :func:`~graphstash.moe.combine` sums unweighted rows (``weighted=False``)
  and keeps nothing, and the weight's gradient is ``<grad of the scaled activation,
  activation>`` per row, computed in the second GEMM's backward;
- the second GEMM's backward recomputes ``silu(pre) * w`` from the kept pre-activation (an
  elementwise pass) instead of keeping the activation.

Every GEMM runs once forward and twice backward, as without recomputation. Fewer kept rows
mean less for a stash to copy out and back, and less memory with or without one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import describe, require_tensor
from .experts import _check_grouped_args, grouped_mm, grouped_mm_grads, resolve_impl

__all__ = ["expert_mlp"]


def _activate(pre: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
    a = F.silu(pre)
    if row_weight is not None:
        a.mul_(row_weight.unsqueeze(1))
    return a


def _row_dots(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[r] = sum_j a[r, j] * b[r, j]`` accumulated in float32 (float64 for float64)."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    if a.device.type == "cuda":
        from .dispatch import _ops

        _, ops = _ops("auto", a.device)
        index = torch.arange(a.shape[0], dtype=torch.int32, device=a.device).unsqueeze(1)
        out = torch.empty(a.shape[0], dtype=acc, device=a.device)
        ops.weight_grad(out, a, b, index)          # one warp per row, no [rows, j] temporary
        return out.to(dtype)
    return torch.linalg.vecdot(a.to(acc), b.to(acc)).to(dtype)


class _ActivatedGEMM(torch.autograd.Function):
    """``y = grouped_mm(silu(pre) * row_weight, w2)``, keeping pre (NOTE [expert MLP saved
    tensors])."""

    @staticmethod
    def forward(ctx, pre, row_weight, w2, counts, impl):
        a = _activate(pre, row_weight)
        y = grouped_mm(a, w2, counts, impl=impl)
        ctx.save_for_backward(pre, row_weight, w2, counts)
        ctx.impl = impl
        return y

    @staticmethod
    def backward(ctx, grad_y):
        pre, row_weight, w2, counts = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        a = _activate(pre, row_weight)
        grad_a, grad_w2 = grouped_mm_grads(grad_y, a, w2, counts, ctx.impl)
        del a
        grad_row = None
        if row_weight is not None:
            if ctx.needs_input_grad[1]:
                grad_row = _row_dots(grad_a, F.silu(pre), row_weight.dtype)
            grad_a.mul_(row_weight.unsqueeze(1))
        grad_pre = torch.ops.aten.silu_backward(grad_a, pre)
        return grad_pre, grad_row, grad_w2, None, None


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               tokens_per_expert: torch.Tensor, row_weight: torch.Tensor | None = None,
               *, impl: str = "auto") -> torch.Tensor:
    """``y[rows of e] = (silu(x[rows of e] @ w1[e].T) * row_weight) @ w2[e].T``.

    Args:
        x: ``[rows, hidden]`` permuted tokens (the dispatch output), floating.
        w1: ``[num_local_experts, ffn, hidden]``, dtype and device of x.
        w2: ``[num_local_experts, hidden_out, ffn]``, dtype and device of x.
        tokens_per_expert: int32/int64 ``[num_local_experts]`` rows of each expert, on x's
            device (see :func:`~graphstash.moe.grouped_mm`).
        row_weight: ``[rows]`` router weight of each row, dtype and device of x (from
            :meth:`~graphstash.moe.DispatchHandle.permuted_weights`), or ``None`` for 1.
            Pass it with ``combine(y, handle, weighted=False)``.
        impl: as for :func:`~graphstash.moe.grouped_mm`, for each of the two GEMMs.
    Returns ``[rows, hidden_out]``; rows past the counts are unspecified. Differentiable in
    x, w1, w2 and row_weight. Autograd keeps x and the pre-activation, no more (NOTE [expert
    MLP saved tensors]). Example::

        permuted, counts, handle = dispatch(x, idx, w, E, budget=budget)
        y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights())
        out = combine(y, handle, weighted=False)
    """
    _check_grouped_args(x, w1, tokens_per_expert)
    require_tensor("w2", w2, "a 3-D floating tensor")
    if (w2.dim() != 3 or w2.shape[0] != w1.shape[0] or w2.shape[2] != w1.shape[1]
            or w2.dtype != x.dtype or w2.device != x.device):
        raise ValueError(f"w2: expected [{w1.shape[0]}, hidden_out, {w1.shape[1]}] in "
                         f"{x.dtype} on {x.device}, got {describe(w2)}")
    if row_weight is not None:
        require_tensor("row_weight", row_weight, "a 1-D floating tensor")
        if (tuple(row_weight.shape) != (x.shape[0],) or row_weight.dtype != x.dtype
                or row_weight.device != x.device):
            raise ValueError(f"row_weight: expected [{x.shape[0]}] in {x.dtype} on {x.device}, "
                             f"got {describe(row_weight)}")
    pre = grouped_mm(x, w1, tokens_per_expert, impl=impl)
    return _ActivatedGEMM.apply(pre, row_weight, w2, tokens_per_expert,
                                resolve_impl(pre, w2, impl))
