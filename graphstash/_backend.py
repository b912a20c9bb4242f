"""Choosing between the CuPy kernels and the pure-torch reference backend."""
from __future__ import annotations

import torch

from . import _kernels
from .errors import BackendUnavailableError

BACKENDS = ("auto", "cupy", "reference")


def resolve(backend: str, device: torch.device) -> tuple[str, str]:
    """Return ``(backend, reason)`` for tensors on ``device``.

    ``"auto"`` picks ``"cupy"`` for CUDA devices when the CuPy kernels can run, and
    ``"reference"`` otherwise; ``"cupy"`` raises BackendUnavailableError if it cannot run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if device.type != "cuda":
        if backend == "cupy":
            raise ValueError(f"backend: 'cupy' needs a CUDA device, got device={device}")
        return "reference", f"tensors live on {device.type}"
    if backend == "reference":
        return "reference", "requested"
    ok, why = _kernels.availability()
    if ok:
        return "cupy", why
    if backend == "cupy":
        raise BackendUnavailableError(f"backend='cupy' cannot run: {why}")
    return "reference", f"CuPy kernels unavailable ({why})"
