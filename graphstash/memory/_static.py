"""Which storages the model, the optimizer, the stash manager and the step's inputs own.

Keys are ``(device, data_ptr)`` of untyped storages: a storage's data pointer is the start of
the block the allocator handed out for it (CUDA caching allocator and CPU alike), so the same
key names a storage tracked by the dispatch recorder and a block of the CUDA allocator trace.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

# Owners that hold memory across steps, in the order they win when a storage has two roles.
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
STASH_POOL = "stash pool"
INPUTS = "inputs"
STATIC_OWNERS = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE)


def storage_key(t: torch.Tensor):
    """``(device, data_ptr)`` of ``t``'s untyped storage, or ``None`` for an empty storage."""
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    return (t.device, st.data_ptr())


def _tensors(obj) -> list:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _optimizer_tensors(optimizer) -> list:
    return [t for state in optimizer.state.values() for t in _tensors(state)]


def _stash_tensors(manager) -> list:
    """The manager's status and every tensor of its buffers' pools (pages, rings, tables)."""
    tensors = [manager.status]
    for buf in manager.buffers.values():
        tensors += buf.tensors()
    return tensors


def owned_storages(model=None, optimizer=None, stash_manager=None, inputs=()):
    """Yield ``(key, owner, untyped storage)`` once per storage the arguments hold now.

    A storage with two roles keeps the first of parameters, gradients, optimizer state,
    stash pool, inputs."""
    groups = []
    if model is not None or optimizer is not None:
        params = (list(model.parameters()) if model is not None
                  else [p for g in optimizer.param_groups for p in g["params"]])
        groups += [(PARAMETERS, params),
                   (GRADIENTS, [p.grad for p in params if p.grad is not None])]
    if optimizer is not None:
        groups.append((OPTIMIZER_STATE, _optimizer_tensors(optimizer)))
    if stash_manager is not None:
        groups.append((STASH_POOL, _stash_tensors(stash_manager)))
    groups.append((INPUTS, _tensors(inputs)))
    seen = set()
    for owner, tensors in groups:
        for t in tensors:
            key = storage_key(t)
            if key is not None and key not in seen:
                seen.add(key)
                yield key, owner, t.untyped_storage()


def owner_map(model=None, optimizer=None, stash_manager=None, inputs=()) -> dict:
    """``{storage key: (owner, nbytes)}`` of :func:`owned_storages` (holds no tensor, so it
    keeps nothing alive)."""
    return {key: (owner, st.nbytes())
            for key, owner, st in owned_storages(model, optimizer, stash_manager, inputs)}


def static_footprint(model, optimizer=None, device=None) -> int:
    """Bytes of the parameters, gradients and optimizer state that exist now.

    Each storage counts once, in full (tied weights and flat parameter buffers are not
    counted twice). ``device`` (optional) keeps only storages on that device; the
    activation peak of a step is its peak minus this.

    Example::

        static = graphstash.memory.static_footprint(model, opt, device="cuda")
        activation_peak = torch.cuda.max_memory_allocated() - static
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got "
                        f"{type(optimizer).__name__}")
    dev = None
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch.device, a string such as 'cuda:0' or "
                             f"None, got {device!r}") from exc
    return static_bytes(owner_map(model, optimizer), dev)


def static_bytes(owners: dict, device: torch.device | None = None) -> int:
    """Bytes of the parameters, gradients and optimizer state in ``owners`` (an
    :func:`owner_map`), on ``device`` if given."""
    return sum(nbytes for key, (owner, nbytes) in owners.items()
               if owner in STATIC_OWNERS and (device is None or same_device(key[0], device)))


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` name the same device (``cuda`` without an index matches any GPU)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index is None or b.index is None:
        return True
    return a.index == b.index
