"""Recording the order of forward and backward layer groups, and replaying it.

NOTE [schedule recording]: a step is a sequence of events ``("F", gid, name)`` (a group's
forward ended and its tensors were stashed or kept) and ``("B", gid, name)`` (its backward
started: the first of its saved tensors was unpacked); ``gid`` is the group's ordinal in the
step's forward order. The events of the last complete step are the schedule of the next
ones: a pipeline schedule (1F1B, interleaved virtual stages, several microbatches) repeats
itself from step to step, so after event ``i`` of a step the manager looks at event ``i+1``
of the recorded schedule to decide what to prefetch. While a step keeps matching the
recording event for event it is *aligned*; at the first difference the step stops using the
schedule (reloads then happen on demand, which is only slower) and its own events become the
new recording once it is complete.
"""
from __future__ import annotations

from collections import defaultdict

Event = tuple  # ("F" | "B", gid: int, name: str | None)


class Schedule:
    """Events of the current step next to the recorded schedule of the last complete step."""

    def __init__(self):
        self.recorded: list[Event] | None = None
        self.events: list[Event] = []
        self.aligned = False

    def start_step(self) -> None:
        self.events = []
        self.aligned = self.recorded is not None

    def add(self, event: Event) -> int:
        """Append an event of the current step; returns its index."""
        index = len(self.events)
        self.events.append(event)
        if self.aligned and (index >= len(self.recorded) or self.recorded[index] != event):
            self.aligned = False
        return index

    def next_after(self, index: int) -> Event | None:
        """The recorded event that follows event ``index`` of this step, if still aligned."""
        if not self.aligned or index + 1 >= len(self.recorded):
            return None
        return self.recorded[index + 1]

    def finish_step(self, complete: bool) -> None:
        if complete and self.events:
            self.recorded = list(self.events)


def kept_last(events: list[Event]) -> set[int]:
    """The groups whose forward event is followed directly by their own backward: they keep
    their tensors (NOTE [last group kept] in ``plan.py``)."""
    return {gid for i, (kind, gid, name) in enumerate(events)
            if kind == "F" and i + 1 < len(events) and events[i + 1] == ("B", gid, name)}


def replay_demand(events: list[Event], demand: dict) -> dict:
    """Peak pages and record entries per buffer key of a step, from its events.

    NOTE [warmup demand]: a group whose buffers were not sized yet keeps its tensors but notes
    the pages (and record-table entries) each key would have taken. Replaying the step's
    events gives the high-water mark a sized manager would reach: pages are taken at ``F`` and
    returned at ``B``, and a group whose ``F`` is followed directly by its own ``B`` is not
    stashed at all (NOTE [last group kept] in ``plan.py``), exactly as in later steps.

    Args:
        events: the step's events.
        demand: ``{gid: {key: (pages, entries)}}`` for the groups that noted demand.

    Returns:
        ``{key: (peak_pages, peak_entries)}``.
    """
    current = defaultdict(lambda: [0, 0])
    peak = defaultdict(lambda: [0, 0])
    taken = set()
    last = kept_last(events)
    for kind, gid, _ in events:
        if gid not in demand:
            continue
        if kind == "F":
            if gid in last:
                continue
            taken.add(gid)
            for key, (pages, entries) in demand[gid].items():
                cur = current[key]
                cur[0] += pages
                cur[1] += entries
                peak[key][0] = max(peak[key][0], cur[0])
                peak[key][1] = max(peak[key][1], cur[1])
        elif gid in taken:
            taken.discard(gid)
            for key, (pages, entries) in demand[gid].items():
                current[key][0] -= pages
                current[key][1] -= entries
    for gid in demand:   # groups never stashed still count once, for a key never seen F'd
        for key in demand[gid]:
            peak.setdefault(key, [0, 0])
    return {key: (p, e) for key, (p, e) in peak.items()}
