"""Which saved tensors may move at all, and the one opt-out mark.

Each policy adds its own conditions (a size threshold, the budget shape of a stash); none
moves a tensor :func:`movable` rejects.
"""
from __future__ import annotations

import weakref

import torch

_ATTR = "_graphstash_not_movable"
# storage address -> weak reference to a marked tensor: catches views of a marked tensor that
# an operator makes before saving (they are new tensor objects without the attribute).
_marked_storages: dict[int, weakref.ref] = {}


def mark_not_movable(t: torch.Tensor) -> torch.Tensor:
    """Keep ``t`` (and every view of its storage) where it is: no stash, offload or swap
    moves it. Returns ``t``.

    Args:
        t: any tensor, on any device.

    Example::

        routing = graphstash.mark_not_movable(torch.empty(budget, 8, device="cuda"))
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
    """Whether ``t`` or a tensor sharing its storage was passed to :func:`mark_not_movable`."""
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


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter, a leaf that requires grad, or a view of one: alive anyway, never moved."""
    base = t._base
    return (isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)
            or (t.is_leaf and t.requires_grad)
            or (base is not None and base.is_leaf and base.requires_grad))


def movable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a saved tensor may move at all: a plain strided tensor on ``device`` with
    elements, no parameter (:func:`is_parameter`) and not marked (:func:`is_marked`)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device == device
            and t.numel() > 0 and not is_parameter(t) and not is_marked(t))
