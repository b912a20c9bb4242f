"""NOTE [peak call]: which call of a bench row set its peak, and what that call did."""
from __future__ import annotations

import types

import torch

from graphstash.tools.bench import peak_call
from graphstash.tools.bench.peak_call import PeakCalls, describe, highest


class _Graph:
    """A ``graph_step`` stand-in: its ``stats`` name reruns and captures."""

    def __init__(self):
        self.reruns = self.captures = 0

    @property
    def stats(self):
        return types.SimpleNamespace(reruns=self.reruns, captures=self.captures)


def test_the_first_call_to_reach_the_highest_peak_is_named_with_what_it_did(monkeypatch):
    peaks = iter([100, 100, 300, 300, 250, 300])     # the allocator's running peak
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: next(peaks))
    graph = _Graph()
    calls = PeakCalls(torch.device("cuda", 0), graph)
    graph.captures += 1                               # call 0: the capture
    calls.after_call()
    calls.after_call()                                # call 1: a replay, no higher
    graph.reruns += 1                                 # call 2: a rerun sets the peak
    calls.after_call()
    for _ in range(3):                                # calls 3-5: replays at most as high
        calls.after_call()
    assert calls.best() == {"call": 2, "of": 6, "kind": "rerun",
                            "peak_mib": 300 / peak_call.MIB}


def test_a_capture_that_sets_the_peak_is_named_a_capture(monkeypatch):
    peaks = iter([500, 400])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: next(peaks))
    graph = _Graph()
    calls = PeakCalls(torch.device("cuda", 0), graph)
    graph.captures += 1
    calls.after_call()
    calls.after_call()
    assert calls.best()["kind"] == "capture" and calls.best()["call"] == 0


def test_without_cuda_or_a_graph():
    calls = PeakCalls(torch.device("cpu"))
    calls.after_call()
    assert calls.best() is None and calls.calls == 1
    assert highest([None, None]) is None and describe("live rows", None) is None


def test_the_rank_with_the_highest_peak_names_the_call():
    per_rank = [{"call": 4, "of": 11, "kind": "call", "peak_mib": 10.0},
                {"call": 2, "of": 11, "kind": "rerun", "peak_mib": 12.0}, None]
    found = highest(per_rank)
    assert found == {"call": 2, "of": 11, "kind": "rerun", "peak_mib": 12.0, "rank": 1}
    assert describe("live rows + stash", found) == (
        "live rows + stash: call 2 of 11 from the capture (rerun), rank 1")
