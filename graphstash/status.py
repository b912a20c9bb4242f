"""The step's status: one owner (:class:`StepStatus`) for the int32 ``[STATUS_SIZE]`` device
tensor that holds a step's sticky flags and high-water marks.

The layout is ``graphstash/_layout.py`` (mirrored by ``raw_kernels/gs_layout.cuh``):
``SS_OVERFLOW`` (bits: ``OVERFLOW_POOL`` a stash found no page, ``OVERFLOW_COUNT`` a count or
an expert index was out of range), ``SS_HOST_SPILL``, ``SS_OVER_BUDGET`` (a dispatch dropped
rows) and ``SS_TOKENS_PEAK`` (the most rows one stash or dispatch asked for). Kernels and
torch ops raise them on the device; the host reads them once per step.

A :class:`StepStatus` allocates the tensor, validates status arguments (:func:`check_status`,
the one validator), raises flags (:func:`raise_flag`, :func:`raise_peak`), reads them on the
host once (:meth:`StepStatus.read`, a pinned copy), clears them, says which step is current
(:func:`current`, NOTE [current step]) and combines the flags across ranks
(:meth:`StepStatus.reduced_flags`, NOTE [flags across ranks]). It also holds the step's
named high-water marks (NOTE [step peaks]): what each MoE layer needed this step, reduced
across ranks with the flags and handed to their owners (:class:`PeakOwner`) once the host
reads the flags. The public tensor stays what users pass around (``train_step.status``); its
owner is found with :meth:`StepStatus.of`.

Nothing here touches the GPU at import time.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from typing import Protocol, runtime_checkable

import torch

from . import _layout as L
from ._checks import describe, forbid_capture, is_capturing, normalize_device

__all__ = ["FLAG_NAMES", "FlagReducer", "MAX_STEP_PEAKS", "PeakOwner", "StepStatus",
           "check_status", "claim_peak_slot", "current",
           "default", "new_status", "raise_flag", "raise_peak", "reading_allowed",
           "resolve", "warn_at_call_site"]

# the three sticky flags that decide whether a step is trusted, in index order
FLAG_NAMES = ("overflow", "host_spill", "over_budget")
assert (L.SS_OVERFLOW, L.SS_HOST_SPILL, L.SS_OVER_BUDGET) == (0, 1, 2)   # one contiguous slice
_INT32_MAX = 2**31 - 1
# the most step peaks a process holds at once (NOTE [step peaks]); with the flags they must fit
# one exchange of a transport's flags (X_MAX_PEAKS in graphstash/moe/exchange/layout.py)
MAX_STEP_PEAKS = 1024


@runtime_checkable
class FlagReducer(Protocol):
    """What combines a step's flags across ranks (NOTE [flags across ranks]).

    ``all_reduce_flags_(flags, peaks=None)`` receives the int32 ``[n]`` flag indicators of
    this rank on the device and replaces them, in place, by their sum over every rank of the
    group; ``peaks`` (int32 ``[m]``, the step's named high-water marks, NOTE [step peaks]) is
    replaced by its maximum over the ranks in the same exchange. It must be capturable in a
    CUDA graph: no host read, no allocation that a graph cannot hold, launched on torch's
    current stream. An expert-parallel transport implements it so that a step whose exchange
    needs no NCCL needs none for its flags either. Example::

        class Transport:
            def all_reduce_flags_(self, flags, peaks=None) -> None:
                ...   # write both into every peer, wait for theirs, sum / max in place

        train_step.step_status.register_reducer(Transport())
    """

    def all_reduce_flags_(self, flags: torch.Tensor,
                          peaks: torch.Tensor | None = None) -> None: ...


@runtime_checkable
class PeakOwner(Protocol):
    """Who claimed step peaks (:func:`claim_peak_slot`, NOTE [step peaks]), and is told their
    values.

    ``observe(peaks, flagged=...)`` gets, on the host after every step that raised some of
    them, ``{key: value}`` of the owner's peaks raised in that step (the maximum over the step
    and over the ranks) and whether the step was flagged (overflow or over budget: it was
    rerun). ``version`` is an int that changes whenever something a captured graph baked in
    from the owner changed (a step recaptures when it differs from the one it captured with).
    ``state_dict()`` / ``load_state_dict(state)`` snapshot and restore it (a veto of
    ``on_overflow``)."""

    version: int

    def observe(self, peaks: dict, *, flagged: bool) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def new_status(device) -> torch.Tensor:
    """A zeroed int32 ``[STATUS_SIZE]`` status tensor on ``device`` (a ``torch.device`` or
    device string; ValueError naming ``device`` for CUDA without a GPU)."""
    return torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=normalize_device(device))


def check_status(name: str, status, device: torch.device) -> torch.Tensor:
    """Validate a status argument and return its tensor: a :class:`StepStatus`, or an int32
    tensor of shape ``(STATUS_SIZE,)`` on ``device``. TypeError/ValueError naming ``name``."""
    expected = f"an int32 tensor of shape ({L.STATUS_SIZE},) on {device} (or its StepStatus)"
    if isinstance(status, StepStatus):
        status = status.tensor
    if not isinstance(status, torch.Tensor):
        raise TypeError(f"{name}: expected {expected}, got {type(status).__name__}")
    if (status.dtype != torch.int32 or status.device != device
            or tuple(status.shape) != (L.STATUS_SIZE,)):
        raise ValueError(f"{name}: expected {expected}, got {describe(status)}")
    if not status.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {status.stride()}")
    return status


def raise_flag(status: torch.Tensor, index: int, flag: torch.Tensor) -> None:
    """``status[index] |= flag`` on the device (sticky; no host read, capturable).

    Args:
        status: int32 ``[STATUS_SIZE]`` status tensor.
        index: one of the ``SS_*`` indices of ``graphstash/_layout.py``.
        flag: bool or integer tensor of one element on the status's device; its value is
            OR-ed in (``OVERFLOW_*`` bits for ``SS_OVERFLOW``, 1 for the other flags).
    """
    status.narrow(0, index, 1).bitwise_or_(flag.reshape(1).to(torch.int32))


def raise_peak(status: torch.Tensor, index: int, value: torch.Tensor) -> None:
    """``status[index] = max(status[index], value)`` on the device, ``value`` clamped to the
    int32 range (a high-water mark; no host read, capturable).

    Args:
        status: int32 ``[STATUS_SIZE]`` status tensor.
        index: ``SS_TOKENS_PEAK``.
        value: integer tensor of one element on the status's device.
    """
    peak = status.narrow(0, index, 1)
    peak.copy_(torch.maximum(peak, value.reshape(1).clamp(max=_INT32_MAX).to(torch.int32)))


# NOTE [status owner]: the status tensor is public (``train_step.status``, ``status=`` of
# dispatch and grouped_mm, ``StashManager.status``), and several objects use one tensor (the
# graph step, its stash manager and every buffer of that manager). So the owner is looked up
# by the tensor's identity (:meth:`StepStatus.of`); :meth:`StepStatus.adopt` returns the
# existing owner of a tensor or makes one, so one tensor never has two owners with different
# reducers. The map holds the owners weakly, keyed by id(tensor): an owner holds its tensor,
# so while an entry lives its id names that tensor and no other; an owner nobody holds goes,
# and its tensor (if still referenced) gets a new owner when one is asked for.
_owners: "weakref.WeakValueDictionary[int, StepStatus]" = weakref.WeakValueDictionary()


class StepStatus:
    """The owner of one int32 ``[STATUS_SIZE]`` status tensor (NOTE [status owner]).

    Args:
        device: where the tensor lives (``torch.device`` or string; default: the current CUDA
            device, or the CPU without CUDA).

    Use :meth:`adopt` for a tensor that already exists. Example::

        status = StepStatus("cuda")
        permuted, counts, handle = dispatch(x, idx, w, E, budget=B, status=status.tensor)
        status.read()["over_budget"]        # one sync
    """

    def __init__(self, device=None):
        self._tensor = new_status(normalize_device(device))
        self._init()

    def _init(self) -> None:
        self._reducer: FlagReducer | None = None
        self._reducer_takes_peaks = False
        self._host: torch.Tensor | None = None        # pinned int32 copy (CUDA), made once
        # NOTE [step peaks]: made with the status, so no capture ever allocates them
        self._peaks = torch.full((MAX_STEP_PEAKS,), -1, dtype=torch.int32,
                                 device=self._tensor.device)
        self._peak_owners: dict = {}                  # id(owner) -> weakref, those delivered to
        self._first_versions: dict = {}               # id(owner) -> version before its first
        _owners[id(self._tensor)] = self

    @classmethod
    def adopt(cls, status) -> "StepStatus":
        """The owner of ``status`` (an int32 ``[STATUS_SIZE]`` tensor, or a StepStatus,
        returned as it is): the existing one, or a new owner of that very tensor."""
        if isinstance(status, StepStatus):
            return status
        if isinstance(status, torch.Tensor):
            owner = _owners.get(id(status))
            if owner is not None:
                return owner
        tensor = check_status("status", status,
                              status.device if isinstance(status, torch.Tensor) else None)
        owner = cls.__new__(cls)
        owner._tensor = tensor
        owner._init()
        return owner

    @classmethod
    def of(cls, status: torch.Tensor) -> "StepStatus | None":
        """The owner of the tensor ``status``, or None if it has none yet."""
        return _owners.get(id(status)) if isinstance(status, torch.Tensor) else None

    # ---- the tensor -------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The int32 ``[STATUS_SIZE]`` device tensor (what kernels and ``status=`` take)."""
        return self._tensor

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    def flags(self) -> torch.Tensor:
        """int32 ``[3]`` view of the sticky flags: overflow, host spill, over budget."""
        return self._tensor[L.SS_OVERFLOW: L.SS_OVER_BUDGET + 1]

    def raise_flag(self, index: int, flag: torch.Tensor) -> None:
        """:func:`raise_flag` on this status."""
        raise_flag(self._tensor, index, flag)

    def raise_peak(self, index: int, value: torch.Tensor) -> None:
        """:func:`raise_peak` on this status."""
        raise_peak(self._tensor, index, value)

    def clear_flags(self) -> None:
        """Zero the sticky flags and unraise the step peaks (not the status's high-water
        marks); capturable."""
        with torch.no_grad():
            self.flags().zero_()
            self._peaks.fill_(-1)

    def clear(self) -> None:
        """Zero the flags and the high-water marks, unraise the step peaks; capturable."""
        with torch.no_grad():
            self._tensor.zero_()
            self._peaks.fill_(-1)

    # ---- the step peaks -------------------------------------------------------------------
    @property
    def peaks(self) -> torch.Tensor:
        """int32 ``[MAX_STEP_PEAKS]``: every slot's peak this step, -1 where none was raised
        (NOTE [step peaks]); :func:`raise_peak` writes a slot, capturable. A step reduces and
        copies every slot, claimed or not, so what it does never changes with the objects
        other code makes or frees."""
        return self._peaks

    def owner_versions(self) -> dict:
        """``{id(owner): (version now, version before its first delivery here)}`` of every
        owner this status handed peaks to: what a step compares with what its graphs (and
        compiled code) baked in (NOTE [budgets the step adapts])."""
        out = {}
        for key, ref in self._peak_owners.items():
            owner = ref()
            if owner is not None:
                out[key] = (owner.version, self._first_versions[key])
        return out

    def raised_peaks(self, values) -> list:
        """``[(owner, {key: value})]`` of the peaks raised in ``values`` (the reduced
        :attr:`peaks` on the host, slot order; -1: not raised this step)."""
        by_owner: dict = {}
        values = list(values)
        for slot in range(min(len(values), len(_SLOTS))):
            value = values[slot]
            if value < 0:
                continue
            claim = _SLOTS[slot]
            owner = claim[0]() if claim is not None else None
            if owner is not None:
                by_owner.setdefault(id(owner), (owner, {}))[1][claim[1]] = int(value)
        return list(by_owner.values())

    def deliver_peaks(self, values, *, flagged: bool) -> None:
        """Hand each owner its raised peaks (:meth:`raised_peaks` of ``values``); ``flagged``:
        the step was rerun."""
        for owner, peaks in self.raised_peaks(values):
            known = self._peak_owners.get(id(owner))
            if known is None or known() is not owner:
                self._peak_owners[id(owner)] = weakref.ref(owner)
                self._first_versions[id(owner)] = owner.version
            owner.observe(peaks, flagged=flagged)

    # ---- the host ---------------------------------------------------------------------
    def read(self) -> dict:
        """The status on the host: one copy through pinned memory and one sync.

        Returns ``{"overflow": int (the OVERFLOW_* bits), "host_spill": bool, "over_budget":
        bool, "tokens_peak": int}``. Not capturable (CaptureError while a stream captures).
        """
        forbid_capture("StepStatus.read()")
        if self._tensor.is_cuda:
            if self._host is None:
                self._host = torch.empty(L.STATUS_SIZE, dtype=torch.int32, pin_memory=True)
            self._host.copy_(self._tensor, non_blocking=True)
            torch.cuda.current_stream(self._tensor.device).synchronize()
            values = self._host.tolist()
        else:
            values = self._tensor.tolist()
        return {"overflow": values[L.SS_OVERFLOW], "host_spill": bool(values[L.SS_HOST_SPILL]),
                "over_budget": bool(values[L.SS_OVER_BUDGET]),
                "tokens_peak": values[L.SS_TOKENS_PEAK]}

    # ---- ranks ------------------------------------------------------------------------
    # NOTE [flags across ranks]: every rank must take the same branch (replay trusted, or skip
    # the update and rerun dropless), so the flags are summed over the ranks on the device
    # before anyone looks at them. Who sums them: a FlagReducer registered on the step's
    # status (an expert-parallel transport: the flags travel the way the rows do, so a
    # transport that needs no NCCL brings none in), else torch.distributed.all_reduce over the
    # step's process group when torch.distributed is initialised, else nobody (one rank).
    @property
    def reducer(self) -> FlagReducer | None:
        """The registered :class:`FlagReducer`, or None."""
        return self._reducer

    def register_reducer(self, reducer: FlagReducer | None) -> None:
        """Combine this status's flags across ranks through ``reducer`` (NOTE [flags across
        ranks]); None unregisters. Registering the same object again does nothing; another
        one while one is registered raises ValueError (unregister it first)."""
        if reducer is not None and not isinstance(reducer, FlagReducer):
            raise TypeError(f"reducer: expected an object with all_reduce_flags_(flags) (a "
                            f"graphstash.status.FlagReducer) or None, got "
                            f"{type(reducer).__name__}")
        if reducer is not None and self._reducer is not None and reducer is not self._reducer:
            raise ValueError(f"reducer: this status already combines its flags through "
                             f"{self._reducer!r}; call register_reducer(None) first to replace "
                             f"it with {reducer!r}")
        self._reducer = reducer
        self._reducer_takes_peaks = reducer is not None and _takes_peaks(reducer)

    def reduced_flags(self, *, distributed: bool | str = "auto", process_group=None
                      ) -> torch.Tensor:
        """int32 ``[3 + MAX_STEP_PEAKS]`` on the device: indicators (0/1) of overflow, host
        spill and over budget, summed over the ranks (NOTE [flags across ranks]), then the step
        peaks, their maximum over the ranks (NOTE [step peaks]; -1 where none was raised).
        Capturable, no host read.

        Args:
            distributed: False: this rank's flags only. ``"auto"``: combine them through the
                registered reducer, else ``all_reduce`` when torch.distributed is initialised.
                True: the same, and without a reducer torch.distributed must be initialised
                (ValueError naming ``distributed`` otherwise). As ``graph_step`` takes it.
            process_group: the group ``all_reduce`` uses (default: the world).
        """
        out = torch.empty(3 + MAX_STEP_PEAKS, dtype=torch.int32, device=self.device)
        flags, peaks = out[:3], out[3:]
        flags.copy_(self.flags() != 0)                 # indicators, 0 / 1
        peaks.copy_(self._peaks)
        if distributed is False:
            return out
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        if self._reducer is not None:
            if self._reducer_takes_peaks:
                self._reducer.all_reduce_flags_(flags, peaks=peaks)
                return out
            self._reducer.all_reduce_flags_(flags)
            if on:              # a reducer of flags only: the peaks through torch.distributed
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=process_group)
            return out
        if distributed is True and not on:
            raise ValueError("distributed: True, but torch.distributed is not initialised and "
                             "no FlagReducer is registered on the step's status")
        if on:
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=process_group)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=process_group)
        return out

    # ---- the current step -------------------------------------------------------------
    @contextlib.contextmanager
    def activate(self):
        """Make this the current status of the thread inside the block (NOTE [current step])."""
        stack = _stack()
        stack.append(self)
        try:
            yield self
        finally:
            # like saved_tensors_hooks: leave no stale entry behind even out of order
            if stack and stack[-1] is self:
                stack.pop()
            elif self in stack:
                del stack[len(stack) - 1 - stack[::-1].index(self)]

    def __repr__(self) -> str:
        return f"StepStatus(device={self.device}, reducer={self._reducer!r})"


# NOTE [current step]: while a graph_step runs its function (warmup, capture, the eager
# rerun), its status is current for the thread, and so is a StashManager's inside `with
# manager:`. Code that raises device flags and was given no status (dispatch, grouped_mm,
# expert_mlp) takes the current one, so an over-budget dispatch reaches the step that must
# rerun, or the manager whose end_step() reports it, without the user passing status=
# through their model. Contexts may nest; the innermost one wins, and one on another device
# than the tensors is not used. With none current, :func:`default` gives a status per device
# (NOTE [eager over budget] in graphstash/moe/_dispatch.py says who reads that one).
class _CurrentState(threading.local):
    """The thread's stack of current statuses, there (empty) from the first access, so code
    torch.compile traces reads it without a ``hasattr`` guard (NOTE [state read by traced
    code] in ``graphstash/_mode.py``)."""

    def __init__(self):
        self.stack = []


_state = _CurrentState()


def _stack() -> list:
    return _state.stack


def current(device=None) -> StepStatus | None:
    """The innermost current status (NOTE [current step]), or None when there is none or
    (with ``device``) when it lives on another device."""
    stack = _state.stack
    if not stack:
        return None
    owner = stack[-1]
    if device is not None and owner.device != device:
        return None
    return owner


# the per-device defaults: plain tensors, so that code torch.compile traces can create and
# use one (an owner is made outside such code, by default())
_default_tensors: dict[torch.device, torch.Tensor] = {}
_default_owners: dict[torch.device, StepStatus] = {}


def _default_tensor(device: torch.device) -> torch.Tensor:
    tensor = _default_tensors.get(device)
    if tensor is None:
        tensor = _default_tensors[device] = torch.zeros(L.STATUS_SIZE, dtype=torch.int32,
                                                        device=device)
    return tensor


def default(device) -> StepStatus:
    """The status of ``device`` used when none was given and none is current: one per device
    for the process (NOTE [current step]). ``device`` as :func:`new_status` takes it."""
    device = normalize_device(device)
    owner = _default_owners.get(device)
    if owner is None:
        owner = _default_owners[device] = StepStatus.adopt(_default_tensor(device))
    return owner


def resolve(status, device: torch.device, name: str = "status") -> tuple[torch.Tensor, str]:
    """The status tensor a call on ``device`` raises its flags in, and where it came from.

    ``status`` given (a tensor or a StepStatus): validated (:func:`check_status`), returned
    with ``"given"``. None: the current status (``"current"``), else the device's default
    (``"default"``): nobody reads that one for the caller (NOTE [eager over budget]).
    """
    if status is not None:
        return check_status(name, status, device), "given"
    owner = current(device)
    if owner is not None:
        return owner.tensor, "current"
    return _default_tensor(device), "default"


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def warn_at_call_site(message: str, category=RuntimeWarning) -> None:
    """Warn ``message`` attributed to the innermost frame outside graphstash and torch (the
    user's line that called into them), so the default warning filter shows it once per call
    site (as ``warnings.warn`` with the right ``stacklevel`` would)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_PACKAGE_DIR + os.sep) or path.startswith(_TORCH_DIR + os.sep)):
            break
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=registry,
                           module_globals=frame.f_globals)


def reading_allowed() -> bool:
    """Whether a host read of a device flag may happen here: not while a CUDA stream captures
    nor while torch.compile traces."""
    # is_compiling first: while torch.compile traces, the capture query is never traced
    return not torch.compiler.is_compiling() and not is_capturing()


# NOTE [step peaks]: an MoE layer knows on the device how many rows its dispatch asked for; the
# budget that adapts to it (graphstash.moe.DispatchBudgets) must learn it on the host without
# a host read of its own. So the layer claims a slot once, on the host (:func:`claim_peak_slot`;
# slots are the process's, so the traced and captured code only indexes a tensor with a
# constant), and each step raises it on the device in the current step's status (a max into
# ``StepStatus.peaks``, capturable, traceable by torch.compile whole). The step that owns the
# status unraises the peaks (-1) with its flags, reduces them across ranks in the exchange of
# its flags (the maximum; the flags are summed), copies them to the host with the flags (the
# one read a step already makes) and hands each owner the peaks raised that step
# (:meth:`StepStatus.deliver_peaks`). A slot is freed when its owner is collected.
_SLOTS: list = []                 # slot -> (weakref to the owner, key) or None (free)


def _takes_peaks(reducer) -> bool:
    """Whether ``reducer.all_reduce_flags_`` takes ``peaks=`` (a FlagReducer written before
    the step peaks takes the flags only)."""
    import inspect

    try:
        params = inspect.signature(reducer.all_reduce_flags_).parameters
    except (TypeError, ValueError):
        return False
    return "peaks" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def claim_peak_slot(owner: PeakOwner, key) -> int:
    """A free slot of the step peaks for ``owner``'s peak named ``key`` (NOTE [step peaks]),
    held until ``owner`` is collected. ValueError past :data:`MAX_STEP_PEAKS` live slots."""
    if not isinstance(owner, PeakOwner):
        raise TypeError(f"owner: expected a graphstash.status.PeakOwner, got "
                        f"{type(owner).__name__}")
    try:
        slot = _SLOTS.index(None)
    except ValueError:
        slot = len(_SLOTS)
        if slot >= MAX_STEP_PEAKS:
            raise ValueError(f"key: a process holds at most {MAX_STEP_PEAKS} step peaks at once "
                             f"(adaptive budgets of MoE layers); {key!r} would be one more") \
                from None
        _SLOTS.append(None)
    _SLOTS[slot] = (weakref.ref(owner), key)
    weakref.finalize(owner, _free_slot, slot, _SLOTS[slot])
    return slot


def _free_slot(slot: int, claim) -> None:
    if slot < len(_SLOTS) and _SLOTS[slot] is claim:
        _SLOTS[slot] = None
