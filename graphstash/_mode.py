"""Process-wide execution mode: whether the current step runs *dropless*.

The graph manager reruns an overflowed step eagerly in dropless mode: MoE dispatch then
sizes its buffers from the real counts (no budget) and stashing steps aside. Lower layers
read the flag through :func:`is_dropless`; nothing here touches the GPU. (Which status the
running step raises its flags in is :func:`graphstash.status.current`, NOTE [current step].)
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
