"""Pure-torch expert activation kernels: the CPU backend and the oracle for
``raw_kernels/moe_experts.cu``.

``act_forward`` and ``act_backward`` take the same arguments as their counterparts in
:mod:`graphstash._kernels.experts` and write the same values into their outputs: the
elementwise results bit for bit on the same device (same operations, same order, float32
arithmetic for 16-bit data, NOTE [expert activation arithmetic]), the per-row dot of the
router-weight gradient in the kernel's summation order (NOTE [row dot order]).

NOTE [expert activation arithmetic]: for a pre-activation row ``pre`` (``[ffn]`` plain, or
``[2 * ffn]`` gated: gate ``g = pre[:ffn]``, up ``u = pre[ffn:]``, HuggingFace's
``gate_up_proj`` order; plain: ``g = pre``) and a router weight ``w`` (1 when absent), in the
accumulator dtype (float32; float64 for float64 data), every step rounded:

    s   = g / (1 + exp(-g))              silu
    sg  = 1 / (1 + exp(-g))              sigmoid
    ds  = sg * (1 + g * (1 - sg))        silu'
    a   = s * u (gated) or s;  out = a * w
    backward, given grad_out:  dot = <grad_out, a>  (the router weight's gradient)
                               ga = grad_out * w
                               grad_u = ga * s;  grad_g = (ga * u) * ds  (plain: ga * ds)

Only rows ``[0, live)`` are computed (the count-aware contract, docs/design.md): rows past the
live count are left as they are, or written as zeros with ``zero_tail``.
"""
from __future__ import annotations

import torch

from .arithmetic import acc_dtype

ACTIVATIONS = ("silu",)
LANES = 32          # one warp per row
BLOCK = 8           # elements a lane handles together (NOTE [row dot order])


def _split(pre: torch.Tensor, ffn: int, gated: bool, acc):
    g = pre[:, :ffn].to(acc)
    u = pre[:, ffn:2 * ffn].to(acc) if gated else None
    return g, u


def _silu(g: torch.Tensor) -> torch.Tensor:
    return g / (1 + torch.exp(-g))


def _live_mask(rows: int, live: torch.Tensor, device) -> torch.Tensor:
    return (torch.arange(rows, device=device) < live.reshape(1).to(device)).unsqueeze(1)


def _store(out: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, zero_tail: bool) -> None:
    keep = torch.zeros((), dtype=out.dtype, device=out.device) if zero_tail else out
    out.copy_(torch.where(mask, value.to(out.dtype), keep))


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_j a[r, j] * b[r, j]`` per row, in the kernels' order (NOTE [row dot order]).

    NOTE [row dot order]: a warp owns a row; element ``j`` belongs to block ``j // 8`` and
    block ``b`` to lane ``b % 32``. Each lane adds the rounded products of its blocks in
    increasing ``j``, starting from 0; then lane ``i`` adds lane ``i + o``'s sum for
    ``o = 16, 8, 4, 2, 1`` (a shuffle-down tree) and lane 0 holds the row's dot.

    Args:
        a, b: ``[rows, n]`` in the accumulator dtype, same device.
    Returns ``[rows]`` in that dtype.
    """
    rows, n = a.shape
    span = LANES * BLOCK
    padded = -(-n // span) * span if n else span
    prod = torch.zeros(rows, padded, dtype=a.dtype, device=a.device)
    prod[:, :n] = a * b
    prod = prod.view(rows, padded // span, LANES, BLOCK)       # [rows, step, lane, element]
    acc = torch.zeros(rows, LANES, dtype=a.dtype, device=a.device)
    for step in range(prod.shape[1]):
        for e in range(BLOCK):
            acc = acc + prod[:, step, :, e]
    width = LANES
    while width > 1:
        width //= 2
        acc = acc[:, :width] + acc[:, width:2 * width]
    return acc[:, 0]


def act_forward(out: torch.Tensor, pre: torch.Tensor, row_weight: torch.Tensor | None,
                live: torch.Tensor, *, gated: bool, activation: str = "silu",
                zero_tail: bool = False) -> None:
    """``out[r] = act(pre[r]) * row_weight[r]`` for rows ``r < live`` (NOTE [expert activation
    arithmetic]).

    Args:
        out: ``[rows, ffn]`` destination, dtype and device of ``pre``.
        pre: ``[rows, ffn]`` (plain) or ``[rows, 2 * ffn]`` (gated) pre-activation, floating.
        row_weight: ``[rows]`` router weight of each row (dtype of pre) or ``None``.
        live: int ``[1]`` rows in use, on the device.
        gated: whether ``pre`` holds gate and up halves.
        zero_tail: write zeros into rows ``>= live`` (else they are left untouched).
    """
    acc = acc_dtype(pre.dtype)
    ffn = out.shape[1]
    g, u = _split(pre, ffn, gated, acc)
    a = _silu(g)
    if gated:
        a = a * u
    if row_weight is not None:
        a = a * row_weight.to(acc).unsqueeze(1)
    _store(out, a, _live_mask(out.shape[0], live, out.device), zero_tail)


def act_backward(grad_pre: torch.Tensor, grad_row: torch.Tensor | None, grad_out: torch.Tensor,
                 pre: torch.Tensor, row_weight: torch.Tensor | None, live: torch.Tensor, *,
                 gated: bool, activation: str = "silu", zero_tail: bool = False,
                 write_act: bool = False) -> None:
    """Gradients of :func:`act_forward` for rows ``r < live``; with ``write_act``, also the
    forward's output, recomputed, written over ``grad_out`` (the values :func:`act_forward`
    writes), once the gradients are computed.

    Args:
        grad_pre: ``[rows, ffn]`` or ``[rows, 2 * ffn]`` destination (shape and dtype of pre).
        grad_row: ``[rows]`` destination in the accumulator dtype (float32; float64 for
            float64 data) for the router weight's gradient, or ``None`` to skip it (it needs
            ``row_weight``).
        grad_out: ``[rows, ffn]`` gradient of the forward's output, dtype of pre; with
            ``write_act`` its rows ``< live`` are then overwritten with the forward's output.
        pre, row_weight, live, gated: as in the forward.
        zero_tail: write zeros into the rows ``>= live`` of grad_pre and grad_row (and of
            grad_out with ``write_act``).
        write_act: also recompute the forward's output into grad_out (NOTE [expert backward
            temporaries] in ``graphstash/moe/mlp.py``).
    """
    acc = acc_dtype(pre.dtype)
    ffn = grad_out.shape[1]
    mask = _live_mask(grad_pre.shape[0], live, grad_pre.device)
    g, u = _split(pre, ffn, gated, acc)
    ga = grad_out.to(acc)
    s = _silu(g)
    sg = 1 / (1 + torch.exp(-g))
    ds = sg * (1 + g * (1 - sg))
    a = s * u if gated else s
    if grad_row is not None:
        _store(grad_row, row_dot(ga, a), mask.squeeze(1), zero_tail)
    if row_weight is not None:
        ga = ga * row_weight.to(acc).unsqueeze(1)
        a = a * row_weight.to(acc).unsqueeze(1)
    if gated:
        grad = torch.cat([(ga * u) * ds, ga * s], dim=1)
    else:
        grad = ga * ds
    # every value is computed before anything is stored: grad_pre may be pre, and ga a view
    # of grad_out (float32 data)
    _store(grad_pre, grad, mask, zero_tail)
    if write_act:
        _store(grad_out, a, mask, zero_tail)
