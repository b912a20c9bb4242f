"""Side streams forked from and joined to the compute stream, across the capture boundary.

NOTE [side streams]: all compute runs on torch's *current* stream; copies run on side
streams. Every cross-stream dependency is a stream wait or an event, so the same code runs
eagerly and inside a CUDA graph capture (waits and events recorded in a capture become graph
edges):
  * fork: the side stream waits for the compute stream before each use (:meth:`SideStream.fork`),
    so it sees the tensors the compute stream produced and memory it freed;
  * mark: after queueing copies the side stream records an event (:class:`Mark`), noting
    whether it was recorded inside a capture;
  * wait: the compute stream waits on a mark before it reads the copy or drops its source;
  * join: before a capture ends (and at step boundaries) the compute stream waits on the last
    mark of each side stream (:meth:`SideStream.join`).
An event recorded on one side of a capture boundary is never waited on on the other: a
capture cannot wait on eager work (and need not: the capture starts after a synchronize), and
eager work cannot wait on a node of a graph that has not replayed. On a CPU device every call
is a no-op: the copies are synchronous.
"""
from __future__ import annotations

import contextlib

import torch

from .._checks import forbid_capture, is_capturing


class Mark:
    """An event recorded on a side stream after some copies, and on which side of a capture."""

    __slots__ = ("event", "captured")

    def __init__(self, event, captured: bool):
        self.event = event
        self.captured = captured


class SideStream:
    """One side stream of ``device`` (created on first use), its fork, marks and join.

    Args:
        device: the device (``torch.device``); on a CPU device every method is a no-op.
        name: label in error messages ("pack", "d2h").

    Example::

        side = SideStream(device, "d2h")
        with side.fork():
            host.copy_(x, non_blocking=True)
        mark = side.mark()
        ...
        side.wait(mark)                 # before x is dropped
    """

    def __init__(self, device: torch.device, name: str):
        self.device = device
        self.name = name
        self.active = device.type == "cuda"
        self._stream = None
        self._tail: Mark | None = None       # last mark not waited on yet

    @property
    def stream(self):
        """The CUDA stream (``None`` on the CPU); created outside a capture on first use."""
        if self._stream is None and self.active:
            forbid_capture(f"creating the {self.name} stream")
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _current(self):
        return torch.cuda.current_stream(self.device)

    def fork(self):
        """A context running on the side stream, ordered after the compute stream so far."""
        if not self.active:
            return contextlib.nullcontext()
        stream = self.stream
        stream.wait_stream(self._current())
        return torch.cuda.stream(stream)

    def mark(self) -> Mark | None:
        """Record an event after everything queued on the side stream (``None`` on the CPU)."""
        if not self.active:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        self._tail = Mark(event, is_capturing())
        return self._tail

    def wait(self, mark: Mark | None) -> None:
        """Make the compute stream wait on ``mark`` (skipped across a capture boundary)."""
        if mark is None:
            return
        if mark.captured == is_capturing():
            self._current().wait_event(mark.event)
        if self._tail is mark:
            self._tail = None

    def join(self) -> None:
        """Make the compute stream wait on everything marked on the side stream."""
        if self._tail is not None:
            self.wait(self._tail)
        self._tail = None
