"""Where the memory of a training step is: the peak, the blocks alive at it by owner, a timeline.

:func:`profile` runs a user's step function under a recorder and returns a
:class:`MemoryReport`: the peak, the blocks alive at that moment grouped by owner (parameters,
gradients, optimizer state, CUDA-graph pool, stash pool, saved activations per layer group,
temporaries by the op that produced them, inputs) and the timeline (``report.plot(path)``).
On CUDA the bytes are the caching allocator's history (NOTE [trace accounting] in
``_allocator.py``); on the CPU they are the sizes of the storages ops return (NOTE [storage
tracking] in ``_storage.py``). :func:`static_footprint` gives the bytes of parameters,
gradients and optimizer state, which the activation peak is measured above.

Nothing here touches the GPU at import time.
"""
from __future__ import annotations

import gc
import inspect
from bisect import bisect_left
from typing import Callable

import torch

from ._allocator import DEFAULT_MAX_ENTRIES, AllocatorRecorder, match_records, site
from ._report import (GRAPH_POOL, OTHER, OWNERS, SAVED_ACTIVATIONS, TEMPORARIES, Block,
                      MemoryReport, backward_starts, classify, peak_of)
from ._static import (STASH_POOL, owned_storages, owner_map, same_device, static_bytes,
                      static_footprint)
from ._storage import StorageRecorder


def _check_device(name: str, device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}: expected a torch.device or a string such as 'cpu' or "
                         f"'cuda:0', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA device, got {dev}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: expected a device torch can use, got {dev} but torch "
                             f"sees no CUDA GPU")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _pick_device(device, model, args) -> torch.device:
    if device is not None:
        return _check_device("device", device)
    tensors = []
    if model is not None:
        tensors += list(model.parameters())
    tensors += [a for a in args if isinstance(a, torch.Tensor)]
    return _check_device("device", tensors[0].device if tensors else "cpu")


def _check_arguments(step_fn, model, optimizer, stash_manager, steps, warmup, capture,
                     max_entries) -> None:
    if not callable(step_fn):
        raise TypeError(f"step_fn: expected a callable, got {type(step_fn).__name__}")
    for check, what in ((inspect.isgeneratorfunction, "a generator function"),
                        (inspect.iscoroutinefunction, "an async function"),
                        (inspect.isasyncgenfunction, "an async generator function")):
        if check(step_fn) or check(getattr(type(step_fn), "__call__", None)):
            raise TypeError(f"step_fn: expected a function that runs the step when called, got "
                            f"{what}: its body would never run, and the report would measure "
                            "nothing")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got "
                        f"{type(optimizer).__name__}")
    if stash_manager is not None and not hasattr(stash_manager, "buffers"):
        raise TypeError(f"stash_manager: expected a graphstash.StashManager or None, got "
                        f"{type(stash_manager).__name__}")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0),
                               ("max_entries", max_entries, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {value}")
    if not isinstance(capture, bool):
        raise TypeError(f"capture: expected a bool, got {type(capture).__name__}")


def profile(step_fn: Callable, *args, model=None, optimizer=None, stash_manager=None,
            steps: int = 1, warmup: int = 0, device=None, capture: bool = False,
            max_entries: int = DEFAULT_MAX_ENTRIES, snapshot: bool = False) -> MemoryReport:
    """Run ``step_fn(*args)`` and report where its memory is at its peak.

    Args:
        step_fn: one training step (forward, backward, optimizer step); its return value is
            dropped after each call.
        *args: passed to ``step_fn``; tensors among them are reported as ``inputs``.
        model, optimizer, stash_manager: what owns parameters and gradients, optimizer state
            and the stash pool (each optional: without them those bytes count as activations
            or temporaries). ``model`` also names the layer groups.
        steps: recorded calls (the peak is the highest over them).
        warmup: calls made before the recording (first steps create gradients, optimizer
            state and size stash pools).
        device: the device to account (default: the model's, else the first tensor
            argument's, else the CPU).
        capture: CUDA only: run the warmup calls on a side stream, then record the capture of
            one call in a CUDA graph (and ``steps - 1`` replays of it), which is the memory a
            graphed step holds.
        max_entries: allocator history entries kept (CUDA).
        snapshot: CUDA only: keep torch's memory snapshot of the recording (the allocator's
            segments and its history, with Python stacks) as ``report.snapshot``;
            ``report.write_snapshot(path)`` writes it for PyTorch's memory_viz page.

    Example::

        def step(x):
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()

        report = graphstash.memory.profile(step, x, model=model, optimizer=opt, warmup=1)
        print(report.table())               # peak, owner totals, the largest blocks
        report.activation_peak              # bytes above parameters, gradients, optimizer
        report.plot("memory.png")
    """
    _check_arguments(step_fn, model, optimizer, stash_manager, steps, warmup, capture,
                     max_entries)
    dev = _pick_device(device, model, args)
    on_cuda = dev.type == "cuda"
    if capture and not on_cuda:
        raise ValueError(f"capture: expected False on {dev}: CUDA graphs need a CUDA device")
    if not isinstance(snapshot, bool):
        raise TypeError(f"snapshot: expected a bool, got {type(snapshot).__name__}")
    if snapshot and not on_cuda:
        raise ValueError(f"snapshot: expected False on {dev}: torch's memory snapshot records "
                         "the CUDA caching allocator")
    graph = _warm_up(step_fn, args, warmup, dev, capture)

    def owners():
        return {k: v for k, v in owner_map(model, optimizer, stash_manager, args).items()
                if same_device(k[0], dev)}

    start_owners = owners()
    recorder = StorageRecorder(dev, root=model)
    allocator = AllocatorRecorder(dev, max_entries) if on_cuda else None
    held = []                                    # the graph and its static outputs
    # As NOTE [measuring peaks] in graphstash.tools.bench.stash: collect garbage first and keep the
    # cyclic collector off, so nothing unrelated is freed in the middle of the step.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if allocator is not None:
            allocator.start()
        else:
            # Only the storages (weakly) and their sizes are kept: holding the tensors would
            # keep a gradient the step drops alive.
            for key, _, storage in owned_storages(model, optimizer, stash_manager, args):
                if same_device(key[0], dev):
                    recorder.register_existing(key, storage.nbytes(), storage)
            storage = None
        recorder.start()
        try:
            for i in range(steps):
                recorder.begin_step()
                if graph is not None and i == 0:
                    with torch.cuda.graph(graph):
                        held.append(_ran(step_fn(*args)))
                elif graph is not None:
                    graph.replay()
                else:
                    _ran(step_fn(*args))
            if on_cuda:
                torch.cuda.synchronize(dev)
        finally:
            recorder.stop()
            recording = allocator.stop() if allocator is not None else None
    finally:
        if gc_was_enabled:
            gc.enable()
    end_owners = owners()
    starts = backward_starts(recorder.marks)
    if recording is None:
        blocks = [_cpu_block(rec, start_owners, end_owners, starts) for rec in recorder.records]
        events = recorder.events
        marks = [(event, label) for event, label, _ in recorder.marks]
        notes = ["CPU: bytes are the sizes of the storages ops returned, plus those of the "
                 "model, optimizer, stash manager and inputs (scratch memory inside an op is "
                 "not seen)"]
        allocator_peak = None
    else:
        matched, close, offset = match_records(recording.blocks, recorder.records)
        blocks = _cuda_blocks(recording, matched, start_owners, end_owners, starts, dev)
        events = recording.events
        marks = [(bisect_left(recording.times_us, t + offset), label)
                 for _, label, t in recorder.marks]
        notes = ["CUDA: requested bytes from the allocator history (NOTE [trace accounting])"]
        if close < 0.9:
            notes.append(f"only {close:.0%} of the tensors matched an allocator block closely "
                         f"in time (NOTE [matching storages to blocks]): owners may be off")
        if recording.truncated:
            notes.append(f"the allocator history filled max_entries={max_entries}: its oldest "
                         f"part is lost, raise max_entries")
        allocator_peak = recording.allocator_peak
    peak, peak_event = peak_of(blocks, events)
    del held, graph
    return MemoryReport(device=str(dev), peak=peak, peak_event=peak_event, blocks=blocks,
                        events=events, static_bytes=static_bytes(end_owners, dev),
                        allocator_peak=allocator_peak, marks=marks, notes=notes,
                        snapshot=recording.snapshot if snapshot and recording is not None
                        else None)


def _ran(result):
    """``result`` of a step call, refused when the call returned before running its body (a
    generator, coroutine or awaitable from a function profile could not recognise)."""
    if inspect.isgenerator(result) or inspect.iscoroutine(result) or \
            inspect.isasyncgen(result) or inspect.isawaitable(result):
        if inspect.isgenerator(result) or inspect.iscoroutine(result):
            result.close()
        raise TypeError(f"step_fn: returned a {type(result).__name__} instead of running; its "
                        "body never ran, so there is nothing to measure")
    return result


def _warm_up(step_fn, args, warmup: int, dev: torch.device, capture: bool):
    """Run the warmup calls; with ``capture`` on a side stream (as ``torch.cuda.graph``
    wants) and return a new ``CUDAGraph`` to capture into, else ``None``."""
    if not capture:
        for _ in range(warmup):
            _ran(step_fn(*args))
        return None
    current = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            _ran(step_fn(*args))
    current.wait_stream(side)
    torch.cuda.synchronize(dev)
    return torch.cuda.CUDAGraph()


def _cpu_block(rec, start_owners, end_owners, starts) -> Block:
    if rec.start < 0:
        return Block(rec.nbytes, rec.start, rec.end, start_owners[rec.key][0])
    owner, detail = classify(rec, end_owners, starts)
    return Block(rec.nbytes, rec.start, rec.end, owner, detail)


def _cuda_blocks(recording, matched, start_owners, end_owners, starts, dev) -> list:
    """Blocks of the allocator trace with their owners (NOTE [owners] in ``_report.py``);
    ``matched`` pairs blocks with the recorder's storages (``match_records``)."""
    blocks = []
    for i, tb in enumerate(recording.blocks):
        key = (dev, tb.addr)
        if tb.start < 0:
            if key in start_owners:
                owner, detail = start_owners[key][0], ""
            elif tb.in_graph_pool:
                owner, detail = GRAPH_POOL, "allocated before the step"
            else:
                owner, detail = OTHER, "allocated before the step"
        elif tb.end is None and key in end_owners:
            owner, detail = end_owners[key][0], ""
        elif i in matched:
            owner, detail = classify(matched[i], end_owners, starts)
        else:
            owner, detail = TEMPORARIES, f"inside an op: {site(tb.frames)}"
        blocks.append(Block(tb.nbytes, tb.start, tb.end, owner, detail, tb.in_graph_pool))
    return blocks


__all__ = ["MemoryReport", "OWNERS", "SAVED_ACTIVATIONS", "STASH_POOL", "profile",
           "static_footprint"]
