"""Symmetric-memory transport: one rank per GPU of a node, the regions allocated by torch
symmetric memory (CUDA backend) and mapped into every rank.

NOTE [exchange over symmetric memory]: ``symm_mem.empty`` allocates the region and
``symm_mem.rendezvous(region, group)`` maps every rank's region into every rank; the handle's
``buffer_ptrs`` are the bases of the peers' allocations, so the table holds ``buffer_ptrs[p] +
(region.data_ptr() - buffer_ptrs[rank])`` (the region may sit at an offset inside its
allocation). Both happen before any capture, as PyTorch's contract for symmetric memory asks.
NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless the caller set it):
nothing here uses multimem. The signal pad is not used: signals, flags and counts live in
the region (``graphstash/moe/exchange/layout.py``), so every transport shares one layout. Torch
refuses two ranks on one device here ("detected allocations from overlapping devices"):
processes sharing a GPU take :func:`~graphstash.moe.exchange.build_ipc_transport`.
"""
from __future__ import annotations

import os

import torch

from . import layout as X
from ..._checks import forbid_capture, normalize_device
from ...errors import ExchangeError
from .transport import DEFAULT_TIMEOUT_S, PeerTransport, build_table, check_sizes


def peer_bases(handle, region: torch.Tensor) -> list[int]:
    """Every rank's address of ``region`` from its symmetric-memory ``handle`` (NOTE [exchange
    over symmetric memory]); ExchangeError if the region is not inside the handle's buffer."""
    bases = list(handle.buffer_ptrs)
    offset = region.data_ptr() - bases[handle.rank]
    size = getattr(handle, "buffer_size", None)
    if offset < 0 or (size is not None and offset + region.numel() > size):
        raise ExchangeError(f"symmetric memory: the region at {region.data_ptr():#x} is not "
                            f"inside this rank's buffer at {bases[handle.rank]:#x} "
                            f"({size} bytes)")
    return [base + offset for base in bases]


def build_symmetric_transport(group=None, *, capacity_rows: int, row_bytes: int,
                              max_experts: int, device=None,
                              timeout_s: float = DEFAULT_TIMEOUT_S) -> PeerTransport:
    """This rank's transport over torch symmetric memory (NOTE [exchange over symmetric
    memory]); a collective of ``group`` (one rank per GPU, e.g. an NCCL group).

    Args:
        group: the ``torch.distributed`` process group (default: the world).
        capacity_rows, row_bytes, max_experts, timeout_s: as for
            :func:`~graphstash.moe.exchange.build_ipc_transport`.
        device: this rank's CUDA device (default: the current one).

    Run :meth:`~graphstash.moe.exchange.Transport.self_test` once after building it on a new
    machine: every rank writes a row into every rank and checks what arrived. Example::

        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        transport = build_symmetric_transport(capacity_rows=budget, row_bytes=hidden * 2,
                                              max_experts=num_experts)
        transport.self_test()
    """
    import torch.distributed as dist

    forbid_capture("build_symmetric_transport()")
    check_sizes(capacity_rows, row_bytes, max_experts, timeout_s)
    device = normalize_device(device)
    if device.type != "cuda":
        raise ValueError(f"device: symmetric memory needs a CUDA device, got {device}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; call "
                         "init_process_group(...) first")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed._symmetric_memory as symm_mem

    try:
        if symm_mem.get_backend(device) is None:
            symm_mem.set_backend("CUDA")
    except (AttributeError, RuntimeError):
        pass                                    # an older torch, or a backend already chosen
    if group is None:
        group = dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = X.RegionLayout(world, capacity_rows, row_bytes, max_experts)
    region = symm_mem.empty(layout.nbytes, dtype=torch.uint8, device=device)
    region.zero_()
    handle = symm_mem.rendezvous(region, group)
    if handle.world_size != world or handle.rank != rank:
        raise ExchangeError(f"symmetric memory: the handle says rank {handle.rank} of "
                            f"{handle.world_size}, the group rank {rank} of {world}")
    table = build_table(layout, peer_bases(handle, region), device)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)                   # every region zeroed before any signal

    def close() -> None:
        dist.barrier(group=group)

    return PeerTransport(kind="symmetric", rank=rank, world_size=world, layout=layout,
                         region=region, table=table, timeout_s=timeout_s, group=group,
                         keep=[handle], on_close=close)
