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

Within the exchange, ``exchange_ms`` gives each kind of exchange kernel its milliseconds per
step (:func:`exchange_kernel`: the push, the barriers, the counts, the map, the flags, NCCL's,
NVSHMEM's), so a step's exchange time splits into moving rows and waiting for the peers (a
barrier's time is mostly its wait).

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
# the kinds of exchange kernel, by a piece of their name (first match)
_EXCHANGE_KINDS = (("gs_xchg_push", "push"), ("gs_xchg_barrier", "barrier"),
                   ("gs_xchg_counts", "counts"), ("gs_xchg_map", "map"),
                   ("gs_xchg_flags", "flags"), ("nccl", "nccl"), ("nvshmem", "nvshmem"))
EXCHANGE_KERNELS = tuple(kind for _, kind in _EXCHANGE_KINDS) + ("other",)


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


def exchange_kernel(name: str) -> str | None:
    """The kind of exchange kernel (one of :data:`EXCHANGE_KERNELS`) the CUDA kernel called
    ``name`` is, or None when it is not in the ``exchange`` group."""
    if kernel_group(name) != "exchange":
        return None
    low = name.lower()
    for key, kind in _EXCHANGE_KINDS:
        if key in low:
            return kind
    return "other"


def shares(kernels: Iterable[tuple[str, float]], steps: int) -> dict:
    """Figures of ``steps`` profiled steps from ``(kernel name, device microseconds)`` pairs:
    ``{"kernel_ms_per_step", "kernels_per_step", "shares": {group: fraction of the summed
    kernel time}, "exchange_ms": {kind: ms per step}}``; ``shares`` is None when no kernel was
    recorded; ``exchange_ms`` has the kinds of :data:`EXCHANGE_KERNELS` that ran, in that
    order."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected a positive int, got {steps!r}")
    total = {group: 0.0 for group in GROUPS}
    exchange: dict[str, float] = {}
    count = 0
    for name, us in kernels:
        total[kernel_group(name)] += float(us)
        kind = exchange_kernel(name)
        if kind is not None:
            exchange[kind] = exchange.get(kind, 0.0) + float(us)
        count += 1
    summed = sum(total.values())
    return {"kernel_ms_per_step": summed / 1e3 / steps, "kernels_per_step": count / steps,
            "shares": {g: t / summed for g, t in total.items()} if summed > 0 else None,
            "exchange_ms": {k: exchange[k] / 1e3 / steps for k in EXCHANGE_KERNELS
                            if k in exchange}}


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
