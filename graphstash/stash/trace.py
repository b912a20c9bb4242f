"""What a :class:`~graphstash.StashManager` did, for tests, benchmarks and notebooks.

NOTE [introspection]: ``with manager.trace() as trace:`` records, in order, every copy the
manager issues: ``("stash", group)`` when a group's forward ends, ``("prefetch", group)``
when its reload is issued ahead of its backward (NOTE [prefetch] in ``scheduler.py``) and
``("reload", group)`` when its backward had to ask for it; ``group`` is the group's ordinal
in the step's forward order. With ``timing=True`` (eager CUDA steps only: timing events
cannot be captured) each copy is also bracketed by CUDA events on its side stream, and
:meth:`StashTrace.copy_intervals` turns them into milliseconds. Tracing costs a list append
per group, nothing per tensor; outside ``trace()`` nothing is recorded.
"""
from __future__ import annotations

import torch

from .._checks import forbid_capture, is_capturing


class StashTrace:
    """The copies a manager issued inside ``manager.trace()`` (NOTE [introspection]).

    Attributes:
        events: ``[(kind, group), ...]``: ``kind`` one of ``"stash"``, ``"prefetch"``,
            ``"reload"``; ``group`` the group's ordinal in its step.

    Example::

        with manager.trace() as trace:
            loss = model(x); loss.backward()
        assert [k for k, _ in trace.events].count("stash") == num_layers - 1
    """

    def __init__(self, device: torch.device, timing: bool):
        self.device = device
        self.timing = timing
        self.events: list[tuple[str, int]] = []
        self._timed: list = []          # (kind, gid, name, start event, end event)

    def timer(self, stream):
        """A timing event recorded on ``stream`` when timing (else None)."""
        if not self.timing or stream is None or is_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def note(self, kind: str, group, start=None, end=None) -> None:
        self.events.append((kind, group.gid))
        if start is not None:
            self._timed.append((kind, group.gid, group.name, start, end))

    def copy_intervals(self, base_event) -> list:
        """``[(kind, group, name, start_ms, end_ms), ...]`` of the timed copies, relative to
        ``base_event`` (a timing ``torch.cuda.Event`` recorded before them). Synchronizes."""
        forbid_capture("StashTrace.copy_intervals()")
        if self._timed:
            torch.cuda.synchronize(self.device)
        return [(kind, gid, name, base_event.elapsed_time(s), base_event.elapsed_time(e))
                for kind, gid, name, s, e in self._timed]
