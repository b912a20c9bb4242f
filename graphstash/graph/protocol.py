"""What :func:`~graphstash.graph_step` drives: the :class:`StepParticipant` protocol.

NOTE [step protocol]: the graph manager knows nothing of the stash's insides. Whatever it
drives through ``graph_step(stash=...)`` (a :class:`~graphstash.StashManager`, or any object
with these methods) takes part in a step like this:

1. ``with participant:`` around the user's step (it is the default of the step's contexts),
   ``begin_step()`` before and ``end_step(check=False)`` after the step function; the graph
   manager reads ``status`` itself, once per step, so the participant must not (a capture
   cannot read the device, and eager steps are checked by the graph manager);
2. ``warmup()`` outside any capture, right before one: size what the eager steps measured,
   compile what the captured step will launch;
3. ``grow(factor)`` after a flagged step was rerun: make room for ``factor`` times more (the
   participant derives a new configuration; it never mutates its caller's);
4. ``peak()`` for ``GraphStepStats``; ``release()`` / ``reallocate()`` with the step's own.

``status`` is the int32 ``[STATUS_SIZE]`` device tensor whose flags (overflow, host spill,
over budget) decide whether a step is trusted (``graphstash/_layout.py``).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StepParticipant(Protocol):
    """The methods :func:`~graphstash.graph_step` calls on what it drives (NOTE [step protocol]).

    Example::

        assert isinstance(graphstash.StashManager(), StepParticipant)
    """

    status: torch.Tensor

    def __enter__(self): ...

    def __exit__(self, *exc): ...

    def begin_step(self) -> None: ...

    def end_step(self, *, check: bool = True) -> None: ...

    def warmup(self) -> None: ...

    def grow(self, factor: float) -> bool: ...

    def peak(self) -> int: ...

    def release(self) -> None: ...

    def reallocate(self) -> None: ...
