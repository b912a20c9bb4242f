"""A step-peak owner for the tests of NOTE [rerun by capture] in graphstash/graph/_step.py."""
from __future__ import annotations

from graphstash.status import claim_peak_slot


class MovingOwner:
    """A step-peak owner (graphstash.status.PeakOwner) whose version moves whenever a flagged
    step's peaks reach it, as an adaptive budget that shrinks right then would. The step
    raises its peak in slot ``slot`` (``graphstash.status.raise_peak``)."""

    def __init__(self):
        self.version = 0
        self.flagged = 0
        self.slot = claim_peak_slot(self, "rows")

    def observe(self, peaks, *, flagged):
        if flagged:
            self.flagged += 1
            self.version += 1

    def state_dict(self):
        return {"version": self.version, "flagged": self.flagged}

    def load_state_dict(self, state):
        self.version, self.flagged = state["version"], state["flagged"]
