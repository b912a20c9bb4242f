"""What runs here: whether the CuPy kernels can run, which backend a device gets, and the
kernel tunables in force. The public face of ``_kernels`` and ``_backend`` for tools and users
(``graphstash info`` prints it); nothing here compiles or touches the GPU except
:func:`resident_blocks`.
"""
from __future__ import annotations

import torch

from . import _backend, _kernels

__all__ = ["backend_for", "kernel_tunables", "kernels_available", "resident_blocks"]


def kernels_available() -> tuple[bool, str]:
    """``(ok, why)``: whether the CuPy kernels can run in this process, and why (not)."""
    return _kernels.availability()


def backend_for(device) -> tuple[str, str]:
    """``(backend, why)``: ``"cupy"`` or ``"reference"`` for tensors on ``device`` (a
    ``torch.device`` or string), as ``backend="auto"`` resolves it."""
    return _backend.resolve("auto", torch.device(device))


def kernel_tunables() -> dict[str, int]:
    """The tunables every launch uses (threads per block, unroll, min blocks, streaming
    stores), as the loader passes them to the sources."""
    return {name.lower(): getattr(_kernels, name) for name in _kernels.TUNABLES}


def resident_blocks(device, source: str, kernel: str) -> int:
    """Blocks of ``kernel`` (in ``raw_kernels/<source>.cu``) that fit on the CUDA ``device``
    at once: its persistent grid. Compiles the source for the device if needed."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _kernels.resident_blocks(index, source, kernel)
