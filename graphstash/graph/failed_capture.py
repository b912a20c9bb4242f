"""Ending a CUDA graph capture that failed, and undoing what torch leaves behind.

NOTE [failed capture]: when a CUDA error invalidates a capture (a host sync, work on the
legacy stream, a fork never joined), ``CUDAGraph.capture_end()`` raises at
``cudaStreamEndCapture`` before it finishes its own bookkeeping: every generator registered
with the graph (the device's default CUDA generator always is) stays in capture mode, and the
caching allocator still has the graph's private pool among the captures under way. The first
stays until the process ends: every later random draw on that device raises "Offset
increment outside graph capture encountered unexpectedly" (measured on torch 2.11: every
case of a probe after its first failed capture failed so, eager ones too). So after a failed
end, :func:`abandon_capture` ends the pool's allocation and releases the pool (its blocks go
back once the failed capture's tensors are gone), and runs one trivial capture with the same
generators registered, whose normal end takes each generator out of capture mode again (the
offsets are those before the failed capture: nothing advanced them). A capture that failed
with a Python error (graph_step's own refusals, a ValueError in the step) ends normally and
needs none of this.
"""
from __future__ import annotations

import torch


def end_capture(graph, device: torch.device, generators=()) -> None:
    """``graph.capture_end()``; if it raises, undo the failed capture's leftovers
    (:func:`abandon_capture`) and raise its error."""
    try:
        graph.capture_end()
    except BaseException:
        _undo_leftovers(graph, device, generators)
        raise


def abandon_capture(graph, device: torch.device, generators=()) -> None:
    """End a capture whose body raised: ``capture_end()`` if the capture survived the error,
    else undo what the failed end leaves behind (NOTE [failed capture]). Never raises.

    Args:
        graph: the ``torch.cuda.CUDAGraph`` whose ``capture_begin()`` ran.
        device: its CUDA device.
        generators: the extra generators registered with it (the default one always is).
    """
    try:
        graph.capture_end()
        return
    except Exception:           # noqa: BLE001 - invalidated by the error that stopped the body
        pass
    try:
        _undo_leftovers(graph, device, generators)
    except Exception:           # noqa: BLE001 - the original error is the one to report
        pass


def _undo_leftovers(graph, device: torch.device, generators) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = graph.pool()
    end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release_pool = getattr(torch._C, "_cuda_releasePool", None)
    if end_pool is not None:
        try:
            end_pool(index, pool)
        except RuntimeError:
            pass                # torch ended it itself: it released the pool too
        else:
            if release_pool is not None:
                release_pool(index, pool)
    reset_generators(device, generators)


def reset_generators(device: torch.device, generators=()) -> None:
    """Take the default CUDA generator of ``device`` and ``generators`` out of capture mode:
    one trivial capture with them registered, ended normally (NOTE [failed capture])."""
    with torch.cuda.device(device):
        scratch = torch.zeros(1, device=device)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        for gen in generators:
            graph.register_generator_state(gen)
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                scratch.add_(1)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        del graph
