"""Capturing a function in a CUDA graph by hand, for the tests that check what a graph holds."""
from __future__ import annotations

from typing import Callable

import torch


def capture_with_output(fn: Callable[[], object], warmup: int = 2,
                        before_capture: Callable[[], None] | None = None):
    """Run ``fn`` eagerly ``warmup`` times on a side stream, then capture one call in a CUDA
    graph; returns ``(graph, what the captured call returned)`` (its static outputs).
    ``before_capture`` runs between the two (e.g. to reset peak-memory statistics)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
