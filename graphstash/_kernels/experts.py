"""Launchers of the fused, count-aware expert activation kernels (``raw_kernels/moe_experts.cu``).

Same contracts as :mod:`graphstash.reference.experts` (the oracle): every function writes into
caller-allocated outputs on torch's current stream, reads the live row count on the device,
reads nothing back to the host and allocates nothing. Each is the operator
``torch.ops.graphstash.<name>`` (NOTE [kernels as operators] in ``_library.py``), with the
reference as its CPU kernel.
"""
from __future__ import annotations

import numpy as np
import torch

from ..reference import experts as _reference
from . import THREADS, launch, ptr, register_source
from ._library import kernel_op

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
                torch.float64: "f64"}
_BLOCK = 8                 # elements per lane step (NOTE [row dot order])
_WARPS = THREADS // 32

register_source(
    "moe_experts", "moe_experts.cu",
    tuple(f"gs_expert_act_{way}_{n}_g{g}_v{v}" for way in ("fwd", "bwd") for n in
          _DTYPE_NAMES.values() for g in (0, 1) for v in (0, 1)))


def _variant(way: str, pre: torch.Tensor, gated: bool, ffn: int, *tensors) -> str:
    """Kernel name: 8-element packs when the row width and every base address allow them."""
    align = _BLOCK * pre.element_size()
    vec = ffn % _BLOCK == 0 and all(t.data_ptr() % align == 0 for t in (pre, *tensors))
    return f"gs_expert_act_{way}_{_DTYPE_NAMES[pre.dtype]}_g{int(gated)}_v{int(vec)}"


def _check_live(live: torch.Tensor) -> None:
    if live.dtype != torch.int64 or live.numel() != 1:
        raise ValueError(f"live: expected an int64 tensor of one element, got {live.dtype} "
                         f"{tuple(live.shape)}")


def _act_forward(out: torch.Tensor, pre: torch.Tensor, row_weight: torch.Tensor | None,
                 live: torch.Tensor, *, gated: bool, activation: str = "silu",
                 zero_tail: bool = False) -> None:
    """Launch ``gs_expert_act_fwd_*`` (arguments as :func:`graphstash.reference.experts.act_forward`;
    ``live`` is int64 ``[1]``; every tensor contiguous, on one device)."""
    rows, ffn = out.shape
    if rows == 0 or ffn == 0:
        return
    _check_live(live)
    name = _variant("fwd", pre, gated, ffn, out)
    wptr = ptr(row_weight) if row_weight is not None else np.uint64(0)
    args = (ptr(out), ptr(pre), wptr, ptr(live), np.int64(rows), np.int64(ffn),
            np.int32(bool(zero_tail)))
    launch("moe_experts", name, -(-rows // _WARPS), out.device.index, args)


def _act_backward(grad_pre: torch.Tensor, grad_row: torch.Tensor | None,
                  grad_out: torch.Tensor, pre: torch.Tensor, row_weight: torch.Tensor | None,
                  live: torch.Tensor, *, gated: bool, activation: str = "silu",
                  zero_tail: bool = False) -> None:
    """Launch ``gs_expert_act_bwd_*`` (arguments as
    :func:`graphstash.reference.experts.act_backward`; ``live`` is int64 ``[1]``)."""
    rows, ffn = grad_out.shape
    if rows == 0 or ffn == 0:
        return
    _check_live(live)
    name = _variant("bwd", pre, gated, ffn, grad_pre, grad_out)
    wptr = ptr(row_weight) if row_weight is not None else np.uint64(0)
    rptr = ptr(grad_row) if grad_row is not None else np.uint64(0)
    args = (ptr(grad_pre), rptr, ptr(grad_out), ptr(pre), wptr, ptr(live), np.int64(rows),
            np.int64(ffn), np.int32(bool(zero_tail)))
    launch("moe_experts", name, -(-rows // _WARPS), grad_pre.device.index, args)


act_forward = kernel_op("act_forward", _act_forward, mutates_args=("out",),
                        cpu=_reference.act_forward)
act_backward = kernel_op("act_backward", _act_backward, mutates_args=("grad_pre", "grad_row"),
                         cpu=_reference.act_backward)
