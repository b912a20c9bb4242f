"""Launchers of the fused, count-aware expert activation kernels (``raw_kernels/moe_experts.cu``).

Same contracts as :mod:`graphstash.reference.experts` (the oracle): every function writes into
caller-allocated outputs on torch's current stream, reads the live row count on the device,
reads nothing back to the host and allocates nothing. Each is the operator
``torch.ops.graphstash.<name>`` (NOTE [kernels as operators] in ``_library.py``), with the
reference as its CPU kernel.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from raw_kernels import int_defines

from ..reference import experts as _reference
from ..reference.activation import KINDS, ExpertActivation
from . import THREADS, launch, ptr, register_source
from ._library import kernel_op

_SOURCE = "moe_experts.cu"
_DTYPES = {torch.bfloat16: ("bf16", 2), torch.float16: ("f16", 2), torch.float32: ("f32", 4),
           torch.float64: ("f64", 8)}     # name in the kernel names, element size
_BLOCK = int_defines(_SOURCE)["BLOCK"]    # elements a lane handles together (NOTE [row dot order])
_WARPS = THREADS // 32
# The layouts that have SiLU / SwiGLU kernels (gs_expert_silu_*, NOTE [plain SiLU kernels] in
# moe_experts.cu): plain and gated; interleaved gate and up always take the generic ones.
_SILU_LAYOUTS = (0, 1)
# False: every call runs the generic kernels (gs_expert_act_*), SiLU included; only the tests
# that compare the two set it.
PLAIN_SILU = True

register_source(
    "moe_experts", _SOURCE,
    tuple(f"gs_expert_act_{way}_{name}_g{g}_v{elements * size}" for way in ("fwd", "bwd")
          for name, size in _DTYPES.values() for g in (0, 1, 2) for elements in (_BLOCK, 1))
    + tuple(f"gs_expert_silu_{way}_{name}_g{g}_v{elements * size}" for way in ("fwd", "bwd")
            for name, size in _DTYPES.values() for g in _SILU_LAYOUTS
            for elements in (_BLOCK, 1)))


def _is_plain_silu(act: ExpertActivation, layout: int, bias: torch.Tensor | None) -> bool:
    """Whether the SiLU / SwiGLU kernels compute ``act`` (NOTE [plain SiLU kernels]): SiLU with
    no clamp (both limits infinite), no softcap or offset on up, no bias, not interleaved.
    Their results then equal the generic kernels' bit for bit."""
    return (PLAIN_SILU and layout in _SILU_LAYOUTS and bias is None and act.kind == "silu"
            and act.gate_limit == math.inf and act.up_limit == math.inf and act.up_cap == 0
            and act.up_offset == 0)


def _variant(way: str, pre: torch.Tensor, gated: bool, interleaved: bool, ffn: int,
             act: ExpertActivation, bias: torch.Tensor | None, *tensors) -> str:
    """Kernel name (NOTE [kernel names] in ``raw_kernels/__init__.py``): packs of ``_BLOCK``
    elements when the row width and every base address allow them, else element by element;
    ``_g0`` plain, ``_g1`` gated, ``_g2`` gated with interleaved gate and up;
    ``gs_expert_silu_*`` where :func:`_is_plain_silu` holds, else ``gs_expert_act_*``."""
    name, size = _DTYPES[pre.dtype]
    pack = _BLOCK * size
    vec = ffn % _BLOCK == 0 and all(t.data_ptr() % pack == 0 for t in (pre, bias, *tensors)
                                    if t is not None)
    layout = 2 if gated and interleaved else int(gated)
    op = "silu" if _is_plain_silu(act, layout, bias) else "act"
    return f"gs_expert_{op}_{way}_{name}_g{layout}_v{pack if vec else size}"


def _activation_args(act: ExpertActivation, bias, ends) -> tuple:
    """The kernels' activation arguments (the SiLU / SwiGLU kernels take and ignore them): kind
    id, six constants (double), bias, ends, E."""
    experts = bias.shape[0] if bias is not None else 0
    return ((np.int32(KINDS.index(act.kind)),) + tuple(np.float64(c) for c in act.constants())
            + (ptr(bias) if bias is not None else np.uint64(0),
               ptr(ends) if bias is not None else np.uint64(0), np.int32(experts)))


def _check_live(live: torch.Tensor) -> None:
    if live.dtype != torch.int64 or live.numel() != 1:
        raise ValueError(f"live: expected an int64 tensor of one element, got {live.dtype} "
                         f"{tuple(live.shape)}")


def _act_forward(out: torch.Tensor, pre: torch.Tensor, row_weight: torch.Tensor | None,
                 live: torch.Tensor, *, gated: bool, activation: str = "silu",
                 zero_tail: bool = False, constants: list[float] | None = None,
                 interleaved: bool = False, bias: torch.Tensor | None = None,
                 ends: torch.Tensor | None = None) -> None:
    """Launch ``gs_expert_act_fwd_*`` or ``gs_expert_silu_fwd_*`` (arguments as
    :func:`graphstash.reference.experts.act_forward`; ``live`` is int64 ``[1]``; every tensor
    contiguous, on one device)."""
    rows, ffn = out.shape
    if rows == 0 or ffn == 0:
        return
    _check_live(live)
    act = ExpertActivation.from_constants(activation, constants).check()
    name = _variant("fwd", pre, gated, interleaved, ffn, act, bias, out)
    wptr = ptr(row_weight) if row_weight is not None else np.uint64(0)
    args = (ptr(out), ptr(pre), wptr, ptr(live), np.int64(rows), np.int64(ffn),
            np.int32(bool(zero_tail))) + _activation_args(act, bias, ends)
    launch("moe_experts", name, -(-rows // _WARPS), out.device.index, args)


def _act_backward(grad_pre: torch.Tensor, grad_row: torch.Tensor | None,
                  grad_out: torch.Tensor, pre: torch.Tensor, row_weight: torch.Tensor | None,
                  live: torch.Tensor, *, gated: bool, activation: str = "silu",
                  zero_tail: bool = False, write_act: bool = False,
                  constants: list[float] | None = None, interleaved: bool = False,
                  bias: torch.Tensor | None = None, ends: torch.Tensor | None = None) -> None:
    """Launch ``gs_expert_act_bwd_*`` or ``gs_expert_silu_bwd_*`` (arguments as
    :func:`graphstash.reference.experts.act_backward`; ``live`` is int64 ``[1]``; with
    ``write_act`` the kernel writes the forward's output over ``grad_out``)."""
    rows, ffn = grad_out.shape
    if rows == 0 or ffn == 0:
        return
    _check_live(live)
    act = ExpertActivation.from_constants(activation, constants).check()
    name = _variant("bwd", pre, gated, interleaved, ffn, act, bias, grad_pre, grad_out)
    wptr = ptr(row_weight) if row_weight is not None else np.uint64(0)
    rptr = ptr(grad_row) if grad_row is not None else np.uint64(0)
    aptr = ptr(grad_out) if write_act else np.uint64(0)
    args = (ptr(grad_pre), rptr, aptr, ptr(grad_out), ptr(pre), wptr, ptr(live),
            np.int64(rows), np.int64(ffn), np.int32(bool(zero_tail))) + _activation_args(
                act, bias, ends)
    launch("moe_experts", name, -(-rows // _WARPS), grad_pre.device.index, args)


act_forward = kernel_op("act_forward", _act_forward, mutates_args=("out",),
                        cpu=_reference.act_forward)
act_backward = kernel_op("act_backward", _act_backward,
                         mutates_args=("grad_pre", "grad_row", "grad_out"),
                         cpu=_reference.act_backward)
