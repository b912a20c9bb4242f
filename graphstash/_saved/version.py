"""Autograd's in-place check, for tensors packed by saved-tensor hooks.

NOTE [in-place check]: autograd compares a saved tensor's version counter at unpack only when
no saved-tensor hooks are installed, so under stash, offload or swap an in-place write to a
saved activation would silently produce wrong gradients. Every pack records
``tensor._version`` and a weak reference to the tensor (:class:`SavedVersion`); the policy
compares them again before it copies the tensor (a write between save and copy would be
copied too) and at unpack (a write after the copy). A weak reference that died means nothing
can write the tensor any more, since views keep their base alive.
"""
from __future__ import annotations

import weakref

import torch

from .._checks import describe
from ..errors import SavedTensorModifiedError


class SavedVersion:
    """A saved tensor's version counter at pack time, and a weak reference to the tensor.

    Args:
        t: the tensor autograd saves (any shape, dtype, device).

    Example::

        saved = SavedVersion(t)
        ...
        saved.check("at unpack")      # raises SavedTensorModifiedError after t.add_(1)
    """

    __slots__ = ("ref", "version")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)
        self.version = t._version

    def check(self, where: str, held: torch.Tensor | None = None) -> None:
        """Raise :class:`SavedTensorModifiedError` if the tensor was modified in place;
        ``where`` says when it is checked ("before its copy to host"). ``held``: a tensor
        sharing the saved one's version counter (its ``detach()``) that the policy keeps."""
        t = self.ref() if held is None else held
        if t is not None and t._version != self.version:
            raise SavedTensorModifiedError(
                f"a tensor saved for backward ({describe(t)}) was modified in place after it "
                f"was saved ({where}): version {self.version} at save, {t._version} now. "
                "Backward would use stale values (plain autograd raises here too); clone the "
                "tensor before modifying it, or modify a copy")


# NOTE [detached references]: what a pack hook returns is stored in the autograd node that
# saved the tensor. Keeping the tensor itself there would keep its history alive from its own
# node (for a saved output: node -> packed object -> tensor -> grad_fn -> node, a reference
# cycle only Python's cyclic collector frees, at an arbitrary point of a later step). Policies
# keep ``t.detach()`` instead: the same storage and version counter, no history; autograd
# attaches the grad_fn backward needs to whatever the unpack hook returns.

class Kept:
    """What autograd stores for a saved tensor a policy leaves where it is: the tensor
    (NOTE [detached references]) and its version (NOTE [in-place check]).

    Args:
        t: the saved tensor (any shape, dtype, device).
    """

    __slots__ = ("tensor", "saved")

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach()             # NOTE [detached references]
        self.saved = SavedVersion(t)

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.saved.version:
            self.saved.check("it stayed on the device", held=self.tensor)
        return self.tensor
