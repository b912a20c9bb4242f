"""Per-expert biases over the permuted buffer: which expert a row belongs to, a bias added to
each row, and the per-expert sums that are the biases' gradients.

NOTE [expert biases]: an expert bias is a row ``[E, width]`` per expert added to every row of
that expert (GPT-OSS's ``gate_up_proj_bias`` and ``down_proj_bias``). The first GEMM's bias
is added inside the activation kernels (``bias=`` of ``act_forward`` / ``act_backward``:
each row reads its expert from the cumulative counts, on the device, and adds the bias in the
accumulator dtype before the activation; the saved pre-activation stays bias-free). The
second GEMM's bias is added to its output, scaled by the router weight as the output is (NOTE
[expert MLP saved tensors] in ``mlp.py``: ``y = (w a) W2^T + w b2``), with torch operations
that index it by each row's expert. Both gradients are per-expert sums over the rows of each
expert: with the native grouped GEMM, one grouped product against a column of ones (or of the
router weights), which reads only rows inside the counts; otherwise an ``index_add_`` over
every row, rows past the live count selected out (NOTE [rows past the counts] in
``experts.py``). Nothing reads a count back to the host, so all of it is capturable.
"""
from __future__ import annotations

import torch

from ..reference.arithmetic import acc_dtype
from ..reference.experts import expert_of_row

__all__ = ["add_row_bias", "bias_row_dot", "expert_ends", "expert_of_row", "segment_sum"]

_ONES_COLUMNS = 8       # 16-byte rows for 16-bit data: the grouped GEMM's layout


def expert_ends(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """int64 ``[E]`` cumulative rows of the experts (``tokens_per_expert``: int ``[E]``)."""
    return torch.cumsum(tokens_per_expert, 0, dtype=torch.int64)


def add_row_bias(y: torch.Tensor, bias: torch.Tensor, ends: torch.Tensor,
                 scale: torch.Tensor | None) -> torch.Tensor:
    """``y[r] + scale[r] * bias[e(r)]`` for every row (rows past the counts get the last
    expert's bias: unspecified rows stay unspecified).

    Args:
        y: ``[rows, width]`` floating; bias ``[E, width]``, y's dtype and device.
        ends: int64 ``[E]`` (:func:`expert_ends`); scale: ``[rows]`` y's dtype, or None for 1.
    """
    rows_bias = bias[expert_of_row(ends, y.shape[0])]
    if scale is not None:
        rows_bias = rows_bias * scale.unsqueeze(1)
    return y + rows_bias


def bias_row_dot(grad: torch.Tensor, bias: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``<grad[r], bias[e(r)]>`` per row in the accumulator dtype (the router weight's share
    of the gradient through a scaled bias). grad ``[rows, width]``, bias ``[E, width]``."""
    acc = acc_dtype(grad.dtype)
    rows_bias = bias[expert_of_row(ends, grad.shape[0])]
    return (grad.to(acc) * rows_bias.to(acc)).sum(1)


def segment_sum(values: torch.Tensor, scale: torch.Tensor | None,
                tokens_per_expert: torch.Tensor, impl: str) -> torch.Tensor:
    """``out[e] = sum over the rows r of expert e of scale[r] * values[r]``, ``[E, width]`` in
    values' dtype (NOTE [expert biases]).

    Args:
        values: ``[rows, width]`` floating; scale: ``[rows]`` values' dtype, or None for 1.
        tokens_per_expert: int ``[E]`` rows of each expert, on values' device.
        impl: the grouped GEMM the experts run (``"grouped"`` sums with one grouped product).
    """
    rows = values.shape[0]
    experts = tokens_per_expert.shape[0]
    ends = expert_ends(tokens_per_expert)
    if impl == "grouped":
        column = values.new_zeros(rows, _ONES_COLUMNS)
        column[:, 0] = 1 if scale is None else scale
        offsets = ends.to(torch.int32)
        return torch._grouped_mm(values.transpose(0, 1), column, offs=offsets)[..., 0]
    acc = acc_dtype(values.dtype)
    live = torch.arange(rows, device=values.device) < ends[-1]
    weighted = values.to(acc) if scale is None else values.to(acc) * scale.to(acc).unsqueeze(1)
    weighted = torch.where(live.unsqueeze(1), weighted, torch.zeros((), dtype=acc,
                                                                     device=values.device))
    out = torch.zeros(experts, values.shape[1], dtype=acc, device=values.device)
    out.index_add_(0, expert_of_row(ends, rows), weighted)
    return out.to(values.dtype)
