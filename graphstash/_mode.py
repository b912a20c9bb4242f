"""Process-wide execution mode: whether the current step runs *dropless*, and the status
tensor of the training step that is running.

The graph manager reruns an overflowed step eagerly in dropless mode: MoE dispatch then
sizes its buffers from the real counts (no budget) and stashing steps aside. Lower layers
read the flag through :func:`is_dropless`, and the running step's status through
:func:`current_step_status` (NOTE [current step]); nothing here touches the GPU.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def is_dropless() -> bool:
    """True while the current step runs dropless (eager, no static budgets, no stashing)."""
    return getattr(_state, "dropless", False)


@contextlib.contextmanager
def dropless(enabled: bool = True):
    """Run the enclosed code in dropless mode (or, with ``enabled=False``, explicitly not)."""
    previous = is_dropless()
    _state.dropless = bool(enabled)
    try:
        yield
    finally:
        _state.dropless = previous


# NOTE [current step]
# While a graph_step runs its function (warmup, capture, the eager rerun), the step's int32
# status tensor is "current" for the thread. Code that raises device flags and was given no
# status (MoE dispatch's default, see graphstash.moe.default_status) takes it from here, so
# an over-budget dispatch reaches the step that must rerun without the user passing
# ``status=step.status`` through their model. Steps may nest; the innermost one wins.


def current_step_status(device=None):
    """The status tensor of the innermost running training step (NOTE [current step]), or
    None when no step runs or (with ``device``) when that step's status is on another device."""
    stack = getattr(_state, "step_status", None)
    if not stack:
        return None
    status = stack[-1]
    if device is not None and status.device != device:
        return None
    return status


@contextlib.contextmanager
def step_status(status):
    """Make ``status`` (an int32 ``[8]`` tensor) the running step's status inside the block."""
    stack = getattr(_state, "step_status", None)
    if stack is None:
        stack = _state.step_status = []
    stack.append(status)
    try:
        yield
    finally:
        stack.pop()
