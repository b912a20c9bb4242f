"""``stash_activations``: the context that routes autograd's saved tensors through a manager."""
from __future__ import annotations

import torch

from .. import _kernels
from .._checks import COUNT_DTYPES, describe
from .._mode import is_dropless
from .._saved import HookContext, innermost
from .._untraced import untraced
from ._group import Group, Scope
from .manager import StashManager, current_default


def _open_group_context() -> HookContext | None:
    """The hook context of the enclosing ``stash_activations`` (its payload: the group)."""
    top = innermost()
    return top if top is not None and isinstance(top.payload, Group) else None


def current_manager() -> StashManager | None:
    """The manager ``stash_activations`` uses when none is passed: the innermost
    ``with manager:``, else the manager of the enclosing ``stash_activations``, else None."""
    manager = current_default()
    if manager is None:
        outer = _open_group_context()
        if outer is not None:
            manager = outer.owner
    return manager


def require_zero_tail(what: str) -> None:
    """Declare that the op being recorded has a backward that reads the rows past the live
    counts (``what`` names it, e.g. ``"grouped_mm's masked dense fallback"``).

    Inside ``stash_activations(..., zero_tail=False)`` this raises ValueError naming
    ``zero_tail``: a reload would leave those rows unwritten and that backward would read
    garbage (NaN gradients, NOTE [padding rows] in ``scheduler.py``). Anywhere else it does
    nothing. Ops whose backward may touch padding rows call it before saving their inputs.

    Example::

        if impl == "masked":
            graphstash.stash.require_zero_tail("grouped_mm's masked dense fallback")
    """
    outer = _open_group_context()
    if outer is not None and outer.payload.scopes and not outer.payload.scopes[-1].zero_tail:
        raise ValueError(
            f"zero_tail: stash_activations group {outer.payload.label} was entered with "
            f"zero_tail=False, but {what} reads the rows past the counts in its backward; "
            "pass zero_tail=True (the default) around it")


class stash_activations:
    """Stash the budget-shaped tensors autograd saves inside this context (one layer group).

    Tensors saved for backward inside the context whose leading dimension is the budget
    (``[budget, ...]`` rows, or ``[S, cap, ...]`` segments when ``num_tokens`` has shape
    ``(S,)``) are copied, live rows only, into the manager's paged buffers on its pack stream
    when the context exits, and reloaded on its unpack stream before their backward.
    Parameters, leaf tensors that require grad, tensors smaller than
    ``StashConfig.min_tensor_bytes``, non-contiguous ones, ones on another device and ones
    marked with :func:`graphstash.mark_not_movable` are left to autograd. In dropless mode
    (:func:`graphstash.dropless`) the context does nothing at all.

    Args:
        num_tokens: int32/int64 ``(1,)`` (rows) or ``(S,)`` (rows per segment) tensor on the
            manager's device: the live rows. Read on the device only (no sync), except in a
            warmup step before the buffers are sized (NOTE [warmup sizing]).
        manager: the :class:`StashManager` (default: :func:`current_manager`).
        name: label of the group in the recorded schedule and in error messages.
        max_tokens: the budget (rows, or rows per segment); default: inferred (NOTE [budget]
            in ``graphstash/stash/plan.py``).
        zero_tail: reloads write zeros into the rows past the counts (default), so no
            backward sees stale memory there (NOTE [padding rows]). ``False`` skips those
            writes (less memory traffic); pass it only when no backward reads the rows past
            the counts, e.g. expert GEMMs bounded by per-expert offsets.

    Contexts of the same manager may nest: the inner one's tensors belong to the outer group
    but go with the inner ``num_tokens``. Nesting it inside (or around) a context of another
    manager, an ``ActivationOffloader`` or a swap scope raises
    :class:`~graphstash.errors.SavedTensorsError` (NOTE [one hook context] in
    ``graphstash/_saved/registry.py``).

    Example::

        manager = graphstash.StashManager()
        counts = torch.empty(1, dtype=torch.int32, device="cuda")     # written by dispatch
        with graphstash.stash_activations(counts, manager=manager, name="layer3.experts"):
            y = expert_mlp(dispatched)        # dispatched: [budget, hidden]
    """

    def __init__(self, num_tokens, *, manager: StashManager | None = None,
                 name: str | None = None, max_tokens: int | None = None,
                 zero_tail: bool = True):
        self._num_tokens = num_tokens
        self._manager = manager
        self._name = name
        self._max_tokens = max_tokens
        self._zero_tail = zero_tail
        self._entered = False
        self._noop = False
        self._hooks: HookContext | None = None    # set on the outermost context
        self._group = None
        self._scope = None

    @untraced                       # NOTE [untraced machinery]
    def __enter__(self) -> "stash_activations":
        if self._entered:
            raise RuntimeError("stash_activations: a context object can be entered only once")
        self._entered = True
        if is_dropless():
            self._noop = True
            return self
        manager = self._manager if self._manager is not None else current_manager()
        if manager is None:
            raise ValueError("manager: no StashManager was passed and none is current; pass "
                             "manager=... or enter `with manager:` first")
        if not isinstance(manager, StashManager):
            raise TypeError(f"manager: expected a graphstash.StashManager, got "
                            f"{type(manager).__name__}")
        self._check_args(manager)
        scope = Scope(self._num_tokens, self._max_tokens, self._zero_tail)
        outer = _open_group_context()
        if outer is not None and outer.owner is manager:
            group = outer.payload           # same manager: the outer group, inner counts
        else:
            name = "unnamed" if self._name is None else repr(self._name)
            scheduler = manager.scheduler
            hooks = HookContext(manager, f"stash_activations {name} (StashManager at "
                                f"{id(manager):#x})", lambda t: scheduler.pack(group, t),
                                scheduler.unpack)
            hooks.__enter__()               # refuses any other open context
            try:
                group = scheduler.open_group(self._name)
            except BaseException:
                hooks.__exit__(None, None, None)
                raise
            hooks.payload = group
            self._hooks = hooks
        group.scopes.append(scope)
        group.all_scopes.append(scope)
        self._group, self._scope, self._manager = group, scope, manager
        return self

    @untraced
    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._noop:
            return False
        self._group.scopes.pop()
        if self._hooks is not None:
            self._hooks.__exit__(exc_type, exc, tb)
            self._manager.scheduler.close_group(self._group, ok=exc_type is None)
        return False

    def _check_args(self, manager: StashManager) -> None:
        n = self._num_tokens
        where = "CUDA" if manager.device.type == "cuda" else str(manager.device)
        expected = f"an int32 or int64 {where} tensor of shape (1,) or (S,)"
        if not isinstance(n, torch.Tensor):
            raise TypeError(f"num_tokens: expected {expected}, got {type(n).__name__}")
        if n.dtype not in COUNT_DTYPES or n.device != manager.device:
            raise TypeError(f"num_tokens: expected {expected}, got {n.dtype} on {n.device}"
                            + (f" (the manager's device is {manager.device})"
                               if n.device.type == manager.device.type else ""))
        if n.dim() != 1 or n.shape[0] < 1 or n.shape[0] > _kernels.MAX_SEGMENTS:
            raise ValueError(f"num_tokens: expected {expected} with 1 <= S <= "
                             f"{_kernels.MAX_SEGMENTS}, got {describe(n)}")
        if not n.is_contiguous():
            raise ValueError(f"num_tokens: expected a contiguous tensor, got strides {n.stride()}")
        if not isinstance(self._zero_tail, bool):
            raise TypeError(f"zero_tail: expected a bool, got {type(self._zero_tail).__name__}")
        if self._name is not None and not isinstance(self._name, str):
            raise TypeError(f"name: expected a str or None, got {type(self._name).__name__}")
        m = self._max_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise (TypeError if not isinstance(m, int) or isinstance(m, bool) else ValueError)(
                f"max_tokens: expected an int > 0 or None, got {m!r}")
