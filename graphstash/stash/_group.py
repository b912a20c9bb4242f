"""Per-step bookkeeping of a layer group: the tensors autograd saved inside one
``stash_activations`` context and where each of them is (held, stashed, reloaded)."""
from __future__ import annotations

import torch

from .._saved import SavedVersion


class Scope:
    """One ``stash_activations`` context: the live-row counts its saved tensors go with.

    ``num_tokens`` is an int32/int64 ``(S,)`` tensor on the manager's device; ``max_tokens``
    pins the budget (rows, or rows per segment) or is ``None`` (inferred; NOTE [budget]);
    ``zero_tail`` says whether reloads zero the rows past the counts (NOTE [padding rows]).
    """

    __slots__ = ("num_tokens", "segments", "max_tokens", "zero_tail", "snapshot", "counts_host")

    def __init__(self, num_tokens: torch.Tensor, max_tokens: int | None, zero_tail: bool = True):
        self.num_tokens = num_tokens
        self.segments = num_tokens.shape[0]
        self.max_tokens = max_tokens
        self.zero_tail = zero_tail
        self.snapshot = None        # clone of num_tokens taken when the group's stash is issued
        self.counts_host = None     # counts read back in a warmup step (NOTE [warmup sizing])


class Entry:
    """What the pack hook returns for a candidate tensor; the unpack hook gets it back.

    ``tensor`` holds the original (detached: NOTE [detached references]) until its stash
    completed (NOTE [pre-schedule]) or for good when it is kept; ``saved`` its version at
    pack time (NOTE [in-place check]); ``handle`` is its :class:`PagedTensor` between stash
    and reload; ``out`` the reloaded tensor, referenced for as long as autograd holds this
    entry.
    """

    __slots__ = ("group", "tensor", "saved", "scope", "shape", "dtype", "layout", "key", "handle",
                 "out", "stashed", "unpacked", "record_len")

    def __init__(self, group: "Group", tensor: torch.Tensor, scope: Scope):
        self.group = group
        self.tensor = tensor.detach()
        self.saved = SavedVersion(tensor)
        self.scope = scope
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.layout = None          # (S, cap, width) once classified as budget-shaped
        self.key = None             # (dtype, width): the buffer it goes to
        self.handle = None
        self.out = None
        self.stashed = False
        self.unpacked = False
        self.record_len = 0

    def __del__(self):
        # Autograd dropped this saved tensor (its node ran and released it; NOTE [prefetch]).
        group = self.group
        if group is not None and group.alive > 0:
            group.alive -= 1
            if group.alive == 0:
                group.scheduler.group_released(group)

    def stash_view(self) -> torch.Tensor:
        S, cap, width = self.layout
        return self.tensor.view(cap, width) if S == 1 else self.tensor.view(S, cap, width)

    def reload_shape(self) -> tuple:
        S, cap, width = self.layout
        return (cap, width) if S == 1 else (S, cap, width)


class Group:
    """A layer group: the saved tensors of one outermost ``stash_activations`` context."""

    def __init__(self, scheduler, gid: int, name: str | None, ring_generation: int, step: int):
        self.scheduler = scheduler          # the GroupScheduler (scheduler.py) that opened it
        self.gid = gid
        self.name = name
        self.ring_generation = ring_generation
        self.step = step
        self.scopes: list[Scope] = []       # open scopes, innermost last
        self.all_scopes: list[Scope] = []
        self.entries: list[Entry] | None = []
        self.dedup: dict | None = {}
        self.tracked = False                # has entries: appears in the schedule
        self.remaining = 0                  # entries not unpacked yet
        self.alive = 0                      # entries autograd has not released yet
        self.has_stash = False
        self.reload_issued = False
        self.reload_mark = None             # the reload's event on the unpack stream
        self.reload_waited: set[int] = set()
        self.lent_keys: list | None = None  # buffers whose lent pages it took (NOTE [pages per group])
        self.backward_started = False
        self.f_index: int | None = None
        self.b_index: int | None = None
        self.demand: dict = {}              # key -> (pages, record entries) in warmup steps
        self.plan_bytes: dict = {}          # key -> (budget bytes, live bytes) in warmup steps
        self.rows_peak = 0                  # the most live rows (per segment) measured

    @property
    def label(self) -> str:
        return repr(self.name) if self.name is not None else f"#{self.gid}"

    def retire(self) -> None:
        """Drop the originals of stashed entries and the count snapshots (stash completed)."""
        if self.entries is not None:
            for e in self.entries:
                if e.stashed:
                    e.tensor = None
        for scope in self.all_scopes:
            scope.snapshot = None
