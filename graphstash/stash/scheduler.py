"""``GroupScheduler``: the layer groups of a step, their saved tensors, and when each group is
stashed, reloaded and prefetched on the side streams. ``stash_activations`` drives it through
its public methods (:meth:`GroupScheduler.open_group`, :meth:`~GroupScheduler.pack`,
:meth:`~GroupScheduler.close_group`, :meth:`~GroupScheduler.unpack`).

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
that group's tensors and temporaries held: a lower peak, and less of the copy time beside
compute (docs/stash-performance.md, "Prefetch point"). ``"on_demand"`` issues none ahead.
Without a recording (the first step) or once a step departs from it, reloads happen on demand.

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
everything). Which cap is fastest is measured, not derived: docs/stash-performance.md, "Copy
blocks".

NOTE [entry cycle]: an ``Entry`` points to its ``Group`` (the unpack hook needs the group's
state) and ``Group.entries`` points back, so the two form a reference cycle. Kept tensors
(warmup steps, the last group, groups without candidates) live in such entries; if the cycle
outlived the backward they would stay allocated until Python's cyclic collector happened to
run, at an arbitrary point of a later step. ``Group.entries`` is therefore only set while the
scheduler needs it (from the pack hook until the group's stash is issued and its reload
completed); once it is ``None`` the entries die with autograd's references to them.

NOTE [pages per group]: with ``StashConfig.pool="per_group"`` (the default) every layer group
stashes into buffers of its own (keys ``(group, dtype, width)``, each sized from that group's
measured demand) whose pages are lent (NOTE [lent pages] in ``graphstash/paging.py``): they
are allocated on the compute stream just before the group's stash is issued and freed once
the compute stream (and the stream that took them) waited for the group's reload, at the
first unpack of a reloaded tensor; whatever is still taken when a step ends is freed then.
Under a CUDA graph capture both happen in the graph's own pool, so the memory a reloaded
group gave back is what the gradients of the layers done after it, and the reloads of the
groups before it, are allocated from. A pool held through the step (``pool="shared"``) sits
beside every gradient at the end of backward, where a step that keeps the budget-sized
tensors holds none of them (docs/exchange.md, "The stash at expert parallelism").

NOTE [capture]: stash, reload, reset and the stream forks and joins are all captured; the
side streams are forked from the compute stream (``wait_stream``) before every use and joined
back at schedule points and in ``end_step()``, which must run before a capture ends. Events
recorded on one side of a capture boundary are never waited on on the other
(``torch.cuda.graph`` synchronizes on entry). Creating or re-sizing a buffer, and reading
counts back, raise ``CaptureError`` while capturing.
"""
from __future__ import annotations

import torch

from .._checks import is_capturing
from .._saved import Kept, RetireQueue, SideStream, movable
from ..errors import CaptureError, ReleasedError, StaleHandleError
from ._group import Entry, Group
from ._schedule import Schedule, replay_demand
from .buffers import StashBuffers, key_name
from .plan import StashPlan, classify
from .trace import StashTrace


class GroupScheduler:
    """Layer groups, their pack and unpack hooks, and the side streams their copies run on.

    Args:
        buffers: the :class:`StashBuffers` the groups stash into (their config is read at
            each use: ``grow()`` replaces it).

    Example (what ``stash_activations`` does for one layer group)::

        group = scheduler.open_group("layer3")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: scheduler.pack(group, t),
                                                      scheduler.unpack):
            y = layer(x)
        scheduler.close_group(group, ok=True)     # issues the stash on the pack stream
    """

    def __init__(self, buffers: StashBuffers):
        self.buffers = buffers
        device = buffers.device
        self._cuda = device.type == "cuda"
        self._sides = {"pack": SideStream(device, "pack"), "unpack": SideStream(device, "unpack")}
        for side in self._sides.values():
            side.stream               # created now, outside any capture
        self._retiring = RetireQueue(self._sides["pack"])   # NOTE [pre-schedule]
        self._schedule = Schedule()
        self._step = 0
        self._step_open = False
        self._had_backward = False
        self._next_gid = 0
        self._groups: dict[int, Group] = {}
        self.tracer: StashTrace | None = None    # the open trace() (NOTE [introspection])
        self._deferred_error: Exception | None = None   # raised by a release-time prefetch
        self.plan = StashPlan(buffers.config.policy)    # NOTE [stash plan]
        self.memory_meter = (lambda: torch.cuda.memory_allocated(device)) if self._cuda else None
        """Bytes in use now (a callable), read along the step the plan is made from (NOTE
        [stash plan]): the CUDA allocator's on a GPU; None on the CPU, where the plan goes by
        the start of backward alone."""
        self._timeline: list = []         # (kind, gid, bytes in use) until the plan is made
        self._end_queued = False          # a backward pass's end will add an "E" level
        self._remeasure = False           # replan(): groups note demand though buffers exist

    @property
    def pack_stream(self):
        """The side stream stashes run on (``None`` on the CPU)."""
        return self._sides["pack"].stream

    @property
    def unpack_stream(self):
        """The side stream reloads run on (``None`` on the CPU)."""
        return self._sides["unpack"].stream

    @property
    def schedule(self) -> list | None:
        """The recorded schedule: ``[("F" | "B", group_ordinal, name), ...]`` or ``None``."""
        return None if self._schedule.recorded is None else list(self._schedule.recorded)

    # ---- steps ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step: the open one is finished, the rings reset (NOTE [warmup sizing])."""
        if self._step_open:
            self._finish_step()
        self._start_step(reset_rings=True)

    def end_step(self) -> None:
        """Join the side streams, finish the step and forget its groups; an error a
        release-time prefetch could not raise is raised now."""
        self.join()
        self.close_step()
        self.raise_deferred()

    def join(self) -> None:
        """Make the current stream wait on everything issued on the side streams
        (NOTE [side streams] in ``graphstash/_saved/streams.py``)."""
        for side in self._sides.values():
            side.join()

    def close_step(self) -> None:
        """Finish the open step, retire its pending groups and forget its groups."""
        if self._step_open:
            self._finish_step()
        self._retiring.drop_all()
        self.buffers.give_all_pages_back()       # NOTE [pages per group]: the caller joined
        self._groups = {}
        self._step_open = False

    def replan(self) -> None:
        """Forget the plan, the buffers and their sizes: the next complete step keeps every
        group's tensors and measures them again, and the plan and the buffers are made anew
        from it (NOTE [stash plan]). Outside a capture, between steps."""
        self.join()
        self.invalidate()
        self.plan = StashPlan(self.buffers.config.policy)
        self._remeasure = True
        self.buffers.forget()

    def invalidate(self) -> None:
        """Buffers change under the step: its handles are stale, its groups forgotten."""
        self.close_step()
        self.buffers.new_generation()

    def _start_step(self, reset_rings: bool) -> None:
        if reset_rings:
            self.join()
            self._retiring.drop_all()
            self.buffers.give_all_pages_back()
            self.buffers.create_measured()
            self.buffers.reset_rings()
        self._groups = {}
        self._next_gid = 0
        self._had_backward = False
        self._step += 1
        self._schedule.start_step()
        self._timeline = []
        self._end_queued = False
        self._step_open = True

    def _finish_step(self) -> None:
        tracked = [g for g in self._groups.values() if g.tracked]
        complete = all(g.backward_started for g in tracked)
        self._schedule.finish_step(complete)
        demand = {g.gid: g.demand for g in tracked if g.demand}
        if demand and not self.plan.made and complete:
            self.plan.make(self._schedule.events, [g for g in tracked if g.demand],
                           self.buffers.config, timeline=self._timeline)
            self._remeasure = False
            demand = {gid: d for gid, d in demand.items() if self.plan.stashes(gid)}
        self._timeline = []
        if demand and not self.plan.keep_all:
            for key, (pages, entries) in replay_demand(self._schedule.events, demand).items():
                self.buffers.note_peak(key, pages, entries)

    def next_group_rows(self) -> int | None:
        """The rows the next group's experts compute on (NOTE [rows the stash keeps] in
        ``plan.py``), or None for its whole budget."""
        if self._remeasure or self.buffers.released:
            return None
        gid = self._next_gid if self._step_open and not self._steps_apart() else 0
        c = self.buffers.config
        factor = c.device_factor + (c.host_factor if c.host_tier else 0.0)
        return self.plan.rows_kept(gid, factor, c.page_size)

    def _level(self, kind: str, gid: int) -> bool:
        """Add the bytes in use (:attr:`memory_meter`) to the timeline the plan is made from
        (NOTE [stash plan]): until the plan is made, outside a capture. Returns whether it
        did."""
        if self.plan.made or self.memory_meter is None or is_capturing():
            return False
        self._timeline.append((kind, gid, self.memory_meter()))
        return True

    def _queue_backward_end(self) -> None:
        """Have autograd add an ``"E"`` level when this backward pass ends (every gradient of
        the pass accumulated)."""
        def done():
            self._end_queued = False
            self._level("E", -1)

        try:
            torch.autograd.Variable._execution_engine.queue_callback(done)
        except RuntimeError:            # not inside a backward pass: no end to measure
            return
        self._end_queued = True

    def _steps_apart(self) -> bool:
        """True when every group of the open step has run its backward (NOTE [implicit steps])."""
        # NOTE [implicit steps]: without begin_step() calls, a forward group that starts after
        # every earlier group of the step was consumed by backward opens a new step (its
        # rings are consistent then: every page came back). The schedule recorded per such
        # step is what gradient accumulation (F B F B ...) repeats.
        return self._had_backward and all(g.remaining == 0 for g in self._groups.values()
                                          if g.tracked)

    # ---- forward --------------------------------------------------------------------------
    def open_group(self, name: str | None) -> Group:
        """A new layer group (``stash_activations`` entered); opens a step if none is open."""
        if self.buffers.released:
            raise ReleasedError("stash_activations: the StashManager was released; call "
                                "reallocate() first")
        if not self._step_open:
            self._start_step(reset_rings=True)
        elif self._steps_apart():
            self._finish_step()
            self._start_step(reset_rings=False)
        self._retire_pending()
        group = Group(self, self._next_gid, name, self.buffers.generation, self._step)
        self._next_gid += 1
        self._groups[group.gid] = group
        return group

    def pack(self, group: Group, t: torch.Tensor):
        """The saved-tensor pack hook: budget-sized candidates become an :class:`Entry`,
        anything else is kept as it is. Integer and bool tensors are kept: they are indices
        and masks (a compiled graph saves ``rows < live`` masks of budget length), whose rows
        past the counts mean something, and a reload does not bring those rows back."""
        scope = group.scopes[-1]
        if (not movable(t, self.buffers.device) or t.dim() < (1 if scope.segments == 1 else 2)
                or t.numel() * t.element_size() < self.buffers.config.min_tensor_bytes
                or not t.is_contiguous() or not t.is_floating_point()
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

    def close_group(self, group: Group, ok: bool) -> None:
        """The group's context exited (``ok``: without an exception): classify its entries,
        issue its stash (or note its demand in a warmup step) and prefetch what comes next."""
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
        classify(group, self.buffers.config.page_size, self.buffers.per_group)
        index = self._schedule.add(("F", group.gid, group.name))
        self._level("F", group.gid)
        group.f_index = index
        following = self._schedule.next_after(index)
        if (following == ("B", group.gid, group.name) and not self._remeasure) \
                or not self.plan.stashes(group.gid):
            group.entries = None         # NOTE [last group kept] / [stash plan], [entry cycle]
            return
        candidates = [e for e in entries if e.layout is not None]
        if not candidates:
            group.entries = None         # NOTE [entry cycle]
            return
        to_stash = []
        for e in candidates:
            if not self._remeasure and self.buffers.ensure(e.key):
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
                f"stash_activations: no stash buffer holds {key_name(e.key)} rows yet and a "
                "CUDA graph is capturing; run an eager warmup step before the capture (its "
                "demand sizes the buffers at the next begin_step()) or set "
                "StashConfig.initial_tokens")
        scope = e.scope
        if scope.counts_host is None:
            scope.counts_host = [int(v) for v in scope.num_tokens.tolist()]
        S, cap, _ = e.layout
        P = self.buffers.config.page_size
        pages = sum(-(-n // P) for n in scope.counts_host if 0 <= n <= cap)
        group.rows_peak = max([group.rows_peak] + [n for n in scope.counts_host if 0 <= n <= cap])
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
        tracer, side = self.tracer, self._sides["pack"]
        copy_blocks = self.buffers.config.copy_blocks or None
        group.has_stash = True
        group.lent_keys = list(dict.fromkeys(e.key for e in entries))
        for key in group.lent_keys:          # NOTE [pages per group]: on the compute stream
            self.buffers.take_pages(key)
        try:
            with side.fork():
                start = tracer.timer(side.stream) if tracer is not None else None
                for e in entries:
                    e.handle = self.buffers.get(e.key).stash(e.stash_view(), e.scope.snapshot,
                                                             max_blocks=copy_blocks)
                    e.stashed = True
                    self.buffers.note_entries(e.key, e.record_len)
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
        if self.buffers.config.prefetch == "on_demand":
            return
        _, gid, name = event
        group = self._groups.get(gid)
        if (group is not None and group.name == name and group.has_stash
                and not group.reload_issued and not group.backward_started
                and group.ring_generation == self.buffers.generation
                and not self.buffers.released):
            self._reload(group)

    def _check_reloadable(self, group: Group) -> None:
        if self.buffers.released:
            raise ReleasedError(
                f"stash_activations: group {group.label} cannot be reloaded, the StashManager "
                "was released after its forward; run the forward again")
        if group.ring_generation != self.buffers.generation:
            raise StaleHandleError(
                f"stash_activations: group {group.label} was stashed before the manager's last "
                "begin_step(), size_from_demand(), release() or reallocate(); its pages were "
                "returned then, so its saved tensors are gone: run the forward again")

    def _reload(self, group: Group) -> None:
        self._check_reloadable(group)
        self._retire_pending()
        stashed = [e for e in group.entries if e.stashed]
        device = self.buffers.device
        outs = [torch.empty(e.reload_shape(), dtype=e.dtype, device=device) for e in stashed]
        tracer, side = self.tracer, self._sides["unpack"]
        copy_blocks = self.buffers.config.copy_blocks or None
        kind = "reload" if group.backward_started else "prefetch"
        try:
            with side.fork():
                start = tracer.timer(side.stream) if tracer is not None else None
                for e, out in zip(stashed, outs):
                    self.buffers.get(e.key).reload(e.handle, out=out, zero_tail=e.scope.zero_tail,
                                                   max_blocks=copy_blocks)
                    e.out = out.view(e.shape)
                    e.handle = None
                    self.buffers.note_entries(e.key, -e.record_len)
                end = tracer.timer(side.stream) if tracer is not None else None
        finally:
            group.reload_mark = side.mark()
            group.reload_issued = True
        if tracer is not None:
            tracer.note(kind, group, start, end)
        group.entries = None      # autograd holds the entries (and their reloaded tensors)

    def unpack(self, packed) -> torch.Tensor:
        """The saved-tensor unpack hook: a kept tensor as it is, an entry's tensor reloaded
        (issuing the reload if no prefetch did) and checked for in-place changes."""
        if isinstance(packed, Kept):
            return packed.unpack()
        entry: Entry = packed
        self.raise_deferred()
        group = entry.group
        if entry.stashed and entry.out is None:
            self._check_reloadable(group)
        if not group.backward_started:
            group.backward_started = True
            if group.step == self._step:
                self._had_backward = True
                group.b_index = self._schedule.add(("B", group.gid, group.name))
                if self._level("B", group.gid) and not self._end_queued:
                    self._queue_backward_end()
            self._retire_pending()
        if entry.stashed:
            if not group.reload_issued:
                self._reload(group)
            stream = torch.cuda.current_stream(self.buffers.device) if self._cuda else None
            if stream is not None and stream.cuda_stream not in group.reload_waited:
                self._sides["unpack"].wait(group.reload_mark)
                group.reload_waited.add(stream.cuda_stream)
            self._give_pages_back(group)
            entry.saved.check(f"in group {group.label}, after its stash")
            tensor = entry.out
        else:
            entry.saved.check(f"in group {group.label}, kept on the device", held=entry.tensor)
            tensor = entry.tensor
        if not entry.unpacked:
            entry.unpacked = True
            group.remaining -= 1
            if (group.remaining == 0 and self.buffers.config.prefetch == "at_last_unpack"
                    and group.b_index is not None and group.step == self._step):
                self._prefetch_after(group)
        return tensor

    def _give_pages_back(self, group: Group) -> None:
        """Free the group's lent pages once its reload is waited for (NOTE [pages per group]):
        the streams that took them wait for the reload first, so the allocator may hand their
        memory to the next allocation on those streams."""
        if not group.lent_keys:
            return
        for key in group.lent_keys:
            taken_on = self.buffers.get(key).pages_stream
            current = torch.cuda.current_stream(self.buffers.device) if self._cuda else None
            if taken_on is not None and taken_on != current:
                with torch.cuda.stream(taken_on):
                    self._sides["unpack"].wait(group.reload_mark)
        self.buffers.give_pages_back(group.lent_keys)
        group.lent_keys = None

    def _prefetch_after(self, group: Group) -> None:
        following = self._schedule.next_after(group.b_index)
        if following is not None and following[0] == "B":
            self._prefetch(following)

    def group_released(self, group: Group) -> None:
        """Every saved tensor of ``group`` was released by autograd (NOTE [prefetch]); called
        from ``Entry.__del__``, so an error is kept and raised at the next hook or step end."""
        if (self.buffers.config.prefetch != "after_release" or group.b_index is None
                or group.step != self._step or not self._step_open
                or group.remaining != 0 or self.buffers.released):
            return
        try:
            self._prefetch_after(group)
        except Exception as exc:          # called from Entry.__del__: cannot raise there
            self._deferred_error = exc

    def raise_deferred(self) -> None:
        """Raise the error a release-time prefetch kept, if any."""
        exc, self._deferred_error = self._deferred_error, None
        if exc is not None:
            raise exc
