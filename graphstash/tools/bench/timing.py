"""Timing helpers for the benchmarks: CUDA events around graph replays, medians."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def gpu_name() -> str:
    return torch.cuda.get_device_name(torch.cuda.current_device())


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


def capture(fn: Callable[[], None], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run ``fn`` eagerly ``warmup`` times on a side stream, then capture it in a graph."""
    return capture_with_output(fn, warmup)[0]


def event_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median milliseconds of ``fn()`` between two CUDA events on the current stream, over
    ``repeats`` calls (each synchronized before the next)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_replays_interleaved(graphs: dict, repeats: int = 7) -> dict:
    """Median milliseconds of one replay of each graph in ``{name: CUDAGraph}``, replayed in
    alternating rounds (NOTE [interleaved timing] in ``graph.py``: clock or thermal drift then
    favours none of them); one warm-up replay each."""
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    samples = {name: [] for name in graphs}
    for _ in range(repeats):
        for name, graph in graphs.items():
            samples[name].append(event_ms(graph.replay, 1))
    return {name: statistics.median(times) for name, times in samples.items()}


def time_replays(graph: torch.cuda.CUDAGraph, repeats: int = 7) -> float:
    """Median milliseconds of one replay of ``graph`` (CUDA events; one warm-up replay)."""
    graph.replay()
    torch.cuda.synchronize()
    return event_ms(graph.replay, repeats)


def time_calls(fn: Callable[[], None], repeats: int = 7, inner: int = 5, warmup: int = 1) -> float:
    """Median milliseconds per call of ``fn`` in a steady state: ``warmup`` calls first, then
    ``repeats`` samples of ``inner`` back-to-back calls between CUDA events (no sync inside a
    sample, so host overhead shows only where it exceeds the GPU time)."""
    return time_calls_interleaved({"fn": fn}, repeats, inner, warmup)["fn"]


def time_calls_interleaved(fns: dict, repeats: int = 7, inner: int = 5,
                           warmup: int = 1) -> dict:
    """:func:`time_calls` of every function in ``{name: fn}``, their samples taken in
    alternating rounds (NOTE [interleaved timing] in ``graph.py``)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()

    def inner_calls(fn):
        for _ in range(inner):
            fn()

    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(event_ms(lambda: inner_calls(fn), 1) / inner)
    return {name: statistics.median(times) for name, times in samples.items()}


def eager_training_step(forward_backward: Callable, optimizer) -> Callable:
    """The step of an eager loop around ``forward_backward(batch) -> loss`` (which runs the
    forward and the backward): ``zero_grad``, then it, then ``optimizer.step()``."""
    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(batch)
        optimizer.step()
        return loss
    return step


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in columns]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for k, r in enumerate(cells):
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)
