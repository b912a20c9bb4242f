"""The saved-tensor core under stash, offload and swap.

Stashing (:mod:`graphstash.stash`), activation offload (:mod:`graphstash.offload`) and tensor
swap (:mod:`graphstash.swap`) are three *policies* for the tensors autograd saves for
backward: which of them move, where to, and when they come back. What they share lives here,
once:

- :mod:`.registry`: the one saved-tensor hook context of a thread and its nesting rule
  (NOTE [one hook context]);
- :mod:`.select`: which saved tensors may move at all, and the one opt-out mark
  (:func:`mark_not_movable`);
- :mod:`.version`: autograd's in-place check, which saved-tensor hooks switch off
  (NOTE [in-place check]);
- :mod:`.streams`: side streams forked from and joined to the compute stream, with events
  that respect the capture boundary (NOTE [side streams]);
- :mod:`.retire`: originals kept alive until their copy is done and dropped at the next
  schedule point (NOTE [retire at the schedule point]).

Nothing here touches the GPU at import time; nothing here knows about pages, hosts or layers.
"""
from __future__ import annotations

from .registry import HookContext, ThreadStack, innermost, thread_stack
from .retire import RetireQueue
from .select import is_marked, is_parameter, mark_not_movable, movable
from .streams import Mark, SideStream
from .version import Kept, SavedVersion

__all__ = ["HookContext", "Kept", "Mark", "RetireQueue", "SavedVersion", "SideStream",
           "ThreadStack", "innermost", "is_marked", "is_parameter", "mark_not_movable", "movable",
           "thread_stack"]
