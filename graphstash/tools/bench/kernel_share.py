"""Where a training step's GPU time goes: kernel time from ``torch.profiler``, by kind of kernel.

``graphstash bench moe --profile`` profiles a few calls of each mode's step (graph replays
for the graphed modes: the profiler records the kernels a graph launches), and with ``--ep``
each rank's calls of each row, and prints the share of the summed kernel time in each group of
:data:`GROUPS`, told apart by kernel name (:func:`kernel_group`):

- ``exchange``: moving rows between expert-parallel ranks: graphstash's live-row exchange
  kernels (``gs_xchg_*`` of ``raw_kernels/moe_exchange.cu``: barrier, counts, map, push,
  flags), NCCL's (``ncclDevKernel_*``: the peers' ``all_to_all_single``, NCCL chunks) and
  NVSHMEM's;
- ``grouped GEMM``: the expert GEMMs. ``torch._grouped_mm``'s CUTLASS kernels (their names
  carry ``GroupProblemShape`` or ``PtrArray``), graphstash's Triton grouped GEMM
  (``grouped_rows``, ``grouped_weight_grad``), anything else named ``grouped``;
- ``other GEMM``: dense products (router, attention, output layer): cuBLAS kernels
  (``gemm``, ``nvjet``, ``xmma``), CUTLASS dense kernels;
- ``optimizer``: fused Adam (``FusedAdamMathFunctor``) and the other ``multi_tensor_apply``
  kernels (the step counters' increments); ``multi_tensor_apply`` copies
  (``_foreach_copy_``: graph_step staging the batch) count as ``rest``;
- ``rest``: everything else (dispatch, combine, activations, norms, copies, memsets).

Shares are of the summed kernel time, not of the step's wall time: kernels of side streams
that overlap count in full, idle gaps not at all; ``kernel_ms_per_step`` beside the step time
shows how much of the step the kernels fill.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

GROUPS = ("exchange", "grouped GEMM", "other GEMM", "optimizer", "rest")
_EXCHANGE = ("gs_xchg", "gs_exchange", "nccl", "nvshmem")
_GROUPED = ("groupproblemshape", "ptrarray", "grouped")
_DENSE = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")


def kernel_group(name: str) -> str:
    """The group of :data:`GROUPS` of the CUDA kernel called ``name`` (as the profiler names
    it: demangled C++ or a Triton kernel's name)."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a kernel name (str), got {type(name).__name__}")
    low = name.lower()
    if any(key in low for key in _EXCHANGE):
        return "exchange"
    if "adam" in low or ("multi_tensor_apply" in low and "copy" not in low):
        return "optimizer"
    if any(key in low for key in _GROUPED):
        return "grouped GEMM"
    if any(key in low for key in _DENSE):
        return "other GEMM"
    return "rest"


def shares(kernels: Iterable[tuple[str, float]], steps: int) -> dict:
    """Figures of ``steps`` profiled steps from ``(kernel name, device microseconds)`` pairs:
    ``{"kernel_ms_per_step", "kernels_per_step", "shares": {group: fraction of the summed
    kernel time}}``; ``shares`` is None when no kernel was recorded."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    total = {group: 0.0 for group in GROUPS}
    count = 0
    for name, us in kernels:
        total[kernel_group(name)] += float(us)
        count += 1
    summed = sum(total.values())
    return {"kernel_ms_per_step": summed / 1e3 / steps, "kernels_per_step": count / steps,
            "shares": {g: t / summed for g, t in total.items()} if summed > 0 else None}


def profile_steps(fn: Callable[[], object], steps: int = 3) -> dict:
    """:func:`shares` of ``steps`` calls of ``fn`` (one training step each, on the current
    CUDA device) under ``torch.profiler``; the device is synchronised before and after."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return shares(((evt.name, evt.device_time) for evt in prof.events()
                   if evt.device_type == DeviceType.CUDA), steps)
