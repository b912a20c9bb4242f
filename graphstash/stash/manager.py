"""``StashManager``: the public face of the paged stash. It owns the status tensor and puts
together the buffers and their sizing (``buffers.py``, with the stash plan of ``plan.py``) and
the scheduler of layer groups, streams, stash, reload and prefetch (``scheduler.py``), which
``stash_activations`` drives. The design notes live beside the code they describe: NOTE
[warmup sizing] in ``buffers.py``; [stash plan], [last group kept] and [budget] in
``plan.py``; [pre-schedule], [prefetch], [padding rows], [copy blocks], [entry cycle] and
[capture] in ``scheduler.py``.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import torch

from .. import _kernels
from .. import _layout as L
from .._checks import describe, forbid_capture, is_capturing, normalize_device
from .._saved import ThreadStack, thread_stack
from ..errors import OverBudgetError, SavedTensorsError, StashOverflowError
from ..status import StepStatus, claim_peak_slot, raise_peak
from .buffers import StashBuffers
from .config import StashConfig
from .scheduler import GroupScheduler
from .trace import StashTrace

EAGER_OVERFLOW = ("raise", "warn")
GROW_AHEAD = 0.97   # NOTE [stash growth ahead] in graphstash/graph/_step.py: the fill that grows it
NEED_HEADROOM = 1.1  # NOTE [growth to the need] in plan.py: rows kept over the rows asked for

_defaults = ThreadStack()      # .stack: the `with manager:` blocks of this thread


def _default_stack() -> list:
    return thread_stack(_defaults)


class StashManager:
    """Owns the paged stash buffers (one per layer group, dtype and row width, or per dtype
    and row width: ``StashConfig.pool``), a pack stream, an unpack stream and the status
    tensor shared by all its buffers; drives ``stash_activations``.

    Args:
        config: a :class:`StashConfig` (default: ``StashConfig()``).
        device: where the stashed tensors live (default: the current CUDA device, or the CPU
            when torch sees no GPU; the CPU runs the reference backend without streams).
        status: optional int32 ``[8]`` status tensor on ``device`` to share, or its
            :class:`~graphstash.status.StepStatus` (the graph manager passes one so MoE
            over-budget and stash flags live in one tensor).
        eager_overflow: what :meth:`end_step` does when the step overflowed or a MoE dispatch
            inside ``with manager:`` went over its budget (NOTE [eager overflow]): ``"raise"``
            :class:`~graphstash.errors.StashOverflowError` /
            :class:`~graphstash.errors.OverBudgetError` (default) or ``"warn"`` (a
            ``RuntimeWarning``).

    The manager is what :func:`graphstash.graph_step` drives through ``stash=`` (NOTE [step
    protocol] in ``graphstash/graph/protocol.py``).

    Example::

        manager = graphstash.StashManager(graphstash.StashConfig(page_size=64))
        for batch in loader:
            manager.begin_step()
            with manager:
                loss = model(batch)      # expert blocks run inside stash_activations(count)
                loss.backward()
            try:
                manager.end_step()
            except graphstash.StashOverflowError:
                ...                      # the step is untrusted: rerun it dropless, grow
                manager.clear_status()
    """

    def __init__(self, config: StashConfig | None = None, *, device=None,
                 status: torch.Tensor | None = None, eager_overflow: str = "raise"):
        if config is None:
            config = StashConfig()
        if not isinstance(config, StashConfig):
            raise TypeError(f"config: expected a graphstash.StashConfig, got {type(config).__name__}")
        config.validate()
        if eager_overflow not in EAGER_OVERFLOW:
            raise ValueError(f"eager_overflow: expected one of {EAGER_OVERFLOW}, got "
                             f"{eager_overflow!r}")
        self.eager_overflow = eager_overflow
        if status is not None:
            if not isinstance(status, (torch.Tensor, StepStatus)):
                raise TypeError(f"status: expected an int32 tensor of shape ({L.STATUS_SIZE},) "
                                f"or a StepStatus, got {type(status).__name__}")
            owner = StepStatus.adopt(status)          # validates (NOTE [status owner])
            dev = normalize_device(owner.device, "status")
            if device is not None and normalize_device(device) != dev:
                raise ValueError(f"status: expected a tensor on device={device}, got "
                                 f"{describe(owner.tensor)}")
        else:
            dev = normalize_device(device)
            owner = StepStatus(dev)
        self.device = dev
        self.step_status = owner
        self.status = owner.tensor
        self._status_contexts: list = []      # `with manager:` blocks (NOTE [current step])
        self._buffers = StashBuffers(config, dev, owner.tensor)
        self._fill = _Fill()                  # NOTE [stash growth ahead]
        self.scheduler = GroupScheduler(self._buffers)
        """The layer groups' pack and unpack hooks, streams and copies (``scheduler.py``):
        what ``stash_activations`` drives; a training loop has no need to call it."""

    # ---- public API -----------------------------------------------------------------------
    @property
    def config(self) -> StashConfig:
        """The :class:`StashConfig` in force (:meth:`grow` replaces it with a grown copy)."""
        return self._buffers.config

    @property
    def buffers(self) -> dict:
        """``{key: PagedStashBuffer}`` created so far (a copy): ``(group, dtype, row_width)``
        with ``StashConfig.pool="per_group"`` (the default), ``(dtype, row_width)`` with
        ``"shared"``."""
        return self._buffers.buffers

    @property
    def pack_stream(self):
        """The side stream stashes run on (``None`` on the CPU)."""
        return self.scheduler.pack_stream

    @property
    def unpack_stream(self):
        """The side stream reloads run on (``None`` on the CPU)."""
        return self.scheduler.unpack_stream

    @property
    def released(self) -> bool:
        """True between :meth:`release` and :meth:`reallocate`."""
        return self._buffers.released

    @property
    def schedule(self) -> list | None:
        """The recorded schedule: ``[("F" | "B", group_ordinal, name), ...]`` or ``None``."""
        return self.scheduler.schedule

    def plan(self) -> list[dict]:
        """The stash plan (NOTE [stash plan] in ``plan.py``): one row per layer group of the
        measured step it was made from (the first, or the first after :meth:`replan`),
        ``{"group", "name", "budget_bytes", "live_bytes", "stashed", "why"}``; empty before any
        step measured demand."""
        return [dict(row) for row in self.scheduler.plan.rows]

    def replan(self) -> None:
        """Make the plan again: the buffers are freed, the next complete step keeps every
        group's tensors and measures them (as the first warmup step did), and the plan and the
        buffers are made from it (NOTE [stash plan]). Call it between steps, outside a
        capture; the measuring step must run eagerly (a capture refuses to measure, with a
        :class:`~graphstash.errors.CaptureError` that says so)."""
        forbid_capture("StashManager.replan()")
        self.scheduler.replan()
        self._buffers.fold_device_demand = True

    def next_group_rows(self) -> int | None:
        """The rows the experts of the next ``stash_activations`` group compute on, or None
        for their whole budget (NOTE [rows the stash keeps] in ``plan.py``): what its pages
        hold (``device_factor`` plus ``host_factor`` x its measured live rows, in whole pages)
        once the plan stashes it, or keeps it only because its backward follows its forward;
        None before the plan, for a group the plan keeps by choice, while released or
        remeasuring. Host only, no sync; ``moe_layer`` passes it to an expert-parallel
        dispatch as ``keep_rows``."""
        return self.scheduler.next_group_rows()

    def raise_fill(self, demand_rows: torch.Tensor, rows: int) -> None:
        """Raise the step's stash fill (NOTE [stash growth ahead] in
        ``graphstash/graph/_step.py``): ``demand_rows`` (integer ``[1]`` on the manager's
        device) rows a group's routing asked for, of the ``rows`` its experts compute on
        (:meth:`next_group_rows`), as a step peak in thousandths; the most over the step's
        groups and the ranks reaches the manager after the step. Capturable: no host read."""
        fill = self._fill
        self._buffers.fold_device_demand = False     # NOTE [growth to the need] in plan.py
        if fill.slot is None:
            fill.slot = claim_peak_slot(fill, "fill")
        value = (demand_rows.reshape(1).to(torch.int64) * 1000 + rows - 1) // rows
        raise_peak(self.step_status.peaks, fill.slot, value)

    def growth(self, default: float) -> float:
        """The factor to grow by after a step that overflowed (NOTE [growth to the need] in
        ``plan.py``): where groups compute on the rows they keep and that step reported its
        fill (:meth:`raise_fill`), the rows it asked for over the rows kept x
        :data:`NEED_HEADROOM`, if that is more than ``default``; else ``default``."""
        last = self._fill.last
        if self._buffers.fold_device_demand or last is None:
            return default
        return max(default, last / 1000 * NEED_HEADROOM)

    def take_grow_ahead(self) -> bool:
        """Whether a step that was not rerun filled :data:`GROW_AHEAD` or more of the rows some
        group keeps (:meth:`raise_fill`), so the stash should grow before a step overflows it
        (NOTE [stash growth ahead]); asking clears it."""
        asked, self._fill.grow_ahead = self._fill.grow_ahead, False
        return asked

    def plan_table(self, fmt: str = "text") -> str:
        """:meth:`plan` as a table (bytes in MiB) in ``fmt``: ``"text"`` or ``"md"``."""
        return self.scheduler.plan.table(fmt)

    def begin_step(self) -> None:
        """Start a step: reset every buffer's rings and forget the previous step's groups.

        Graph-safe (no allocation, no host read) except that outside a capture it first
        creates buffers whose demand a warmup step measured (NOTE [warmup sizing]). Does not
        clear the status (see :meth:`clear_status`). Handles of the previous step go stale.
        """
        self.scheduler.begin_step()

    def clear_status(self) -> None:
        """Zero the status flags and marks (``status.zero_()`` on the current stream)."""
        self.scheduler.join()
        self.step_status.clear()

    def end_step(self, *, check: bool = True) -> None:
        """Join the pack and unpack streams into the current stream and drop the step's
        references (call it before a CUDA graph capture ends).

        With ``check`` (default) and outside a capture, it then reads the status (one sync)
        and reports an overflow as ``eager_overflow`` says (NOTE [eager overflow]); the graph
        manager passes ``check=False``: it reads the status itself.
        """
        self.scheduler.end_step()
        if check and not is_capturing():
            self._report_overflow()

    def _report_overflow(self) -> None:
        # NOTE [eager overflow]: a stash that overflowed stored nothing and its reload wrote
        # nothing (NOTE [padding rows]), so the step's gradients are wrong and only a device
        # flag says so; likewise a MoE dispatch inside `with manager:` that went over its
        # budget dropped rows into the manager's status (NOTE [current step] in
        # graphstash/status.py). Outside graph_step (which reruns such a step dropless) nobody
        # else reads those flags: end_step() reads them (one sync) and raises (or warns). The
        # flags are sticky: every end_step() reports them until clear_status(), so a caller
        # that goes on without handling them is told at every step it trains on untrusted
        # gradients.
        status = self.step_status.read()
        bits, over_budget = status["overflow"], status["over_budget"]
        if not bits and not over_budget:
            return
        if bits:
            reasons = " and ".join(
                name for bit, name in ((L.OVERFLOW_POOL, "the pool was too small"),
                                       (L.OVERFLOW_COUNT, "a count was out of range"))
                if bits & bit)
            error = StashOverflowError
            message = (f"StashManager.end_step(): the stash overflowed ({reasons}); the "
                       "reloaded tensors, and so this step's gradients, are wrong. Rerun the "
                       "step under graphstash.dropless(), grow the pool (grow() or "
                       "size_from_demand()) and call clear_status()")
        else:
            error = OverBudgetError
            message = ("StashManager.end_step(): a MoE dispatch of this step routed more rows "
                       "than its static budget and dropped the rest (status[SS_OVER_BUDGET]); "
                       "its outputs and gradients differ from a dropless step. Rerun the step "
                       "under graphstash.dropless() or raise the budget, and call "
                       "clear_status()")
        message += "; graphstash.graph_step does all of this itself"
        if self.eager_overflow == "raise":
            raise error(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def warmup(self) -> None:
        """Before a CUDA graph capture: size the buffers from the demand measured so far and
        compile the kernels (NOTE [step protocol]). Not capturable."""
        forbid_capture("StashManager.warmup()")
        self.size_from_demand()
        if self.device.type == "cuda" and _kernels.availability()[0]:
            _kernels.warmup(self.device)

    def grow(self, factor: float) -> bool:
        """After an overflow: ``config`` becomes a copy with ``device_factor x factor``
        (``dataclasses.replace``; the config the manager was built with is not changed) and
        the buffers are re-sized from the demand measured so far. A host-only stash
        (``device_factor`` 0, accepted only with a host tier) grows ``host_factor`` instead:
        multiplying 0 would grow nothing. Where the groups compute on the rows their pages hold
        and the grown pages would hold as much as the budget rows they free, the plan steps
        aside instead and the buffers are freed (NOTE [growth to the need] in ``plan.py``).
        True if a buffer changed.

        Args:
            factor: a finite number > 1.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                1.0 < factor < math.inf):
            raise ValueError(f"factor: expected a finite number > 1, got {factor!r}")
        self._buffers.grow(factor)
        if not self._buffers.fold_device_demand and self.scheduler.plan.step_aside(
                self._buffers.config.device_factor):      # NOTE [growth to the need] in plan.py
            self.scheduler.join()
            self.scheduler.invalidate()
            self._buffers.forget()
            return True
        return self.size_from_demand()

    def peak(self) -> int:
        """Device pages in use at the high-water mark, summed over the buffers (syncs; 0 while
        released or before any buffer exists)."""
        if self.released:
            return 0
        return sum(b["peak_pages"] for b in self.read_status()["buffers"].values())

    def read_status(self) -> dict:
        """Flags and per-buffer pages, peaks and demand, read back to the host (syncs).

        Keys: ``overflow`` (bool), ``overflow_reasons``, ``host_spill``, ``over_budget``
        (bools), ``tokens_peak`` (int), ``buffers`` (``{"bfloat16[4096]": buffer status}``,
        see :meth:`PagedStashBuffer.read_status`), ``demand`` (``{name: peak pages}``, sized
        or not), ``unsized`` (names measured but without a buffer), ``released``.
        """
        forbid_capture("StashManager.read_status()")
        self.scheduler.join()
        self._buffers.collect_peaks()
        s = self.status.tolist()
        bits = s[L.SS_OVERFLOW]
        return {
            "overflow": bits != 0,
            "overflow_reasons": [name for bit, name in ((L.OVERFLOW_POOL, "pool"),
                                                        (L.OVERFLOW_COUNT, "count")) if bits & bit],
            "host_spill": bool(s[L.SS_HOST_SPILL]),
            "over_budget": bool(s[L.SS_OVER_BUDGET]),
            "tokens_peak": s[L.SS_TOKENS_PEAK],
            **self._buffers.read_status(),
            "released": self.released,
        }

    def size_from_demand(self) -> bool:
        """(Re)allocate every buffer to ``device_factor x`` its peak demand (device tier) and
        ``host_factor x`` (pinned-host tier); True if any buffer was created or changed.

        Not capturable (allocates, reads the device marks back). Outstanding handles go stale,
        so call it between steps; a captured graph using the old buffers must be re-captured.
        """
        forbid_capture("StashManager.size_from_demand()")
        self.scheduler.join()
        changed = self._buffers.size_from_demand()
        if changed:
            self.scheduler.invalidate()
        return changed

    def release(self) -> None:
        """Free every buffer (the status tensor stays); :meth:`reallocate` brings them back."""
        forbid_capture("StashManager.release()")
        self.scheduler.join()
        self.scheduler.invalidate()
        self._buffers.release()

    def reallocate(self) -> None:
        """Re-create the buffers at their last sizes (after :meth:`release`)."""
        forbid_capture("StashManager.reallocate()")
        self.scheduler.join()
        self.scheduler.invalidate()
        self._buffers.reallocate()

    @contextlib.contextmanager
    def trace(self, *, timing: bool = False):
        """Record the copies this manager issues inside the block (NOTE [introspection] in
        ``trace.py``); yields a :class:`~graphstash.stash.trace.StashTrace`.

        Example::

            with manager.trace() as trace:
                run_step()
            print(trace.events)           # [("stash", 0), ("stash", 1), ("prefetch", 1), ...]
        """
        tracer, previous = StashTrace(self.device, timing), self.scheduler.tracer
        self.scheduler.tracer = tracer
        try:
            yield tracer
        finally:
            self.scheduler.tracer = previous

    def __enter__(self) -> "StashManager":
        _default_stack().append(self)
        # its status is the current one inside the block (NOTE [current step])
        context = self.step_status.activate()
        context.__enter__()
        self._status_contexts.append(context)
        return self

    def __exit__(self, *exc) -> bool:
        if self._status_contexts:
            self._status_contexts.pop().__exit__(None, None, None)
        # like saved_tensors_hooks: an exit out of order would leave the wrong default behind
        stack = _default_stack()
        if not stack or stack[-1] is not self:
            top = repr(stack[-1]) if stack else "none"
            if self in stack:           # leave no stale default behind
                del stack[len(stack) - 1 - stack[::-1].index(self)]
            raise SavedTensorsError(
                f"`with manager:` exited out of order: the innermost default manager is {top}, "
                f"not {self!r}; exit `with manager:` blocks in the reverse order of entry")
        stack.pop()
        return False

    def __repr__(self) -> str:
        return (f"StashManager(device={self.device}, page_size={self.config.page_size}, "
                f"{self._buffers.describe()})")


class _Fill:
    """A manager's step peak ``"fill"`` (a :class:`graphstash.status.PeakOwner`): told after
    every step the most its groups filled and whether the step was rerun (NOTE [stash growth
    ahead] in ``graphstash/graph/_step.py``)."""

    def __init__(self):
        self.version = 0            # nothing a graph bakes in changes here
        self.slot: int | None = None
        self.grow_ahead = False
        self.last: int | None = None   # the last step's fill (NOTE [growth to the need])

    def observe(self, peaks: dict, *, flagged: bool) -> None:
        fill = peaks.get("fill")
        self.last = fill
        if fill is not None and not flagged and fill >= GROW_AHEAD * 1000:
            self.grow_ahead = True

    def state_dict(self) -> dict:
        return {"grow_ahead": self.grow_ahead, "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.grow_ahead = bool(state["grow_ahead"])
        self.last = state.get("last")


def current_default() -> StashManager | None:
    """The innermost `with manager:` of this thread, or None."""
    stack = _default_stack()
    return stack[-1] if stack else None
