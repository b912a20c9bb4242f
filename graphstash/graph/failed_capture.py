"""Ending a CUDA graph capture that failed, and undoing what torch leaves behind.

NOTE [failed capture]: when a CUDA error invalidates a capture (a host sync, an allocation on
a stream outside the capture, a fork never joined), ``CUDAGraph.capture_end()`` raises at
``cudaStreamEndCapture`` before it finishes its own bookkeeping: every generator registered
with the graph (the device's default CUDA generator always is) stays in capture mode, and the
caching allocator keeps the graph's memory pool among the captures under way. The first stays
until the process ends: every later random draw on that device raises "Offset increment
outside graph capture encountered unexpectedly" (measured on torch 2.11: after one failed
capture every case of a probe failed so, eager ones too). Undoing it:

- the pool: the capture is given its pool (:func:`new_pool`, a fresh handle, so that the
  failed graph, which cannot say its pool, need not be asked); after a failed end the pool's
  allocation is ended and the pool released, so its blocks go back once the failed
  capture's tensors are gone;
- the generators: one trivial capture with the same generators registered, whose normal end
  takes each out of capture mode (their offsets are those before the failed capture: nothing
  advanced them). Each is then checked with one draw (its offset restored); one still in
  capture mode gets a fresh copy of its state instead (``graphsafe_set_state(clone_state())``,
  same seed and offset). The copy is a last resort: graphs captured earlier keep advancing
  the old state, so their random streams and the eager one could meet again.

A capture that failed with a Python error (graph_step's own refusals, a ValueError in the
step) ends normally and needs none of this.
"""
from __future__ import annotations

import torch

_STUCK = "outside graph capture"


def new_pool() -> tuple:
    """A fresh memory pool handle for one capture (``torch.cuda.graph_pool_handle()``)."""
    return torch.cuda.graph_pool_handle()


def end_capture(graph, pool, device: torch.device, generators=()) -> None:
    """``graph.capture_end()``; if it raises, undo the failed capture's leftovers
    (NOTE [failed capture]) and raise its error."""
    try:
        graph.capture_end()
    except BaseException:
        _undo_leftovers(pool, device, generators)
        raise


def abandon_capture(graph, pool, device: torch.device, generators=()) -> None:
    """End a capture whose body raised: ``capture_end()`` if the capture survived the error,
    else undo what the failed end leaves behind (NOTE [failed capture]). Never raises.

    Args:
        graph: the ``torch.cuda.CUDAGraph`` whose ``capture_begin(pool=pool)`` ran.
        pool: the handle from :func:`new_pool` it captures into.
        device: its CUDA device.
        generators: the extra generators registered with it (the default one always is).
    """
    try:
        graph.capture_end()
        return
    except Exception:           # noqa: BLE001 - invalidated by the error that stopped the body
        pass
    _undo_leftovers(pool, device, generators)


def _undo_leftovers(pool, device: torch.device, generators) -> None:
    """Each part on its own: one failing must not keep the others from running."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release_pool = getattr(torch._C, "_cuda_releasePool", None)
    try:
        if end_pool is not None:
            end_pool(index, pool)
            if release_pool is not None:
                release_pool(index, pool)
    except Exception:           # noqa: BLE001 - torch ended (and released) it itself
        pass
    try:
        reset_generators(device, generators)
    except Exception:           # noqa: BLE001 - the capture's own error is the one to report
        pass


def reset_generators(device: torch.device, generators=()) -> None:
    """Take the default CUDA generator of ``device`` and ``generators`` out of capture mode
    (NOTE [failed capture])."""
    with torch.cuda.device(device):
        try:
            _trivial_capture(device, generators)
        except Exception:       # noqa: BLE001 - the check below repairs what is left
            pass
        for gen in (torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()],
                    *generators):
            if _stuck(gen, device):
                gen.graphsafe_set_state(gen.clone_state())


def _trivial_capture(device: torch.device, generators) -> None:
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


def _stuck(gen: torch.Generator, device: torch.device) -> bool:
    """Whether ``gen`` is still in capture mode: one draw outside any capture raises then.
    The draw's offset is given back."""
    offset = gen.get_offset()
    try:
        torch.empty(1, device=device).uniform_(generator=gen)
    except RuntimeError as exc:
        return _STUCK in str(exc)
    finally:
        try:
            gen.set_offset(offset)
        except RuntimeError:
            pass
    return False
