"""Pure-torch expert activation kernels: the CPU backend and the oracle for
``raw_kernels/moe_experts.cu``.

``act_forward`` and ``act_backward`` take the same arguments as their counterparts in
:mod:`graphstash._kernels.experts` and write the same values into their outputs: the
elementwise results bit for bit on the same device (same operations, same order, float32
arithmetic for 16-bit data, NOTE [expert activation arithmetic]), the per-row dot of the
router-weight gradient in the kernel's summation order (NOTE [row dot order]).

NOTE [expert activation arithmetic]: for a pre-activation row ``pre`` (``[ffn]`` plain, or
``[2 * ffn]`` gated: gate ``g = pre[:ffn]``, up ``u = pre[ffn:]``, HuggingFace's
``gate_up_proj`` order, or interleaved ``g = pre[0::2]``, ``u = pre[1::2]`` (GPT-OSS); plain:
``g = pre``), plus the bias row of its expert where one is given (``h = pre + bias[e]``, the
expert ``e`` of row ``r`` being the first with ``ends[e] > r``), and a router weight ``w`` (1
when absent), in the accumulator dtype (float32; float64 for float64 data), every step
rounded, the activation of NOTE [expert activations] (``graphstash/reference/activation.py``)
computes:

    f, df = the kind's value and derivative at the clamped gate (``_kind_terms``)
    U  = up after its clamp, softcap and offset;  dU its derivative (where they apply)
    a   = f * U (gated) or f;  out = a * w
    backward, given grad_out:  dot = <grad_out, a>  (the router weight's gradient)
                               ga = grad_out * w
                               grad_u = (ga * f) [* dU]
                               grad_g = ((ga * U) * df) (plain: ga * df), 0 where clamped

SiLU's terms are ``s = g / (1 + exp(-g))``, ``sg = 1 / (1 + exp(-g))``, ``ds = sg * (1 + g *
(1 - sg))``. A constant is rounded to the accumulator dtype before it is used; a clamp, cap or
offset that does not apply (inf limit, zero cap or offset) is skipped, not computed as an
identity, so SiLU without them is the arithmetic it always was.

Only rows ``[0, live)`` are computed (the count-aware contract, docs/design.md): rows past the
live count are left as they are, or written as zeros with ``zero_tail``.
"""
from __future__ import annotations

import math

import torch

from .activation import KINDS, ExpertActivation
from .arithmetic import acc_dtype

ACTIVATIONS = KINDS
LANES = 32          # one warp per row
BLOCK = 8           # elements a lane handles together (NOTE [row dot order])


def _split(h: torch.Tensor, ffn: int, gated: bool, interleaved: bool):
    if not gated:
        return h[:, :ffn], None
    if interleaved:
        return h[:, 0:2 * ffn:2], h[:, 1:2 * ffn:2]
    return h[:, :ffn], h[:, ffn:2 * ffn]


def _join(grad_g: torch.Tensor, grad_u: torch.Tensor | None, interleaved: bool) -> torch.Tensor:
    if grad_u is None:
        return grad_g
    if interleaved:
        return torch.stack([grad_g, grad_u], dim=2).reshape(grad_g.shape[0], -1)
    return torch.cat([grad_g, grad_u], dim=1)


def expert_of_row(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 ``[rows]``: the expert of each row, the first ``e`` with ``ends[e] > row``
    (rows past the last end get the last expert). ``ends``: int64 ``[E]`` cumulative counts."""
    index = torch.arange(rows, device=ends.device, dtype=ends.dtype)
    return torch.searchsorted(ends, index, right=True).clamp_(max=ends.shape[0] - 1)


def _pre_activation(pre: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor | None,
                    acc) -> torch.Tensor:
    h = pre.to(acc)
    if bias is not None:
        h = h + bias.to(acc)[expert_of_row(ends, pre.shape[0])]
    return h


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


_GELU_PDF = 0.3989422804014327      # 1 / sqrt(2 pi)
_GELU_TANH_BETA = 0.7978845608028654    # sqrt(2 / pi)
_GELU_TANH_KAPPA = 0.044715


def _kind_terms(g: torch.Tensor, act: ExpertActivation, need_grad: bool):
    """``(f, df)`` of NOTE [expert activations] at ``g`` (df None unless ``need_grad``),
    in the order the kernel rounds them (``kind_terms`` in ``raw_kernels/moe_experts.cu``)."""
    kind, df = act.kind, None
    if kind == "silu":
        f = g / (1 + torch.exp(-g))
        if need_grad:
            sg = 1 / (1 + torch.exp(-g))
            df = sg * (1 + g * (1 - sg))
    elif kind == "glu_alpha":
        ag = g * _const(act.alpha, g)
        sg = _sigmoid(ag)
        f = g * sg
        if need_grad:
            df = sg * (1 + ag * (1 - sg))
    elif kind == "softcap_silu":
        cap = _const(act.gate_cap, g)
        t = torch.tanh(g / cap)
        c = cap * t
        sg = _sigmoid(g)
        f = c * sg
        if need_grad:
            df = (1 - t * t) * sg + c * (sg * (1 - sg))
    elif kind == "gelu":
        cdf = _const(0.5, g) * (1 + torch.erf(g * _const(math.sqrt(0.5), g)))
        f = g * cdf
        if need_grad:
            df = cdf + g * (torch.exp(_const(-0.5, g) * (g * g)) * _const(_GELU_PDF, g))
    elif kind == "gelu_tanh":
        beta, kappa = _const(_GELU_TANH_BETA, g), _const(_GELU_TANH_KAPPA, g)
        t = torch.tanh(beta * (g + kappa * ((g * g) * g)))
        half = _const(0.5, g)
        f = (half * g) * (1 + t)
        if need_grad:
            df = half * (1 + t) + (half * g) * ((1 - t * t)
                                                * (beta * (1 + _const(3 * _GELU_TANH_KAPPA, g)
                                                           * (g * g))))
    elif kind == "relu":
        f = torch.where(g > 0, g, torch.zeros_like(g))
        if need_grad:
            df = (g > 0).to(g.dtype)
    elif kind == "relu2":
        r = torch.where(g > 0, g, torch.zeros_like(g))
        f = r * r
        if need_grad:
            df = 2 * r
    else:
        raise ValueError(f"activation: expected one of {KINDS}, got {kind!r}")
    return f, df


def _clamped_gate(g: torch.Tensor, act: ExpertActivation):
    """The clamped gate and where its gradient passes (None: everywhere)."""
    if math.isinf(act.gate_limit):
        return g, None
    limit = _const(act.gate_limit, g)
    return torch.where(g > limit, limit, g), g <= limit


def _up_terms(u: torch.Tensor, act: ExpertActivation, need_grad: bool):
    """``(U, dU, passes)``: up after clamp, softcap and offset; dU the softcap's derivative
    (None without one); where the clamp passes the gradient (None: everywhere)."""
    passes = du = None
    if not math.isinf(act.up_limit):
        limit = _const(act.up_limit, u)
        passes = (u >= -limit) & (u <= limit)
        u = torch.where(u > limit, limit, torch.where(u < -limit, -limit, u))
    if act.up_cap != 0:
        cap = _const(act.up_cap, u)
        t = torch.tanh(u / cap)
        u = cap * t
        if need_grad:
            du = 1 - t * t
    if act.up_offset != 0:
        u = u + _const(act.up_offset, u)
    return u, du, passes


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
                zero_tail: bool = False, constants: list[float] | None = None,
                interleaved: bool = False, bias: torch.Tensor | None = None,
                ends: torch.Tensor | None = None) -> None:
    """``out[r] = act(pre[r] + bias[e(r)]) * row_weight[r]`` for rows ``r < live`` (NOTE
    [expert activation arithmetic]).

    Args:
        out: ``[rows, ffn]`` destination, dtype and device of ``pre``.
        pre: ``[rows, ffn]`` (plain) or ``[rows, 2 * ffn]`` (gated) pre-activation, floating.
        row_weight: ``[rows]`` router weight of each row (dtype of pre) or ``None``.
        live: int ``[1]`` rows in use, on the device.
        gated: whether ``pre`` holds gate and up halves.
        activation: the kind (:data:`ACTIVATIONS`), with ``constants`` (six floats in
            ``graphstash.reference.activation.CONSTANTS`` order; None: the defaults).
        zero_tail: write zeros into rows ``>= live`` (else they are left untouched).
        interleaved: gated rows hold gate and up interleaved (``g0 u0 g1 u1 ...``).
        bias: ``[E, pre columns]`` per-expert bias (dtype of pre) or None; needs ``ends``,
            int64 ``[E]`` cumulative rows of the experts, on the device.
    """
    act = ExpertActivation.from_constants(activation, constants)
    acc = acc_dtype(pre.dtype)
    ffn = out.shape[1]
    g, u = _split(_pre_activation(pre, bias, ends, acc), ffn, gated, interleaved)
    g, _ = _clamped_gate(g, act)
    a, _ = _kind_terms(g, act, need_grad=False)
    if gated:
        a = a * _up_terms(u, act, need_grad=False)[0]
    if row_weight is not None:
        a = a * row_weight.to(acc).unsqueeze(1)
    _store(out, a, _live_mask(out.shape[0], live, out.device), zero_tail)


def act_backward(grad_pre: torch.Tensor, grad_row: torch.Tensor | None, grad_out: torch.Tensor,
                 pre: torch.Tensor, row_weight: torch.Tensor | None, live: torch.Tensor, *,
                 gated: bool, activation: str = "silu", zero_tail: bool = False,
                 write_act: bool = False, constants: list[float] | None = None,
                 interleaved: bool = False, bias: torch.Tensor | None = None,
                 ends: torch.Tensor | None = None) -> None:
    """Gradients of :func:`act_forward` for rows ``r < live``; with ``write_act``, also the
    forward's output, recomputed, written over ``grad_out`` (the values :func:`act_forward`
    writes), once the gradients are computed.

    Args:
        grad_pre: ``[rows, ffn]`` or ``[rows, 2 * ffn]`` destination (shape and dtype of pre):
            the gradient of the pre-activation (and of the bias row added to it).
        grad_row: ``[rows]`` destination in the accumulator dtype (float32; float64 for
            float64 data) for the router weight's gradient, or ``None`` to skip it (it needs
            ``row_weight``).
        grad_out: ``[rows, ffn]`` gradient of the forward's output, dtype of pre; with
            ``write_act`` its rows ``< live`` are then overwritten with the forward's output.
        pre, row_weight, live, gated, activation, constants, interleaved, bias, ends: as in
            the forward.
        zero_tail: write zeros into the rows ``>= live`` of grad_pre and grad_row (and of
            grad_out with ``write_act``).
        write_act: also recompute the forward's output into grad_out (NOTE [expert backward
            temporaries] in ``graphstash/moe/mlp.py``).
    """
    act = ExpertActivation.from_constants(activation, constants)
    acc = acc_dtype(pre.dtype)
    ffn = grad_out.shape[1]
    mask = _live_mask(grad_pre.shape[0], live, grad_pre.device)
    g, u = _split(_pre_activation(pre, bias, ends, acc), ffn, gated, interleaved)
    ga = grad_out.to(acc)
    g, g_passes = _clamped_gate(g, act)
    f, df = _kind_terms(g, act, need_grad=True)
    if gated:
        up, dup, u_passes = _up_terms(u, act, need_grad=True)
        a = f * up
    else:
        a = f
    if grad_row is not None:
        _store(grad_row, row_dot(ga, a), mask.squeeze(1), zero_tail)
    if row_weight is not None:
        ga = ga * row_weight.to(acc).unsqueeze(1)
        a = a * row_weight.to(acc).unsqueeze(1)
    zero = torch.zeros((), dtype=acc, device=pre.device)
    grad_u = None
    if gated:
        grad_g = (ga * up) * df
        grad_u = ga * f
        if dup is not None:
            grad_u = grad_u * dup
        if u_passes is not None:
            grad_u = torch.where(u_passes, grad_u, zero)
    else:
        grad_g = ga * df
    if g_passes is not None:
        grad_g = torch.where(g_passes, grad_g, zero)
    # every value is computed before anything is stored: grad_pre may be pre, and ga a view
    # of grad_out (float32 data)
    _store(grad_pre, _join(grad_g, grad_u, interleaved), mask, zero_tail)
    if write_act:
        _store(grad_out, a, mask, zero_tail)
