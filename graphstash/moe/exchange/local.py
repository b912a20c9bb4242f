"""In-process transports: W ranks inside one process, each table pointing at that process's
own regions (NOTE [exchange transport]).

NOTE [in-process ranks]: processes sharing one GPU take turns on it (time slices): a rank
spinning in a barrier holds the GPU until its slice ends, so every barrier between two
processes costs about one slice, milliseconds against microseconds between two streams of one
process (docs/exchange.md has the measurement; ``benchmarks/probes/exchange_latency.py`` makes
it). Correct, and what the multi-process tests use, but slow. For speed on one GPU the same
kernels run for W ranks in one process, one CUDA stream and one host thread per rank, so their
kernels run side by side. Each rank issues its exchanges from its own thread: a barrier waits
on the device for the other ranks' kernels, which only their threads launch. Three things must
not block a thread's host while an exchange is in flight: a device-wide synchronize
(``torch.cuda.synchronize``, which ``torch.cuda.graph`` calls on entry: capture with
``capture_begin`` on a side stream, or ``graph_step(release_warmup_cache=False)`` as NOTE
[in-process bench ranks] does), and a host read inside backward (autograd runs every
rank's CUDA backward on one device thread, so one rank blocked there stalls the others'
backward, and with it its own exchange): capture the step and replay it, or run experts whose
backward reads nothing back (bf16 on Hopper; an fp32 ``grouped_mm`` copies its offsets to the
host); and a device allocation the caching allocator cannot serve from its cache (each
thread's stream has its own): when ``cudaMalloc`` fails it frees its cached blocks, and
``cudaFree`` waits for the whole device, a peer's spinning barrier included. Once in a GPU
test suite run (15 other test processes on the GPU) rank 1 did not reach the self test's first
barrier in 60 s while rank 0 spun in it; such an allocation is the likely cause, not a proven
one. So a transport makes its self test's tensors when it is built, and a thread should
allocate what it needs before its exchanges start (a captured step allocates nothing).
"""
from __future__ import annotations

import torch

from . import layout as X
from ..._checks import forbid_capture, normalize_device, require_positive_int
from .transport import DEFAULT_TIMEOUT_S, PeerTransport, build_table, check_sizes


def build_local_transports(world_size: int, *, capacity_rows: int, row_bytes: int,
                           max_experts: int, device=None,
                           timeout_s: float = DEFAULT_TIMEOUT_S) -> list[PeerTransport]:
    """``world_size`` transports of one process, rank ``r`` at index ``r``.

    Args:
        world_size: ranks to simulate (each gets its own region).
        capacity_rows, row_bytes, max_experts, timeout_s: as for
            :func:`~graphstash.moe.exchange.build_ipc_transport`.
        device: the CUDA device of every rank (default: the current one).

    Example::

        transports = build_local_transports(2, capacity_rows=4096, row_bytes=2048,
                                            max_experts=8)
        # thread r: with torch.cuda.stream(streams[r]): dispatch(..., exchange=transports[r])
    """
    forbid_capture("build_local_transports()")
    require_positive_int("world_size", world_size)
    check_sizes(capacity_rows, row_bytes, max_experts, timeout_s)
    device = normalize_device(device)
    if device.type != "cuda":
        raise ValueError(f"device: in-process transports need a CUDA device, got {device}")
    layout = X.RegionLayout(world_size, capacity_rows, row_bytes, max_experts)
    regions = [torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
               for _ in range(world_size)]
    table = build_table(layout, [r.data_ptr() for r in regions], device)
    torch.cuda.synchronize(device)
    return [PeerTransport(kind="local", rank=r, world_size=world_size, layout=layout,
                          region=regions[r], table=table.clone(), timeout_s=timeout_s,
                          keep=regions)
            for r in range(world_size)]
