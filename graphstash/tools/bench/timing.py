"""Timing helpers for the benchmarks: CUDA events around graph replays, medians, and the
samples behind them (``*_samples``: their spread goes beside each median,
:mod:`graphstash.tools.bench.spread`)."""
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
    return statistics.median(event_samples(fn, repeats))


def event_samples(fn: Callable[[], object], repeats: int = 7) -> list:
    """Milliseconds of each of ``repeats`` calls of ``fn()`` between two CUDA events on the
    current stream (each synchronized before the next)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_replays_interleaved(graphs: dict, repeats: int = 7) -> dict:
    """Median milliseconds of one replay of each graph in ``{name: CUDAGraph}``, replayed in
    alternating rounds (NOTE [interleaved timing] in ``graph.py``: clock or thermal drift then
    favours none of them); one warm-up replay each."""
    return {name: statistics.median(times)
            for name, times in replay_samples_interleaved(graphs, repeats).items()}


def replay_samples_interleaved(graphs: dict, repeats: int = 7) -> dict:
    """The samples :func:`time_replays_interleaved` takes the medians of: ``{name: [ms of one
    replay, per round]}``."""
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    samples = {name: [] for name in graphs}
    for _ in range(repeats):
        for name, graph in graphs.items():
            samples[name].append(event_ms(graph.replay, 1))
    return samples


def time_replays(graph: torch.cuda.CUDAGraph, repeats: int = 7) -> float:
    """Median milliseconds of one replay of ``graph`` (CUDA events; one warm-up replay)."""
    return statistics.median(replay_samples(graph, repeats))


def replay_samples(graph: torch.cuda.CUDAGraph, repeats: int = 7) -> list:
    """Milliseconds of each of ``repeats`` replays of ``graph`` (CUDA events; one warm-up
    replay first)."""
    graph.replay()
    torch.cuda.synchronize()
    return event_samples(graph.replay, repeats)


def time_calls(fn: Callable[[], None], repeats: int = 7, inner: int = 5, warmup: int = 1) -> float:
    """Median milliseconds per call of ``fn`` in a steady state: ``warmup`` calls first, then
    ``repeats`` samples of ``inner`` back-to-back calls between CUDA events (no sync inside a
    sample, so host overhead shows only where it exceeds the GPU time)."""
    return time_calls_interleaved({"fn": fn}, repeats, inner, warmup)["fn"]


def time_calls_interleaved(fns: dict, repeats: int = 7, inner: int = 5,
                           warmup: int = 1) -> dict:
    """:func:`time_calls` of every function in ``{name: fn}``, their samples taken in
    alternating rounds (NOTE [interleaved timing] in ``graph.py``)."""
    return {name: statistics.median(times)
            for name, times in call_samples_interleaved(fns, repeats, inner, warmup).items()}


def call_samples_interleaved(fns: dict, repeats: int = 7, inner: int = 5,
                             warmup: int = 1) -> dict:
    """The samples :func:`time_calls_interleaved` takes the medians of: ``{name: [ms per
    call, per round]}``."""
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
    return samples


def eager_training_step(forward_backward: Callable, optimizer) -> Callable:
    """The step of an eager loop around ``forward_backward(batch) -> loss`` (which runs the
    forward and the backward): ``zero_grad``, then it, then ``optimizer.step()``."""
    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(batch)
        optimizer.step()
        return loss
    return step
