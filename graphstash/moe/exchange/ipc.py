"""CUDA IPC transport: several processes on one GPU (or on GPUs with peer access) write into
each other's regions through addresses opened from CUDA IPC handles.

NOTE [exchange over CUDA IPC]: torch symmetric memory and NCCL refuse two ranks on one device
(measured on an H200: "detected allocations from overlapping devices from different ranks",
"Duplicate GPU detected"), but a region allocated by torch in one process can be opened in the
others by its IPC handle (``torch.multiprocessing``'s CUDA tensor sharing), and their kernels
write into it, eagerly and from a replayed CUDA graph. The handles travel over a CPU process
group (gloo) with ``all_gather_object``; each rank opens every other rank's region, builds the
table, and all ranks meet at a host barrier before any signal is raised, so no kernel writes
into a region its owner has not zeroed yet. A region is freed only after every rank dropped
its mapping (the host barrier of :meth:`~graphstash.moe.exchange.Transport.close`).
"""
from __future__ import annotations

import torch

from . import layout as X
from ..._checks import forbid_capture, normalize_device
from .transport import DEFAULT_TIMEOUT_S, PeerTransport, build_table, check_sizes


def build_ipc_transport(group=None, *, capacity_rows: int, row_bytes: int, max_experts: int,
                        device=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> PeerTransport:
    """This rank's transport over CUDA IPC (NOTE [exchange over CUDA IPC]); a collective.

    Args:
        group: a ``torch.distributed`` process group whose ``all_gather_object`` works
            (gloo), or None for the world.
        capacity_rows: rows one exchange can receive at once: at least the dispatch budget
            and each rank's ``tokens x topk`` (the combine sends every pair back). A
            worst-case exchange passes ``world_size x tokens x topk``.
        row_bytes: bytes of the widest row exchanged (``hidden x element size``).
        max_experts: most experts (over all ranks) of one dispatch.
        device: the CUDA device of this rank (default: the current one).
        timeout_s: how long a rank waits for a peer's signal before it records a failure.

    Example (two processes on GPU 0, each after ``dist.init_process_group("gloo", ...)``)::

        transport = build_ipc_transport(capacity_rows=budget, row_bytes=hidden * 2,
                                        max_experts=num_experts, device="cuda:0")
        permuted, counts, handle = dispatch(x, idx, w, num_experts, budget=budget,
                                            exchange=transport)
    """
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    forbid_capture("build_ipc_transport()")
    check_sizes(capacity_rows, row_bytes, max_experts, timeout_s)
    device = normalize_device(device)
    if device.type != "cuda":
        raise ValueError(f"device: the IPC transport needs a CUDA device, got {device}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; call "
                         "init_process_group('gloo', ...) first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = X.RegionLayout(world, capacity_rows, row_bytes, max_experts)
    region = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    shared = reduce_tensor(region)                 # (rebuild function, its arguments)
    handles = [None] * world
    dist.all_gather_object(handles, shared, group=group)
    peers = [region if p == rank else rebuild(*args) for p, (rebuild, args) in enumerate(handles)]
    table = build_table(layout, [t.data_ptr() for t in peers], device)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)

    def close() -> None:
        peers.clear()
        dist.barrier(group=group)       # every mapping of this region is gone: free it

    return PeerTransport(kind="ipc", rank=rank, world_size=world, layout=layout, region=region,
                         table=table, timeout_s=timeout_s, group=group, keep=peers,
                         on_close=close)
