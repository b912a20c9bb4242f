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
   current then, and the backward runs each accumulator on its stream, synced with the
   capturing one. Built on the default (legacy) stream, as users build it, that sync cannot be
   captured ("work on the legacy default stream"; measured on two H100s: the capture fails at
   ``loss.backward()`` after the 11 warmups). torch's CUDA-graph notes ask for DDP to be
   constructed on a side stream; graph_step does that itself, before the warmup: it rebuilds
   the reducer as DDP's own ``__setstate__`` does (``_build_params_for_reducer``,
   ``_ddp_init_helper``, static graph again), on a side stream, after dropping the old reducer
   so that the parameters' accumulators are made anew there (:func:`rebuild_on_side_stream`).
   Nothing else changes: the same buckets, parameters and hooks, and the 11 warmups after it.
   A DDP with a communication hook or mixed precision (state bound to the old reducer) is left
   as it is, and a capture that fails with it says to build it on a side stream; so does one
   whose accumulators something else keeps alive (checked: a mark on the old accumulator must
   not be on the new one).

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


_MARK = "graphstash.ddp_accumulator_before_rebuild"


def _accumulators(ddp):
    """The gradient accumulator node of each parameter of ``ddp`` that requires grad."""
    return [p.view_as(p).grad_fn.next_functions[0][0]
            for p in ddp.module.parameters() if p.requires_grad]


def rebuild_on_side_stream(ddp, stream) -> str | None:
    """Rebuild ``ddp``'s reducer on ``stream`` so that its gradient accumulators are made there
    (NOTE [DDP] item 3). Returns None when done, else why it was left as it was."""
    if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "mixed_precision", None) is not None \
            or getattr(ddp, "_use_python_reducer", False):
        return "it has a communication hook, mixed precision or the Python reducer"
    needed = ("_build_params_for_reducer", "_build_debug_param_to_name_mapping",
              "_ddp_init_helper", "reducer", "logger", "static_graph")
    if not all(hasattr(ddp, name) for name in needed):
        return "this torch's DistributedDataParallel has no reducer rebuild"
    nodes = _accumulators(ddp)
    if not nodes:
        return None
    for node in nodes:
        node.metadata[_MARK] = True
    del nodes, node
    static = bool(ddp.static_graph)
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    ddp.reducer = ddp.logger = None     # the old reducer and its accumulators go here
    with torch.cuda.stream(stream):
        parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
        names = ddp._build_debug_param_to_name_mapping(parameters)
        ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, static)
        if static:
            ddp.reducer._set_static_graph()
            ddp.logger._set_static_graph()
        remade = _accumulators(ddp)
    current.wait_stream(stream)
    if any(_MARK in node.metadata for node in remade):
        return ("something besides DDP keeps the parameters' gradient accumulators alive (an "
                "autograd graph of an earlier forward?), so they stay on the stream DDP was "
                "built on")
    return None


def quiet_sampling(ddp) -> None:
    """Keep the reducer from timing (and reading back) sampled iterations after its first 10
    (NOTE [DDP] item 1); a no-op where torch does not offer it."""
    setter = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
    if setter is not None and torch.cuda.is_available():
        setter(_SAMPLE_RATE)


__all__ = ["DDP_WARMUP", "find_ddp", "check_ddp", "quiet_sampling", "rebuild_on_side_stream"]
