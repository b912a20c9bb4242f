"""``StashManager``: the buffers, the pack/unpack streams and the schedule of layer groups.

NOTE [pre-schedule]: the stash of a group is issued on the pack stream when its context exits
(post-schedule) and runs beside whatever the compute stream does next. The compute stream
waits for it, and the group's oversized originals are dropped, at the next *schedule point*:
the entry of the next group's context (before that group's expert compute allocates its own
oversized buffers), the start of a group's backward, a reload, or a step boundary. So at most
about two groups of oversized buffers are alive at once in forward. The originals were
allocated on the compute stream and only read on the pack stream; the compute stream waits
for the stash's event before the references go, so the caching allocator can hand their
memory to the next group at once, without ``record_stream``.

NOTE [prefetch]: a group's reload is issued on the unpack stream into tensors allocated on
the compute stream (after the unpack stream waited for the compute stream, so the memory is
free there), and the compute stream waits for it only when the first of the group's saved
tensors is unpacked. It is issued ahead when the recorded schedule (NOTE [schedule
recording] in ``_schedule.py``) says the group's backward comes next: after a forward group
whose next event is that backward (1F1B: the newest microbatch's forward, then the oldest's
backward), or when the backward group before it is done. "Done" is ``StashConfig.prefetch``:
``"at_last_unpack"`` (default) issues it when the last saved tensor of that group is
unpacked, before the node using it runs, so the copy also overlaps that node; but the node's
budget-sized temporaries (weight-gradient reductions, ``grad`` of the widest activation) then
sit beside the reloaded group, which sets the peak of a step whose layers are alike.
``"after_release"`` waits until autograd released every saved tensor of that group
(``Entry.__del__``: the last node using them ran), so the reloaded tensors take the memory
that group's tensors and temporaries held: measured on an H200 (``graphstash bench stash``),
the peak fell from 0.73 to 0.66 of no stashing in the memory configuration and from 0.68 to
0.66 in the compute-heavy one, while the share of copy time beside compute fell from about
80 % to 55 % there. Without a recording (the first step) or once a step departs from it,
reloads happen on demand.

NOTE [last group kept]: when the recorded schedule says a group's backward directly follows
its own forward (the last layer before the loss), stashing it would copy rows out and back
with nothing in between; the group keeps its tensors instead and takes no pages.

NOTE [warmup sizing]: buffers are created per (dtype, row width) when first needed. With
``StashConfig.initial_tokens == 0`` a group whose buffer does not exist yet keeps its saved
tensors (so the warmup step is correct and as memory-hungry as without stashing), reads its
counts back to the host (a sync, fine in an eager step; under capture this raises
``CaptureError``) and notes the pages it would have taken. At the end of the step the events
are replayed (NOTE [warmup demand]) into high-water marks, and the next ``begin_step()``
outside a capture creates the missing buffers at ``factor x peak``. Once buffers exist the
kernels keep measuring demand on the device (pages wanted, stored or not), and
``size_from_demand()`` re-sizes every buffer from the highest mark seen so far.

NOTE [stash plan]: stashing lowers the peak only where the budget holds dead rows. At the
start of backward a plain step holds every group's budget-sized tensors; a stashing step holds
the pool (``device_factor x`` the live rows of the stashed groups), the last group (kept) and
one reloaded group at budget size. So with ``B`` a group's budget bytes and ``V`` its live
bytes, stashing saves ``sum(B - device_factor * V)`` over the stashed groups and costs the
largest ``B`` as the reload's working set. The first warmup step measures both (its groups
keep their tensors and note their demand anyway); under ``policy="auto"`` the manager stashes
from then on only if the saving exceeds the cost, else it leaves every group to autograd and
creates no pool (on one GPU a dropless budget of exactly ``T x K`` rows has no dead rows, so
there the stash steps aside). :meth:`StashManager.plan` shows the measurement and the choice.

NOTE [padding rows]: a reload writes the live rows and zeros the rows past the count
(``zero_tail``, unless the context passed ``zero_tail=False``): the reloaded tensor differs
from the original only in rows whose content no correct backward may depend on (the forward
masked them out), and zeros keep garbage (NaN, Inf) out of reductions such as weight
gradients, ``0 * x`` being exactly 0 for finite ``x``.
A stash that overflowed stores nothing and its reload writes nothing: the step is untrusted
(the status says so), the free lists stay consistent, and no other tensor is written.

NOTE [copy blocks]: the stash and reload kernels are persistent grids that fill every
multiprocessor, and so does a large GEMM running beside them on the compute stream: they
compete for the same multiprocessors. ``StashConfig.copy_blocks`` caps the copy grid so the
compute keeps most of them (the kernels hand out work dynamically, so any grid copies
everything). In the MoE benchmark half the multiprocessors was measured fastest among 16,
33, 66 and all 132 blocks on an H200 (``benchmarks/probes/moe_stash_variants.py``).

NOTE [entry cycle]: an ``Entry`` points to its ``Group`` (the unpack hook needs the group's
state) and ``Group.entries`` points back, so the two form a reference cycle. Kept tensors
(warmup steps, the last group, groups without candidates) live in such entries; if the cycle
outlived the backward they would stay allocated until Python's cyclic collector happened to
run, at an arbitrary point of a later step. ``Group.entries`` is therefore only set while the
manager needs it (from the pack hook until the group's stash is issued and its reload
completed); once it is ``None`` the entries die with autograd's references to them.

NOTE [capture]: stash, reload, reset and the stream forks and joins are all captured; the
side streams are forked from the compute stream (``wait_stream``) before every use and joined
back at schedule points and in ``end_step()``, which must run before a capture ends. Events
recorded on one side of a capture boundary are never waited on on the other
(``torch.cuda.graph`` synchronizes on entry). Creating or re-sizing a buffer, and reading
counts back, raise ``CaptureError`` while capturing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import warnings

import torch

from .. import _kernels
from .. import _layout as L
from .._checks import check_status, describe, forbid_capture, is_capturing, normalize_device
from .._saved import Kept, RetireQueue, SideStream, movable
from .._saved.registry import thread_stack
from ..errors import (CaptureError, ReleasedError, SavedTensorsError, StaleHandleError,
                      StashOverflowError)
from ..paging import PagedStashBuffer, new_status
from ._group import Entry, Group
from ._schedule import Schedule, replay_demand
from .config import StashConfig
from .trace import StashTrace

EAGER_OVERFLOW = ("raise", "warn")

_defaults = threading.local()      # .stack: the `with manager:` blocks of this thread


def _default_stack() -> list:
    return thread_stack(_defaults)


def _key_name(key) -> str:
    dtype, width = key
    return f"{str(dtype).replace('torch.', '')}[{width}]"


class StashManager:
    """Owns the paged stash buffers (one per dtype and row width), a pack stream, an unpack
    stream and the status tensor shared by all its buffers; drives ``stash_activations``.

    Args:
        config: a :class:`StashConfig` (default: ``StashConfig()``).
        device: where the stashed tensors live (default: the current CUDA device, or the CPU
            when torch sees no GPU; the CPU runs the reference backend without streams).
        status: optional int32 ``[8]`` status tensor on ``device`` to share (the graph
            manager passes one so MoE over-budget and stash flags live in one tensor).
        eager_overflow: what :meth:`end_step` does when the step overflowed (NOTE [eager
            overflow]): ``"raise"`` :class:`~graphstash.errors.StashOverflowError` (default)
            or ``"warn"`` (a ``RuntimeWarning``).

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
            if not isinstance(status, torch.Tensor):
                raise TypeError(f"status: expected an int32 tensor of shape ({L.STATUS_SIZE},), "
                                f"got {type(status).__name__}")
            dev = normalize_device(status.device, "status")
            if device is not None and normalize_device(device) != dev:
                raise ValueError(f"status: expected a tensor on device={device}, got "
                                 f"{describe(status)}")
            check_status("status", status, dev)
        else:
            dev = normalize_device(device)
            status = new_status(dev)
        self.config = config
        self.device = dev
        self.status = status
        self._cuda = dev.type == "cuda"
        self._sides = {"pack": SideStream(dev, "pack"), "unpack": SideStream(dev, "unpack")}
        for side in self._sides.values():
            side.stream               # created now, outside any capture
        self._retiring = RetireQueue(self._sides["pack"])   # NOTE [pre-schedule]
        self._buffers: dict = {}          # key -> PagedStashBuffer
        self._sizes: dict = {}            # key -> (device_tokens, host_tokens, record_entries)
        self._peak_pages: dict = {}       # key -> highest demand in pages seen
        self._peak_entries: dict = {}     # key -> highest record-table entries in use seen
        self._live_entries: dict = {}     # key -> record entries of outstanding handles
        self._released = False
        self._schedule = Schedule()
        self._ring_generation = 0
        self._step = 0
        self._step_open = False
        self._had_backward = False
        self._next_gid = 0
        self._groups: dict[int, Group] = {}
        self._tracer: StashTrace | None = None   # the open trace() (NOTE [introspection])
        self._deferred_error: Exception | None = None   # raised by a release-time prefetch
        self._plan: list[dict] | None = None  # NOTE [stash plan]: rows of the first measurement
        self._keep_all = config.policy == "never"

    # ---- public API -----------------------------------------------------------------------
    @property
    def buffers(self) -> dict:
        """``{(dtype, row_width): PagedStashBuffer}`` created so far (a copy)."""
        return dict(self._buffers)

    @property
    def pack_stream(self):
        """The side stream stashes run on (``None`` on the CPU)."""
        return self._sides["pack"].stream

    @property
    def unpack_stream(self):
        """The side stream reloads run on (``None`` on the CPU)."""
        return self._sides["unpack"].stream

    @property
    def released(self) -> bool:
        """True between :meth:`release` and :meth:`reallocate`."""
        return self._released

    @property
    def schedule(self) -> list | None:
        """The recorded schedule: ``[("F" | "B", group_ordinal, name), ...]`` or ``None``."""
        return None if self._schedule.recorded is None else list(self._schedule.recorded)

    def plan(self) -> list[dict]:
        """The stash plan (NOTE [stash plan]): one row per layer group of the first measured
        step, ``{"group", "name", "budget_bytes", "live_bytes", "stashed", "why"}``; empty
        before any warmup step measured demand."""
        return [dict(row) for row in self._plan or []]

    def plan_table(self) -> str:
        """:meth:`plan` as a text table (bytes in MiB)."""
        lines = [f"{'group':>5}  {'name':<16}{'budget MiB':>11}{'live MiB':>10}  stashed  why"]
        for r in self._plan or []:
            lines.append(f"{r['group']:>5}  {str(r['name']):<16}{r['budget_bytes'] / 2**20:>11.1f}"
                         f"{r['live_bytes'] / 2**20:>10.1f}  {'yes' if r['stashed'] else 'no':<7}"
                         f"  {r['why']}")
        return "\n".join(lines)

    def begin_step(self) -> None:
        """Start a step: reset every buffer's rings and forget the previous step's groups.

        Graph-safe (no allocation, no host read) except that outside a capture it first
        creates buffers whose demand a warmup step measured (NOTE [warmup sizing]). Does not
        clear the status (see :meth:`clear_status`). Handles of the previous step go stale.
        """
        if self._step_open:
            self._finish_step()
        self._start_step(reset_rings=True)

    def clear_status(self) -> None:
        """Zero the status flags and marks (``status.zero_()`` on the current stream)."""
        self._join()
        self.status.zero_()

    def end_step(self, *, check: bool = True) -> None:
        """Join the pack and unpack streams into the current stream and drop the step's
        references (call it before a CUDA graph capture ends).

        With ``check`` (default) and outside a capture, it then reads the status (one sync)
        and reports an overflow as ``eager_overflow`` says (NOTE [eager overflow]); the graph
        manager passes ``check=False``: it reads the status itself.
        """
        self._join()
        self._close_step()
        self._raise_deferred()
        if check and not is_capturing():
            self._report_overflow()

    def _report_overflow(self) -> None:
        # NOTE [eager overflow]: a stash that overflowed stored nothing and its reload wrote
        # nothing (NOTE [padding rows]), so the step's gradients are wrong and only a device
        # flag says so. Outside graph_step (which reruns such a step dropless) nobody else
        # reads that flag: end_step() reads it and raises (or warns). The flag is sticky:
        # every end_step() reports it until clear_status(), so a caller that goes on without
        # handling it is told at every step it trains on untrusted gradients.
        bits = int(self.status[L.SS_OVERFLOW].item())
        if not bits:
            return
        reasons = " and ".join(name for bit, name in ((L.OVERFLOW_POOL, "the pool was too small"),
                                                      (L.OVERFLOW_COUNT, "a count was out of range"))
                               if bits & bit)
        message = (f"StashManager.end_step(): the stash overflowed ({reasons}); the reloaded "
                   "tensors, and so this step's gradients, are wrong. Rerun the step under "
                   "graphstash.dropless(), grow the pool (grow() or size_from_demand()) and call "
                   "clear_status(); graphstash.graph_step does all of this itself")
        if self.eager_overflow == "raise":
            raise StashOverflowError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def warmup(self) -> None:
        """Before a CUDA graph capture: size the buffers from the demand measured so far and
        compile the kernels (NOTE [step protocol]). Not capturable."""
        forbid_capture("StashManager.warmup()")
        self.size_from_demand()
        if self._cuda and _kernels.availability()[0]:
            _kernels.warmup(self.device)

    def grow(self, factor: float) -> bool:
        """After an overflow: ``config`` becomes a copy with ``device_factor x factor``
        (``dataclasses.replace``; the config the manager was built with is not changed) and
        the buffers are re-sized from the demand measured so far. A host-only stash
        (``device_factor`` 0, accepted only with a host tier) grows ``host_factor`` instead:
        multiplying 0 would grow nothing. True if a buffer changed.

        Args:
            factor: a finite number > 1.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                1.0 < factor < math.inf):
            raise ValueError(f"factor: expected a finite number > 1, got {factor!r}")
        c = self.config
        field = "host_factor" if c.device_factor == 0 else "device_factor"
        self.config = dataclasses.replace(c, **{field: getattr(c, field) * factor})
        return self.size_from_demand()

    def peak(self) -> int:
        """Device pages in use at the high-water mark, summed over the buffers (syncs; 0 while
        released or before any buffer exists)."""
        if self._released:
            return 0
        return sum(b["peak_pages"] for b in self.read_status()["buffers"].values())

    def _close_step(self) -> None:
        """Finish the open step, retire its pending groups and forget its groups."""
        if self._step_open:
            self._finish_step()
        self._retiring.drop_all()
        self._groups = {}
        self._step_open = False

    def read_status(self) -> dict:
        """Flags and per-buffer pages, peaks and demand, read back to the host (syncs).

        Keys: ``overflow`` (bool), ``overflow_reasons``, ``host_spill``, ``over_budget``
        (bools), ``tokens_peak`` (int), ``buffers`` (``{"bfloat16[4096]": buffer status}``,
        see :meth:`PagedStashBuffer.read_status`), ``demand`` (``{name: peak pages}``, sized
        or not), ``unsized`` (names measured but without a buffer), ``released``.
        """
        forbid_capture("StashManager.read_status()")
        self._join()
        self._collect_peaks()
        s = self.status.tolist()
        bits = s[L.SS_OVERFLOW]
        return {
            "overflow": bits != 0,
            "overflow_reasons": [name for bit, name in ((L.OVERFLOW_POOL, "pool"),
                                                        (L.OVERFLOW_COUNT, "count")) if bits & bit],
            "host_spill": bool(s[L.SS_HOST_SPILL]),
            "over_budget": bool(s[L.SS_OVER_BUDGET]),
            "tokens_peak": s[L.SS_TOKENS_PEAK],
            "buffers": {} if self._released else
            {_key_name(k): b.read_status() for k, b in self._buffers.items()},
            "demand": {_key_name(k): v for k, v in self._peak_pages.items()},
            "unsized": [_key_name(k) for k in self._peak_pages if k not in self._sizes],
            "released": self._released,
        }

    def size_from_demand(self) -> bool:
        """(Re)allocate every buffer to ``device_factor x`` its peak demand (device tier) and
        ``host_factor x`` (pinned-host tier); True if any buffer was created or changed.

        Not capturable (allocates, reads the device marks back). Outstanding handles go stale,
        so call it between steps; a captured graph using the old buffers must be re-captured.
        """
        forbid_capture("StashManager.size_from_demand()")
        self._join()
        self._collect_peaks()
        changed = False
        for key in list(self._peak_pages):
            size = self._size_for(key)
            if self._sizes.get(key) == size and (self._released or key in self._buffers):
                continue
            self._sizes[key] = size
            changed = True
            if not self._released:
                self._create(key)
        if changed:
            self._invalidate_step()
        return changed

    def release(self) -> None:
        """Free every buffer (the status tensor stays); :meth:`reallocate` brings them back."""
        forbid_capture("StashManager.release()")
        self._join()
        self._collect_peaks()
        self._invalidate_step()
        for buf in self._buffers.values():
            buf.release()
        self._buffers = {}
        self._released = True

    def reallocate(self) -> None:
        """Re-create the buffers at their last sizes (after :meth:`release`)."""
        forbid_capture("StashManager.reallocate()")
        self._join()
        self._invalidate_step()
        for buf in self._buffers.values():
            buf.release()
        self._buffers = {}
        self._released = False
        for key in self._sizes:
            self._create(key)

    @contextlib.contextmanager
    def trace(self, *, timing: bool = False):
        """Record the copies this manager issues inside the block (NOTE [introspection] in
        ``trace.py``); yields a :class:`~graphstash.stash.trace.StashTrace`.

        Example::

            with manager.trace() as trace:
                run_step()
            print(trace.events)           # [("stash", 0), ("stash", 1), ("prefetch", 1), ...]
        """
        tracer, previous = StashTrace(self.device, timing), self._tracer
        self._tracer = tracer
        try:
            yield tracer
        finally:
            self._tracer = previous

    def __enter__(self) -> "StashManager":
        _default_stack().append(self)
        return self

    def __exit__(self, *exc) -> bool:
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
        bufs = ", ".join(f"{_key_name(k)}: {v[0]}+{v[1]} rows" for k, v in self._sizes.items())
        state = "released" if self._released else f"buffers {{{bufs}}}"
        return f"StashManager(device={self.device}, page_size={self.config.page_size}, {state})"

    # ---- sizing ---------------------------------------------------------------------------
    def _size_for(self, key) -> tuple[int, int, int]:
        c = self.config
        peak = self._peak_pages.get(key, 0)
        dev_pages = math.ceil(c.device_factor * peak - 1e-9)
        host_pages = math.ceil(c.host_factor * peak - 1e-9) if c.host_tier else 0
        if dev_pages + host_pages == 0:
            dev_pages = 1
        entries = max(65536, 8 * (dev_pages + host_pages), 2 * self._peak_entries.get(key, 0))
        return dev_pages * c.page_size, host_pages * c.page_size, entries

    def _create(self, key) -> PagedStashBuffer:
        if is_capturing():
            raise CaptureError(
                f"stash_activations: the stash buffer for {_key_name(key)} rows would be "
                "created while a CUDA graph is capturing; run an eager warmup step first (its "
                "demand sizes the buffers) or set StashConfig.initial_tokens")
        old = self._buffers.pop(key, None)
        if old is not None:
            old.release()
        dtype, width = key
        dev_tokens, host_tokens, entries = self._sizes[key]
        buf = PagedStashBuffer(dev_tokens, width, dtype=dtype, device=self.device,
                               page_size=self.config.page_size, host_tokens=host_tokens,
                               backend=self.config.backend, status=self.status,
                               record_entries=entries)
        self._buffers[key] = buf
        return buf

    def _collect_peaks(self) -> None:
        """Fold the buffers' device demand marks into the host-side peaks (syncs)."""
        for key, buf in self._buffers.items():
            if not buf.released:
                peak = int(buf.state[L.ST_DEMAND_PEAK].item())
                self._peak_pages[key] = max(self._peak_pages.get(key, 0), peak)

    def _note_entries(self, key, delta: int) -> None:
        live = self._live_entries.get(key, 0) + delta
        self._live_entries[key] = live
        if live > self._peak_entries.get(key, 0):
            self._peak_entries[key] = live

    # ---- streams (NOTE [side streams] in graphstash/_saved/streams.py) -------------------
    def _join(self) -> None:
        for side in self._sides.values():
            side.join()

    # ---- steps ----------------------------------------------------------------------------
    def _start_step(self, reset_rings: bool) -> None:
        if reset_rings:
            self._join()
            self._retiring.drop_all()
            if not self._released and not is_capturing():
                for key in self._peak_pages:
                    if key not in self._sizes:
                        self._sizes[key] = self._size_for(key)
                        self._create(key)
            for buf in self._buffers.values():
                buf.reset(clear_status=False)
            self._live_entries = {}
            self._ring_generation += 1
        self._groups = {}
        self._next_gid = 0
        self._had_backward = False
        self._step += 1
        self._schedule.start_step()
        self._step_open = True

    def _finish_step(self) -> None:
        tracked = [g for g in self._groups.values() if g.tracked]
        complete = all(g.backward_started for g in tracked)
        self._schedule.finish_step(complete)
        demand = {g.gid: g.demand for g in tracked if g.demand}
        if demand and self._plan is None and complete:
            self._make_plan([g for g in tracked if g.demand])
        if demand and not self._keep_all:
            for key, (pages, entries) in replay_demand(self._schedule.events, demand).items():
                self._peak_pages[key] = max(self._peak_pages.get(key, 0), pages)
                self._peak_entries[key] = max(self._peak_entries.get(key, 0), entries)

    def _make_plan(self, groups: list) -> None:
        """NOTE [stash plan]: decide from the measured step whether stashing pays."""
        events = self._schedule.events
        last = {gid for i, (kind, gid, name) in enumerate(events)
                if kind == "F" and i + 1 < len(events) and events[i + 1] == ("B", gid, name)}
        f = self.config.device_factor
        rows, saving, cost = [], 0.0, 0
        for g in groups:
            budget = sum(b for b, _ in g.plan_bytes.values())
            live = sum(v for _, v in g.plan_bytes.values())
            rows.append({"group": g.gid, "name": g.name, "budget_bytes": budget,
                         "live_bytes": live, "stashed": False})
            if g.gid not in last:
                saving += budget - f * live
                cost = max(cost, budget)
        policy = self.config.policy
        stash = policy == "always" or (policy == "auto" and saving > cost)
        if policy == "auto" and saving >= 0:
            why = (f"saves {saving / 2**20:.1f} MiB of budget rows, costs {cost / 2**20:.1f} "
                   "MiB for a reload")
        elif policy == "auto":          # the pool would hold more than the rows it frees
            why = (f"its pool costs {-saving / 2**20:.1f} MiB more than the budget rows it "
                   f"frees, and {cost / 2**20:.1f} MiB for a reload")
        else:
            why = f"policy={policy!r}"
        for r in rows:
            last_group = r["group"] in last
            r["stashed"] = stash and not last_group
            r["why"] = "last group before backward: kept" if last_group else why
        self._plan = rows
        self._keep_all = not stash

    def _invalidate_step(self) -> None:
        """Buffers change under the step: its handles are stale, its groups forgotten."""
        self._close_step()
        self._live_entries = {}
        self._ring_generation += 1

    def _steps_apart(self) -> bool:
        """True when every group of the open step has run its backward (NOTE [implicit steps])."""
        # NOTE [implicit steps]: without begin_step() calls, a forward group that starts after
        # every earlier group of the step was consumed by backward opens a new step (its
        # rings are consistent then: every page came back). The schedule recorded per such
        # step is what gradient accumulation (F B F B ...) repeats.
        return self._had_backward and all(g.remaining == 0 for g in self._groups.values()
                                          if g.tracked)

    # ---- forward --------------------------------------------------------------------------
    def _open_group(self, name: str | None) -> Group:
        if self._released:
            raise ReleasedError("stash_activations: the StashManager was released; call "
                                "reallocate() first")
        if not self._step_open:
            self._start_step(reset_rings=True)
        elif self._steps_apart():
            self._finish_step()
            self._start_step(reset_rings=False)
        self._retire_pending()
        group = Group(self, self._next_gid, name, self._ring_generation, self._step)
        self._next_gid += 1
        self._groups[group.gid] = group
        return group

    def _pack(self, group: Group, t: torch.Tensor):
        """saved_tensors_hooks pack: wrap budget-sized candidates in an Entry, keep others."""
        scope = group.scopes[-1]
        if (not movable(t, self.device) or t.dim() < (1 if scope.segments == 1 else 2)
                or t.numel() * t.element_size() < self.config.min_tensor_bytes
                or not t.is_contiguous()
                or (scope.segments > 1 and t.shape[0] != scope.segments)):
            return Kept(t)              # NOTE [in-place check] in graphstash/_saved/version.py
        dedup_key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                     t.dtype, id(scope))
        entry = group.dedup.get(dedup_key)
        if entry is None:
            entry = Entry(group, t, scope)
            group.entries.append(entry)
            group.dedup[dedup_key] = entry
        return entry

    def _classify(self, group: Group) -> None:
        """NOTE [budget]: a saved tensor is stashed when its leading dimension (rows) or, with
        ``S`` counts, its second dimension (rows per segment, after ``S``) is the budget: the
        ``max_tokens`` given to the context or, if none, the one that holds the most bytes
        among the context's candidates (ties: the larger). Row width is everything after."""
        for scope in group.all_scopes:
            entries = [e for e in group.entries if e.scope is scope]
            if not entries:
                continue
            S = scope.segments
            axis = 0 if S == 1 else 1
            budget = scope.max_tokens
            if budget is None:
                weight: dict[int, int] = {}
                for e in entries:
                    lead = e.shape[axis]
                    weight[lead] = weight.get(lead, 0) + e.tensor.numel() * e.tensor.element_size()
                budget = max(weight, key=lambda k: (weight[k], k))
            for e in entries:
                if e.shape[axis] == budget:
                    width = e.tensor.numel() // (S * budget)
                    e.layout = (S, budget, width)
                    e.key = (e.dtype, width)
                    P = self.config.page_size
                    e.record_len = L.H_HEADER + S + S * (-(-budget // P))

    def _close_group(self, group: Group, ok: bool) -> None:
        group.dedup = None
        entries = group.entries
        if not entries:
            group.entries = None
            return
        group.tracked = True
        group.remaining = len(entries)
        group.alive = len(entries)
        if not ok:
            group.entries = None         # NOTE [entry cycle]
            return                       # the forward raised: keep everything, stash nothing
        self._classify(group)
        index = self._schedule.add(("F", group.gid, group.name))
        group.f_index = index
        following = self._schedule.next_after(index)
        if following == ("B", group.gid, group.name) or (self._keep_all
                                                         and self._plan is not None):
            group.entries = None         # NOTE [last group kept] / [stash plan], [entry cycle]
            return
        candidates = [e for e in entries if e.layout is not None]
        if not candidates:
            group.entries = None         # NOTE [entry cycle]
            return
        to_stash = []
        for e in candidates:
            if e.key not in self._buffers:
                if self._released:
                    raise ReleasedError("stash_activations: the StashManager was released; "
                                        "call reallocate() first")
                if self.config.initial_tokens > 0 and e.key not in self._sizes:
                    self._sizes[e.key] = (self.config.initial_tokens, 0,
                                          max(65536, 8 * -(-self.config.initial_tokens
                                                           // self.config.page_size)))
                if e.key in self._sizes:
                    self._create(e.key)
            if e.key in self._buffers:
                to_stash.append(e)
            else:
                self._note_demand(group, e)
        if to_stash:
            self._stash(group, to_stash)
        else:
            group.entries = None         # NOTE [entry cycle]
        if following is not None and following[0] == "B":
            self._prefetch(following)

    def _note_demand(self, group: Group, e: Entry) -> None:
        """Warmup: the pages ``e`` would take (NOTE [warmup sizing]); reads counts (syncs)."""
        if is_capturing():
            raise CaptureError(
                f"stash_activations: no stash buffer holds {_key_name(e.key)} rows yet and a "
                "CUDA graph is capturing; run an eager warmup step before the capture (its "
                "demand sizes the buffers at the next begin_step()) or set "
                "StashConfig.initial_tokens")
        scope = e.scope
        if scope.counts_host is None:
            scope.counts_host = [int(v) for v in scope.num_tokens.tolist()]
        S, cap, _ = e.layout
        P = self.config.page_size
        pages = sum(-(-n // P) for n in scope.counts_host if 0 <= n <= cap)
        old_pages, old_entries = group.demand.get(e.key, (0, 0))
        group.demand[e.key] = (old_pages + pages, old_entries + e.record_len)
        row_bytes = e.layout[2] * e.tensor.element_size()
        budget, live = group.plan_bytes.get(e.key, (0, 0))
        group.plan_bytes[e.key] = (budget + e.tensor.numel() * e.tensor.element_size(),
                                   live + pages * P * row_bytes)

    def _stash(self, group: Group, entries: list) -> None:
        for scope in group.all_scopes:
            if any(e.scope is scope for e in entries):
                scope.snapshot = scope.num_tokens.clone()   # NOTE [count snapshot]
        # NOTE [count snapshot]: the counts are copied on the compute stream when the group
        # ends; the stash reads the copy on the pack stream, so the compute stream may write
        # the next layer's counts into the same tensor before the stash has run.
        tracer, side = self._tracer, self._sides["pack"]
        group.has_stash = True
        try:
            with side.fork():
                start = tracer.timer(side.stream) if tracer is not None else None
                for e in entries:
                    buf = self._buffers[e.key]
                    e.handle = buf.stash(e.stash_view(), e.scope.snapshot,
                                         max_blocks=self.config.copy_blocks or None)
                    e.stashed = True
                    self._note_entries(e.key, e.record_len)
                end = tracer.timer(side.stream) if tracer is not None else None
        finally:
            self._retiring.add(group, side.mark(), group.retire)
        if tracer is not None:
            tracer.note("stash", group, start, end)

    def _retire_pending(self) -> None:
        """Schedule point: wait for issued stashes and drop their originals (NOTE [pre-schedule])."""
        self._retiring.retire()

    # ---- backward -------------------------------------------------------------------------
    def _prefetch(self, event) -> None:
        _, gid, name = event
        group = self._groups.get(gid)
        if (group is not None and group.name == name and group.has_stash
                and not group.reload_issued and not group.backward_started
                and group.ring_generation == self._ring_generation and not self._released):
            self._reload(group)

    def _check_reloadable(self, group: Group) -> None:
        if self._released:
            raise ReleasedError(
                f"stash_activations: group {group.label} cannot be reloaded, the StashManager "
                "was released after its forward; run the forward again")
        if group.ring_generation != self._ring_generation:
            raise StaleHandleError(
                f"stash_activations: group {group.label} was stashed before the manager's last "
                "begin_step(), size_from_demand(), release() or reallocate(); its pages were "
                "returned then, so its saved tensors are gone: run the forward again")

    def _reload(self, group: Group) -> None:
        self._check_reloadable(group)
        self._retire_pending()
        stashed = [e for e in group.entries if e.stashed]
        outs = [torch.empty(e.reload_shape(), dtype=e.dtype, device=self.device) for e in stashed]
        tracer, side = self._tracer, self._sides["unpack"]
        kind = "reload" if group.backward_started else "prefetch"
        try:
            with side.fork():
                start = tracer.timer(side.stream) if tracer is not None else None
                for e, out in zip(stashed, outs):
                    self._buffers[e.key].reload(e.handle, out=out, zero_tail=e.scope.zero_tail,
                                                max_blocks=self.config.copy_blocks or None)
                    e.out = out.view(e.shape)
                    e.handle = None
                    self._note_entries(e.key, -e.record_len)
                end = tracer.timer(side.stream) if tracer is not None else None
        finally:
            group.reload_mark = side.mark()
            group.reload_issued = True
        if tracer is not None:
            tracer.note(kind, group, start, end)
        group.entries = None      # autograd holds the entries (and their reloaded tensors)

    def _unpack(self, entry: Entry) -> torch.Tensor:
        self._raise_deferred()
        group = entry.group
        if entry.stashed and entry.out is None:
            self._check_reloadable(group)
        if not group.backward_started:
            group.backward_started = True
            if group.step == self._step:
                self._had_backward = True
                group.b_index = self._schedule.add(("B", group.gid, group.name))
            self._retire_pending()
        if entry.stashed:
            if not group.reload_issued:
                self._reload(group)
            stream = torch.cuda.current_stream(self.device) if self._cuda else None
            if stream is not None and stream.cuda_stream not in group.reload_waited:
                self._sides["unpack"].wait(group.reload_mark)
                group.reload_waited.add(stream.cuda_stream)
            entry.saved.check(f"in group {group.label}, after its stash")
            tensor = entry.out
        else:
            entry.saved.check(f"in group {group.label}, kept on the device", held=entry.tensor)
            tensor = entry.tensor
        if not entry.unpacked:
            entry.unpacked = True
            group.remaining -= 1
            if (group.remaining == 0 and self.config.prefetch == "at_last_unpack"
                    and group.b_index is not None and group.step == self._step):
                self._prefetch_after(group)
        return tensor

    def _prefetch_after(self, group: Group) -> None:
        following = self._schedule.next_after(group.b_index)
        if following is not None and following[0] == "B":
            self._prefetch(following)

    def _group_released(self, group: Group) -> None:
        """Every saved tensor of ``group`` was released by autograd (NOTE [prefetch])."""
        if (self.config.prefetch != "after_release" or group.b_index is None
                or group.step != self._step or not self._step_open
                or group.remaining != 0 or self._released):
            return
        try:
            self._prefetch_after(group)
        except Exception as exc:          # called from Entry.__del__: cannot raise there
            self._deferred_error = exc

    def _raise_deferred(self) -> None:
        exc, self._deferred_error = self._deferred_error, None
        if exc is not None:
            raise exc


def current_default() -> StashManager | None:
    """The innermost `with manager:` of this thread, or None."""
    stack = _default_stack()
    return stack[-1] if stack else None
