"""Which call of a bench row set its memory peak, and what that call was.

NOTE [peak call]: a row's peak is the largest allocation over its capture and timed calls, and
a row that reran or recaptured once can have its peak set by that one call (an eager rerun
beside the captured step's memory, under drifting routing: docs/exchange.md, "Drifting
routing"). The bench reads the allocator's running peak after each call (host-side, no sync)
and keeps the first call that reached the highest value, with what the step's stats say the
call did: ``"rerun"`` (the step was flagged and rerun: dropless, or by a new capture:
NOTE [rerun by capture] in ``graphstash/graph/_step.py``), ``"capture"`` (a graph was
captured), ``"call"`` (a replay, or a row without ``graph_step``). Across ranks, the rank with
the highest peak names the call.

Example::

    calls = PeakCalls(device, run.graph)      # after the peak statistics were reset
    for batch in batches:
        run.step(*batch)
        calls.after_call()
    calls.best()                              # {"call": 3, "kind": "rerun", "peak_mib": ...}
"""
from __future__ import annotations

import torch

MIB = 2.0 ** 20


class PeakCalls:
    """The call (0-based, in the order :meth:`after_call` is told of them) at which this
    rank's peak allocation on ``device`` (a ``torch.device``) first reached its highest value.

    Args:
        device: the rank's device; on anything but CUDA there are no memory statistics and
            :meth:`best` is None.
        graph: the row's ``graph_step`` (its ``stats`` name reruns and captures), or None.
    """

    def __init__(self, device: torch.device, graph=None):
        self._device = device
        self._graph = graph
        self._calls = 0
        self._best: dict | None = None
        self._counts = self._read_counts()

    def _read_counts(self) -> tuple:
        stats = self._graph.stats if self._graph is not None else None
        return (stats.reruns, stats.captures) if stats is not None else (0, 0)

    def after_call(self) -> None:
        """Tell it one call ended (outside any timed region: reads the stats)."""
        counts = self._read_counts()
        if self._device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self._device)
            if self._best is None or peak > self._best["peak_bytes"]:
                kind = ("rerun" if counts[0] > self._counts[0] else
                        "capture" if counts[1] > self._counts[1] else "call")
                self._best = {"call": self._calls, "kind": kind, "peak_bytes": peak}
        self._counts = counts
        self._calls += 1

    @property
    def calls(self) -> int:
        """The calls it was told of."""
        return self._calls

    def best(self) -> dict | None:
        """``{"call", "of", "kind", "peak_mib"}`` of the call that set the peak, or None
        (no CUDA, or no call)."""
        if self._best is None:
            return None
        return {"call": self._best["call"], "of": self._calls, "kind": self._best["kind"],
                "peak_mib": self._best["peak_bytes"] / MIB}


def highest(per_rank: list) -> dict | None:
    """Of every rank's :meth:`PeakCalls.best` (in rank order), the one with the highest peak,
    with its ``"rank"``; None if no rank has one."""
    found = [(b["peak_mib"], rank, b) for rank, b in enumerate(per_rank) if b is not None]
    if not found:
        return None
    _, rank, b = max(found, key=lambda t: (t[0], -t[1]))
    return {**b, "rank": rank}


def describe(row: str, found: dict | None) -> str | None:
    """``"live rows + stash: call 5 of 41 from the capture (rerun), rank 1"`` or None."""
    if found is None:
        return None
    return (f"{row}: call {found['call']} of {found['of']} from the capture "
            f"({found['kind']}), rank {found['rank']}")
