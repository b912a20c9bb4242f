"""The one saved-tensor hook context of a thread (NOTE [one hook context]).

NOTE [one hook context]: autograd uses only the innermost ``saved_tensors_hooks``, so a
graphstash context opened inside another one (an offload scope inside a swap scope, a
``stash_activations`` inside ``ActivationOffloader.group()``, or two of a kind with different
owners) would silently take the outer one's tensors. Every graphstash context therefore
registers here, in one stack per thread, and entering one while another is open raises
:class:`~graphstash.errors.SavedTensorsError` naming both. The one sanctioned nesting is a
policy's own: ``stash_activations`` of the same manager nest inside each other without a
second hook context (the inner one only changes the counts; see :func:`innermost`). Exits
must come in the reverse order of the entries, as ``saved_tensors_hooks`` demands.
"""
from __future__ import annotations

import threading

import torch

from .._untraced import untraced
from ..errors import SavedTensorsError


class ThreadStack(threading.local):
    """A ``stack`` list per thread, there (empty) from the thread's first access: code that
    torch.compile traces reads it without a ``hasattr`` guard that would flip after the first
    call (NOTE [state read by traced code] in ``graphstash/_mode.py``)."""

    def __init__(self):
        self.stack = []


_tls = ThreadStack()


def thread_stack(local: threading.local) -> list:
    """The list ``local.stack`` of the calling thread (created empty on first use)."""
    stack = getattr(local, "stack", None)
    if stack is None:
        stack = local.stack = []
    return stack


def _stack() -> list:
    return thread_stack(_tls)


def innermost() -> "HookContext | None":
    """The innermost open graphstash hook context of this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


class HookContext:
    """Saved-tensor hooks of one graphstash context, registered in the thread's one stack.

    Args:
        owner: the object whose policy packs and unpacks (a manager, offloader, swapper).
        description: how errors name the context ("swap scope 'layers.*'").
        pack, unpack: the ``saved_tensors_hooks`` pair.
        payload: whatever the policy wants to find again through :func:`innermost`.

    Example::

        with HookContext(self, "my scope", self._pack, self._unpack):
            y = f(x)
    """

    __slots__ = ("owner", "description", "payload", "_hooks")

    def __init__(self, owner, description: str, pack, unpack, payload=None):
        self.owner = owner
        self.description = description
        self.payload = payload
        # torch.compile runs the hooks, never traces them (NOTE [untraced machinery])
        self._hooks = torch.autograd.graph.saved_tensors_hooks(untraced(pack), untraced(unpack))

    def __enter__(self) -> "HookContext":
        stack = _stack()
        if stack:
            raise SavedTensorsError(
                f"{self.description} entered inside {stack[-1].description}: graphstash "
                "saved-tensor contexts (stash_activations, ActivationOffloader, swap scopes) do "
                "not nest (autograd would route saved tensors to the inner one only); close the "
                "outer context first")
        self._hooks.__enter__()
        stack.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack = _stack()
        if not stack or stack[-1] is not self:
            top = stack[-1].description if stack else "nothing"
            raise SavedTensorsError(
                f"{self.description} exited while the innermost open context is {top}: "
                "contexts must be exited in the reverse order they were entered")
        stack.pop()
        self._hooks.__exit__(exc_type, exc, tb)
        return False
