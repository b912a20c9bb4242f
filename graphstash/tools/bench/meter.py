"""What the training-step benchmarks (``bench moe``, ``bench hf``) read from their device.

On a CUDA device: step times from CUDA events (or the host clock around a synchronised step)
and the caching allocator's counters. On the CPU, where the tests run the benchmarks' mode
runners at tiny sizes (graph_step runs every step eagerly there): the host clock, and no
memory figures (``None``: the CPU allocator keeps no peak).

Example::

    meter = DeviceMeter(device)
    meter.settle()                   # the previous run's garbage collected and returned
    meter.reset_peak()
    base = meter.allocated()
    ms = meter.time_ms(lambda: step(x, y))
    peak = meter.peak_above(base)    # bytes above ``base``, None on the CPU
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import torch

from .timing import event_ms


class DeviceMeter:
    """Time and memory of the work on one ``device`` (a ``torch.device``, CPU or CUDA)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for the device's work (nothing to wait for on the CPU)."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def settle(self) -> None:
        """Collect garbage and hand the allocator's cached blocks back to the device, so that
        the next run starts from what is really alive."""
        self.sync()
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int | None:
        """Bytes allocated on the device now (None on the CPU)."""
        return torch.cuda.memory_allocated(self.device) if self.on_gpu else None

    def peak_above(self, base: int | None) -> int | None:
        """Peak allocated bytes since :meth:`reset_peak`, less ``base`` (None on the CPU)."""
        if not self.on_gpu:
            return None
        return torch.cuda.max_memory_allocated(self.device) - (base or 0)

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one call of ``fn``: between two CUDA events on the current stream
        on a GPU, by the host clock on the CPU."""
        if self.on_gpu:
            return event_ms(fn, 1)
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)

    def wall_ms(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one call of ``fn`` by the host clock, the device synchronised
        before and after (what a training loop that reads its loss every step waits)."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return 1e3 * (time.perf_counter() - start)

    def timed_call(self, fn: Callable[..., object], *args) -> tuple[float, object]:
        """``fn(*args)`` timed as :meth:`wall_ms` times it: (milliseconds, what it returned)."""
        self.sync()
        start = time.perf_counter()
        out = fn(*args)
        self.sync()
        return 1e3 * (time.perf_counter() - start), out
