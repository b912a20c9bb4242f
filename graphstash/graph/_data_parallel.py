"""Data parallel under graph_step: finding DistributedDataParallel and meeting its conditions.

# NOTE [DDP]
``DistributedDataParallel`` reduces gradients from hooks its C++ reducer attaches to each
parameter's gradient accumulator, and keeps host-side bookkeeping around them. A CUDA graph can
hold the reduction (NCCL collectives capture) when, as torch's CUDA-graph notes and the reducer
ask:

1. the reducer has settled: at least 11 eager iterations before the capture. Its first 10
   iterations (and by default every 100th) record timing events and read them back on the host,
   and it rebuilds its buckets once, at the second. graph_step runs ``max(warmup, 11)`` eager
   steps before capturing a step whose optimizer's parameters belong to a DDP module, and raises
   the reducer's logging sample rate so that no later capture (after an overflow's rerun) lands
   on a sampled iteration;
2. no per-iteration search for unused parameters: ``find_unused_parameters=True`` walks the
   autograd graph and reads a usage map back to the host every iteration, unless
   ``static_graph=True`` (which does it once). graph_step refuses that combination with a
   ValueError saying what to set;
3. the gradient accumulators' stream: DDP creates them when it is constructed, on the stream
   current then, and the backward syncs each accumulator's stream with the capturing one. Built
   on the default (legacy) stream, that sync cannot be captured ("operation not permitted when
   stream is capturing"). graph_step cannot see or change that stream: DDP must be constructed
   on a side stream (README, "Data parallel"), and a capture that fails with DDP present says so.

graph_step finds the DDP modules among live objects (one scan with ``gc.get_objects()`` at the
first call, only when ``torch.distributed`` is initialised): those whose parameters include the
optimizer's. FSDP2 (``fully_shard``) needs nothing: its collectives capture as they are.
"""
from __future__ import annotations

import gc

import torch

DDP_WARMUP = 11
_SAMPLE_RATE = 2 ** 31 - 1


def find_ddp(optimizer) -> tuple:
    """The ``DistributedDataParallel`` modules holding any parameter of ``optimizer`` (empty
    without ``torch.distributed`` initialised)."""
    import torch.distributed as dist

    if optimizer is None or not (dist.is_available() and dist.is_initialized()):
        return ()
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = []
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel) and \
                any(id(p) in ids for p in obj.module.parameters()):
            found.append(obj)
    return tuple(found)


def check_ddp(ddp) -> None:
    """ValueError unless ``ddp`` can run under graph_step (NOTE [DDP] item 2)."""
    if getattr(ddp, "find_unused_parameters", False) and not getattr(ddp, "static_graph", False):
        raise ValueError(
            "optimizer: its parameters belong to a DistributedDataParallel module built with "
            "find_unused_parameters=True, which searches the autograd graph and reads a map back "
            "to the host every iteration; a CUDA graph cannot hold that. Construct it with "
            "static_graph=True (the search runs once), or find_unused_parameters=False")


def quiet_sampling(ddp) -> None:
    """Keep the reducer from timing (and reading back) sampled iterations after its first 10
    (NOTE [DDP] item 1); a no-op where torch does not offer it."""
    setter = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
    if setter is not None and torch.cuda.is_available():
        setter(_SAMPLE_RATE)


__all__ = ["DDP_WARMUP", "find_ddp", "check_ddp", "quiet_sampling"]
