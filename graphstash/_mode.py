"""Process-wide execution mode: whether the current step runs *dropless*.

The graph manager reruns an overflowed step eagerly in dropless mode: MoE dispatch then
sizes its buffers from the real counts (no budget) and stashing steps aside. Lower layers
read the flag through :func:`is_dropless`; nothing here touches the GPU. (Which status the
running step raises its flags in is :func:`graphstash.status.current`, NOTE [current step].)
"""
from __future__ import annotations

import contextlib
import threading

# NOTE [state read by traced code]
# MoE dispatch, the experts and the stash read thread-local state (dropless mode here, the
# current status in graphstash/status.py, the current stash manager in stash/manager.py), and
# so does the code torch.compile traces through them: dynamo turns every read into a guard on
# the value read, and a compiled function recompiles when a guard fails. graph_step must never
# let that happen inside a capture (NOTE [compile and capture] in graphstash/graph/
# compile_guard.py), so what traced code reads is the same in a warmup step and in the
# captured step: not dropless, the step's own status and stash manager current. Every such
# attribute exists from a thread's first access, with a fixed type (a bool, a list), so the
# guards are on values only; an attribute created on first use puts a ``hasattr`` guard on the
# traced code that flips after the first call (measured on the stash manager's stack: a
# recompile at the second call). A model compiled outside any step recompiles once at its
# first step (no step is current there): in a warmup call, where compiles belong.


class _ModeState(threading.local):
    """This thread's mode: ``dropless``, present from the first access (NOTE [state read by
    traced code])."""

    def __init__(self):
        self.dropless = False


_state = _ModeState()


def is_dropless() -> bool:
    """True while the current step runs dropless (eager, no static budgets, no stashing)."""
    return _state.dropless


@contextlib.contextmanager
def dropless(enabled: bool = True):
    """Run the enclosed code in dropless mode (or, with ``enabled=False``, explicitly not)."""
    previous = is_dropless()
    _state.dropless = bool(enabled)
    try:
        yield
    finally:
        _state.dropless = previous
