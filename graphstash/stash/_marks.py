"""Opting tensors out of stashing: :func:`mark_not_stashable`."""
from __future__ import annotations

import weakref

import torch

_ATTR = "_graphstash_not_stashable"
# storage address -> weak reference to a marked tensor: catches views of a marked tensor that
# an operator makes before saving (they are new tensor objects without the attribute).
_marked_storages: dict[int, weakref.ref] = {}


def mark_not_stashable(t: torch.Tensor) -> torch.Tensor:
    """Keep ``t`` (and views of its storage) out of ``stash_activations``; returns ``t``.

    Args:
        t: any tensor, on any device.

    Example::

        routing = graphstash.mark_not_stashable(torch.empty(budget, 8, device="cuda"))
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t: expected a torch.Tensor, got {type(t).__name__}")
    try:
        setattr(t, _ATTR, True)
    except (AttributeError, TypeError):   # a tensor subclass without a __dict__
        pass
    if t.layout == torch.strided and t.numel() > 0:
        ptr = t.untyped_storage().data_ptr()
        for stale in [k for k, ref in _marked_storages.items() if ref() is None]:
            del _marked_storages[stale]
        _marked_storages[ptr] = weakref.ref(t)
    return t


def is_marked(t: torch.Tensor) -> bool:
    if getattr(t, _ATTR, False):
        return True
    if not _marked_storages:
        return False
    ptr = t.untyped_storage().data_ptr()
    ref = _marked_storages.get(ptr)
    if ref is None:
        return False
    owner = ref()
    if owner is None or owner.untyped_storage().data_ptr() != ptr:
        del _marked_storages[ptr]
        return False
    return True
