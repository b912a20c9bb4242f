"""graphstash: a CUDA-graph-first GPU memory runtime for PyTorch training.

Importing graphstash touches no GPU and compiles nothing; kernels compile on first use or
in :func:`warmup`.
"""
from __future__ import annotations

from .errors import (BackendUnavailableError, CaptureError, ExchangeError,
                     GraphstashError,
                     OverBudgetError, PoolExhaustedError, ReleasedError,
                     SavedTensorModifiedError, SavedTensorsError, StaleHandleError,
                     StashOverflowError, UpdateAppliedError)
from . import memory, moe, status
from ._mode import dropless, is_dropless
from .graph import GraphStep, GraphStepStats, graph_step
from .offload import ActivationOffloader, HostPool
from .paging import PagedStashBuffer, PagedTensor
from .status import StepStatus, new_status
from .stash import StashConfig, StashManager, current_manager, stash_activations
from . import swap
from ._saved import mark_not_movable
from .swap import TensorSwapper, default_swapper, swap_activations

__version__ = "0.1.0"


def warmup(device=None) -> None:
    """Compile every CuPy kernel for ``device`` (default: the current CUDA device).

    Call it before capturing a CUDA graph: compiling while a stream captures raises
    :class:`CaptureError`. Does nothing useful without CUDA and CuPy (raises
    :class:`BackendUnavailableError`).
    """
    from . import _kernels

    ok, why = _kernels.availability()
    if not ok:
        raise BackendUnavailableError(f"graphstash.warmup(): the CuPy kernels cannot run: {why}")
    _kernels.warmup(device)


__all__ = [
    "ActivationOffloader",
    "BackendUnavailableError",
    "CaptureError",
    "ExchangeError",
    "GraphStep",
    "GraphStepStats",
    "GraphstashError",
    "HostPool",
    "OverBudgetError",
    "PagedStashBuffer",
    "PagedTensor",
    "PoolExhaustedError",
    "ReleasedError",
    "SavedTensorModifiedError",
    "SavedTensorsError",
    "StaleHandleError",
    "StashConfig",
    "StashManager",
    "StashOverflowError",
    "StepStatus",
    "TensorSwapper",
    "UpdateAppliedError",
    "current_manager",
    "default_swapper",
    "dropless",
    "graph_step",
    "is_dropless",
    "mark_not_movable",
    "memory",
    "moe",
    "new_status",
    "stash_activations",
    "status",
    "swap",
    "swap_activations",
    "warmup",
    "__version__",
]
