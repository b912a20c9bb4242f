"""graphstash: a CUDA-graph-first GPU memory runtime for PyTorch training.

Importing graphstash touches no GPU and compiles nothing; kernels compile on first use or
in :func:`warmup`. Nothing heavy is imported with it (NOTE [import time]): ``graphstash.moe``
and ``graphstash.stash`` (with the names it gives, ``StashConfig`` ...) are imported on first
use.
"""
from __future__ import annotations

from .errors import (BackendUnavailableError, CaptureError, ExchangeError,
                     GraphstashError,
                     OverBudgetError, PoolExhaustedError, ReleasedError,
                     SavedTensorModifiedError, SavedTensorsError, StaleHandleError,
                     StashOverflowError, UpdateAppliedError)
from . import memory, status
from ._mode import dropless, is_dropless
from .graph import GraphStep, GraphStepStats, graph_step
from .offload import ActivationOffloader, HostPool
from .paging import PagedStashBuffer, PagedTensor
from .status import StepStatus, new_status
from . import swap
from ._saved import mark_not_movable
from .swap import TensorSwapper, default_swapper, swap_activations

__version__ = "0.1.0"       # the one place it is written: pyproject.toml reads it

# NOTE [import time]: ``import graphstash`` costs little over ``import torch`` (docs/checks.md
# has the figures and the command): nothing it imports loads ``torch._dynamo``, CuPy or Triton.
# Two subpackages do, at their own import: ``graphstash.moe`` marks its grouped-GEMM support for
# torch.compile and ``graphstash.stash`` its context's entry and exit (NOTE [untraced
# machinery]) with torch's decorators, which import dynamo. So they, and the public names
# ``graphstash.stash`` gives, are imported when first named: ``graphstash.StashConfig``,
# ``from graphstash import stash_activations``, ``import graphstash.moe`` all work as before.
# tests/test_imports.py checks, in a fresh process, that ``import graphstash`` leaves
# ``torch._dynamo``, CuPy and Triton unimported.
_LAZY = {"moe": ("moe", None), "stash": ("stash", None),
         "StashConfig": ("stash", "StashConfig"), "StashManager": ("stash", "StashManager"),
         "current_manager": ("stash", "current_manager"),
         "stash_activations": ("stash", "stash_activations")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    value = importlib.import_module(f"{__name__}.{module}")
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


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
