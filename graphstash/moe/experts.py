"""Expert compute over the permuted buffer: a grouped GEMM with device offsets.

``torch._grouped_mm`` where it works for the device and dtype (probed once, eagerly, and
checked against a per-expert loop), otherwise a per-expert loop (eager only: it reads the
counts back) or, while a CUDA graph is being captured, a masked dense product over every
expert (capturable, ``E`` times the work).
"""
from __future__ import annotations

import torch

from .._checks import describe, is_capturing, require_tensor

__all__ = ["grouped_mm"]

_probe_results: dict[tuple, bool] = {}


def _grouped_mm_native(x, weight, offsets):
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


def _loop(x, weight, counts_list):
    pieces, start = [], 0
    for e, n in enumerate(counts_list):
        if n:
            pieces.append(x[start:start + n] @ weight[e].t())
        start += n
    pieces.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
    return torch.cat(pieces)


def _masked_dense(x, weight, tokens_per_expert):
    ends = torch.cumsum(tokens_per_expert.long(), 0)
    starts = ends - tokens_per_expert.long()
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        mask = (rows >= starts[e]) & (rows < ends[e])
        out = out + torch.where(mask, x @ weight[e].t(), torch.zeros((), dtype=x.dtype,
                                                                     device=x.device))
    return out


def _native_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm handles this device/dtype/layout (probed once, eagerly)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    size = x.element_size()
    if (x.shape[1] * size) % 16 or (weight.shape[1] * size) % 16:
        return False
    key = (x.device.type, x.device.index, x.dtype)
    ok = _probe_results.get(key)
    if ok is None:
        if is_capturing():
            return False
        ok = _probe(x.device, x.dtype)
        _probe_results[key] = ok
    return ok


def _probe(device, dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(24, 16, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    ws = torch.randn(3, 32, 16, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    counts = [8, 0, 16]
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    try:
        y = _grouped_mm_native(xs, ws, offsets)
        g = torch.ones_like(y)
        gx, gw = torch.autograd.grad(y, (xs, ws), g)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    xr = xs.detach().clone().requires_grad_()
    wr = ws.detach().clone().requires_grad_()
    yr = _loop(xr, wr, counts)
    gxr, gwr = torch.autograd.grad(yr, (xr, wr), g)
    tol = dict(rtol=5e-2, atol=5e-2)
    return (torch.allclose(y.float(), yr.float(), **tol) and torch.allclose(gx.float(), gxr.float(), **tol)
            and torch.allclose(gw.float(), gwr.float(), **tol))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
               *, impl: str = "auto") -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ weight[e].T`` for consecutive row groups.

    Args:
        x: ``[rows, in]`` permuted tokens (the dispatch output), any float dtype.
        weight: ``[num_local_experts, out, in]`` expert weights, dtype and device of x.
        tokens_per_expert: int32/int64 ``[num_local_experts]`` rows of each expert, on x's
            device; their sum is at most ``rows``. Rows past the sum are not computed
            (their values are unspecified).
        impl: ``"auto"``, ``"grouped"`` (torch._grouped_mm), ``"loop"`` (eager, reads the
            counts back) or ``"masked"`` (capturable dense fallback).
    Returns ``[rows, out]``; differentiable in x and weight.
    """
    require_tensor("x", x, "a 2-D floating tensor")
    require_tensor("weight", weight, "a 3-D floating tensor")
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"weight: expected [experts, out, {x.shape[1] if x.dim() == 2 else 'in'}]"
                         f" for x {tuple(x.shape)}, got {describe(weight)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"weight: expected dtype {x.dtype} on {x.device}, got {describe(weight)}")
    require_tensor("tokens_per_expert", tokens_per_expert, "an int tensor")
    if tuple(tokens_per_expert.shape) != (weight.shape[0],):
        raise ValueError(f"tokens_per_expert: expected shape ({weight.shape[0]},), got "
                         f"{describe(tokens_per_expert)}")
    if impl == "auto":
        impl = "grouped" if _native_ok(x, weight) else ("masked" if is_capturing() else "loop")
    if impl == "grouped":
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        return _grouped_mm_native(x, weight, offsets)
    if impl == "masked":
        return _masked_dense(x, weight, tokens_per_expert)
    if impl == "loop":
        if is_capturing():
            from ..errors import CaptureError

            raise CaptureError("grouped_mm(impl='loop') reads the expert counts back to the "
                               "host and cannot run while a CUDA graph is being captured")
        return _loop(x, weight, [int(n) for n in tokens_per_expert.tolist()])
    raise ValueError(f"impl: expected 'auto', 'grouped', 'loop' or 'masked', got {impl!r}")
