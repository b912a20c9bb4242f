"""Choosing and building the transport of an expert-parallel group."""
from __future__ import annotations

import socket

import torch

from ..._checks import normalize_device
from .transport import DEFAULT_TIMEOUT_S, Transport

KINDS = ("auto", "symmetric", "ipc", "gloo")


def transport_kind(group=None, device=None) -> tuple[str | None, str]:
    """Which transport this group's ranks can build, and why: ``"gloo"`` on the CPU,
    ``"ipc"`` when every rank sits on one GPU, ``"symmetric"`` when each has its own GPU of
    one host, ``None`` otherwise (ranks on several hosts: no peer addresses; the caller keeps
    NCCL chunks). A collective (``all_gather_object`` over ``group``)."""
    import torch.distributed as dist

    device = normalize_device(device)
    if device.type != "cuda":
        return "gloo", "tensors live on the CPU: the exchange runs over gloo"
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index))
    where = [None] * dist.get_world_size(group)
    dist.all_gather_object(where, (socket.gethostname(), uuid), group=group)
    hosts = {h for h, _ in where}
    gpus = [g for _, g in where]
    if len(hosts) > 1:
        return None, f"ranks on {len(hosts)} hosts: no transport by peer addresses"
    if len(set(gpus)) == 1:
        return "ipc", f"{len(gpus)} ranks share one GPU: CUDA IPC between the processes"
    if len(set(gpus)) == len(gpus):
        return "symmetric", f"{len(gpus)} GPUs of one host: torch symmetric memory"
    return None, "some ranks share a GPU and some do not: no transport chosen"


def build_transport(group=None, *, capacity_rows: int, row_bytes: int, max_experts: int,
                    device=None, kind: str = "auto",
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> Transport:
    """Build this rank's transport of ``group`` (a collective); ``kind="auto"`` takes
    :func:`transport_kind`'s choice and raises ValueError when there is none.

    Args:
        group: the ``torch.distributed`` group of the expert-parallel ranks (None: world).
        capacity_rows, row_bytes, max_experts, timeout_s: see
            :func:`~graphstash.moe.exchange.build_ipc_transport`.
        device: this rank's device (CUDA, or the CPU for the gloo reference).
        kind: ``"auto"``, ``"symmetric"``, ``"ipc"`` or ``"gloo"``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if kind == "auto":
        kind, why = transport_kind(group, device)
        if kind is None:
            raise ValueError(f"group: no live-row transport can be built here ({why})")
    sizes = dict(capacity_rows=capacity_rows, row_bytes=row_bytes, max_experts=max_experts,
                 timeout_s=timeout_s)
    if kind == "gloo":
        from .gloo import build_gloo_transport
        return build_gloo_transport(group, **sizes)
    if kind == "ipc":
        from .ipc import build_ipc_transport
        return build_ipc_transport(group, device=device, **sizes)
    from .symmetric import build_symmetric_transport
    return build_symmetric_transport(group, device=device, **sizes)


def describe_exchange() -> str:
    """One line: which expert-parallel exchange a group would run here (no collective, no GPU
    work): the live-row exchange's transport by where the ranks are, or why it cannot run."""
    from ... import _kernels

    if not torch.cuda.is_available():
        return ("live rows over gloo (CPU reference); on GPUs: symmetric memory, one rank per "
                "GPU, or CUDA IPC for ranks sharing one")
    ok, why = _kernels.availability()
    if not ok:
        return f"NCCL fixed chunks (the live-row kernels cannot run: {why})"
    import importlib.util

    symmetric = ("torch symmetric memory"
                 if importlib.util.find_spec("torch.distributed._symmetric_memory") is not None
                 else "NCCL chunks (no symmetric memory in this torch)")
    gpus = torch.cuda.device_count()
    return (f"live rows: one rank per GPU over {symmetric} ({gpus} GPU(s) here), ranks sharing "
            f"a GPU over CUDA IPC; NCCL fixed chunks across hosts")
