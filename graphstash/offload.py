"""Activation offload to pinned host memory: layer groups, overlapped copies, prefetched reload.

The tensors autograd saves for backward inside a *group* (a layer, or part of one) are copied
to pinned host memory on a device-to-host stream when the group is committed, their device
memory is given back once the copy is done, and in backward they come back on a host-to-device
stream, the group before them being fetched while the current one computes.

A policy on the saved-tensor core (:mod:`graphstash._saved`): the host pool, storage records
and copier (``_saved/host.py``) are shared with :mod:`graphstash.swap`; hook context, version
checks, side streams and retirement with the stash too.

Example::

    offloader = graphstash.ActivationOffloader(min_tensor_bytes=1 << 20, keep_last=1)
    for batch in loader:
        with offloader:                       # one forward
            x = batch
            for i, block in enumerate(model.blocks):
                with offloader.group(f"block{i}"):
                    x = block(x)
            loss = head(x).float().mean()
        loss.backward()                       # outside or inside the `with`
        opt.step()
    print(offloader.summary_table())
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

from ._checks import describe, normalize_device, require_positive_int
from ._saved import HookContext, Kept, RetireQueue
from ._saved.host import HostCopier, HostHandle, HostPool, StorageRecord, host_movable, storage_key
from .errors import SavedTensorsError
from .tables import Column, Table

__all__ = ["ActivationOffloader", "HostPool"]


# ---------------------------------------------------------------------------------------------
# Activation offload
# ---------------------------------------------------------------------------------------------

_OPEN, _DELAYED, _COPYING, _ON_HOST, _RELOADING, _READY = (
    "open", "delayed", "copying", "on_host", "reloading", "ready")


@dataclasses.dataclass(eq=False)
class _Group:
    name: str
    index: int
    chunk: "_Chunk"
    offload: bool                      # decided at start: enabled and not one of the last kept
    state: str = _OPEN
    records: dict = dataclasses.field(default_factory=dict)     # storage key -> StorageRecord
    saves: list = dataclasses.field(default_factory=list)       # SavedVersion per save
    handles: list = dataclasses.field(default_factory=list)     # weakrefs to the HostHandles
    release: list = dataclasses.field(default_factory=list)     # tensors to free after D2H
    h2d_mark: object = None
    nbytes: int = 0
    outstanding: int = 0               # records not fully unpacked


@dataclasses.dataclass(eq=False)
class _Chunk:
    """One forward (one ``with offloader:``): its groups in forward order."""

    groups: list = dataclasses.field(default_factory=list)
    closed: bool = False
    outstanding: int = 0


class ActivationOffloader:
    """Offloads the activations saved inside layer groups to pinned host memory, and back.

    One ``with offloader:`` block is one forward. Inside it, each group (``with
    offloader.group(name):`` or :meth:`group_start` / :meth:`group_commit`) collects the
    tensors autograd saves for backward; at commit their copies to host are queued on a side
    stream and their device memory is released once the copy is done (at the next commit).
    In backward, the first use of a group's tensors (or the gradient reaching its committed
    output) reloads it if needed and prefetches the group before it, so copies overlap compute.
    Tensors saved outside any group, smaller than ``min_tensor_bytes``, marked with
    :func:`graphstash.mark_not_movable`, parameters, or not on ``device`` stay on the device.

    Args:
        min_tensor_bytes: smallest tensor (in bytes) worth moving. Default 1 MiB.
        keep_last: the last ``keep_last`` groups of a forward stay on the device (their backward
            comes first, so moving them would only cost time). The number of groups is
            ``num_groups`` or, if None, learned from the previous forward (the first forward
            offloads every group).
        num_groups: groups per forward, if known up front.
        device: the device whose tensors are offloaded (default: current CUDA device). A CPU
            device runs the same logic with synchronous copies into the pool (for tests).
        enabled: start enabled; see :attr:`enabled`.
        host_pool: share a :class:`HostPool` (e.g. with a :class:`~graphstash.swap.TensorSwapper`).

    NOTE [offload under a CUDA graph]: run at least one eager step (the graph manager's warmup)
    before capturing: it creates the side streams, fills the host pool with every buffer a step
    needs (NOTE [host pool]) and teaches ``keep_last`` the number of groups. The captured step
    then records the copies, event records and waits, and replays them with the same buffers.
    Per-forward state is cleared by itself once backward has used every offloaded tensor;
    :meth:`reset` clears it by force (call it between steps if a forward's graph may be dropped
    without backward, e.g. after an exception). Offloaded tensors support one backward
    (``retain_graph=True`` with a second backward is refused) and no double backward.

    Example::

        off = ActivationOffloader(min_tensor_bytes=1 << 20)
        with off:
            for i, block in enumerate(blocks):
                x = off.group_start(x, f"block{i}")
                x = block(x)
                x = off.group_commit(x)
        x.float().pow(2).mean().backward()
    """

    def __init__(self, *, min_tensor_bytes: int = 1 << 20, keep_last: int = 1,
                 num_groups: int | None = None, device=None, enabled: bool = True,
                 host_pool: HostPool | None = None):
        require_positive_int("min_tensor_bytes", min_tensor_bytes, allow_zero=True)
        require_positive_int("keep_last", keep_last, allow_zero=True)
        if num_groups is not None:
            require_positive_int("num_groups", num_groups)
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
        if host_pool is not None and not isinstance(host_pool, HostPool):
            raise TypeError(f"host_pool: expected a HostPool or None, got {type(host_pool).__name__}")
        self.min_tensor_bytes = min_tensor_bytes
        self.keep_last = keep_last
        self.num_groups = num_groups
        self.device = normalize_device(device)
        self.enabled = enabled
        self.host_pool = host_pool if host_pool is not None else HostPool(self.device.type == "cuda")
        self._mover = HostCopier(self.device, self.host_pool)
        self._learned_groups: int | None = None
        self._chunk: _Chunk | None = None          # the open forward
        self._group: _Group | None = None          # the open group
        self._chunks: list[_Chunk] = []            # forwards whose backward is not done
        self._copying = RetireQueue(self._mover.d2h)   # D2H queued, device memory still held
        self._delayed: list[_Group] = []           # committed with delay=True, not yet copied
        self._summary: list[tuple[str, int]] = []  # (group name, bytes) of the last forward
        self._hooks = None

    # -- switching -------------------------------------------------------------------------
    def enable(self) -> None:
        """Offload groups started from now on (e.g. back on for the next step)."""
        self.enabled = True

    def disable(self) -> None:
        """Keep the tensors of groups started from now on on the device (e.g. last microbatches)."""
        self.enabled = False

    @property
    def pending_forwards(self) -> int:
        """Forwards whose backward has not used every offloaded tensor yet (0 between steps)."""
        return len(self._chunks)

    @property
    def transfer_log(self):
        """Recent copies, oldest first: ``("d2h" | "h2d" | "adopt" | "release", group name)``."""
        return self._mover.log

    # -- forward scope ---------------------------------------------------------------------
    def __enter__(self):
        if self._chunk is not None:
            raise SavedTensorsError("ActivationOffloader entered while its forward is still open: "
                               "each `with offloader:` is one forward and cannot be re-entered")
        hooks = HookContext(self, "ActivationOffloader forward scope", self._pack, self._unpack)
        hooks.__enter__()                   # NOTE [one hook context]: refuses nesting
        self._hooks = hooks
        self._drop_abandoned_chunks()
        self._chunk = _Chunk()
        self._chunks.append(self._chunk)
        return self

    def __exit__(self, exc_type, exc, tb):
        chunk = self._chunk
        self._hooks.__exit__(exc_type, exc, tb)   # refuses an exit out of order
        self._hooks = None
        if exc_type is not None:
            self._group = None
            self._chunk = None
            chunk.closed = True
            return False
        if self._group is not None:
            name = self._group.name
            self._group = None
            self._chunk = None
            chunk.closed = True
            raise SavedTensorsError(f"forward scope closed while group {name!r} is open: "
                               "commit every group before leaving `with offloader:`")
        self.flush_delayed()
        chunk.closed = True
        self._chunk = None
        self._learned_groups = len(chunk.groups)
        self._summary = [(g.name, g.nbytes) for g in chunk.groups]
        self._retire_if_done(chunk)
        return False

    # -- groups ----------------------------------------------------------------------------
    def _is_kept(self, index: int) -> bool:
        total = self.num_groups if self.num_groups is not None else self._learned_groups
        return total is not None and index >= total - self.keep_last

    def _begin(self, name) -> _Group:
        if self._chunk is None:
            raise SavedTensorsError(f"group {name!r} started outside `with offloader:`; "
                               "groups live inside a forward scope")
        if self._group is not None:
            raise SavedTensorsError(f"group {name!r} started while group {self._group.name!r} is open: "
                               "groups do not nest; commit the open group first")
        index = len(self._chunk.groups)
        if name is None:
            name = f"group{index}"
        elif not isinstance(name, str):
            raise TypeError(f"name: expected a str or None, got {type(name).__name__}")
        group = _Group(name, index, self._chunk, self.enabled and not self._is_kept(index))
        self._chunk.groups.append(group)
        self._group = group
        return group

    def _commit(self, name, release, delay: bool) -> _Group:
        group = self._group
        if group is None:
            raise SavedTensorsError("group_commit() without an open group: call group_start() first")
        if name is not None and name != group.name:
            raise SavedTensorsError(f"group_commit(name={name!r}) but the open group is {group.name!r}")
        if not isinstance(delay, bool):
            raise TypeError(f"delay: expected a bool, got {type(delay).__name__}")
        group.release = self._check_release(group, release)
        self._group = None
        for saved in group.saves:
            saved.check(f"in group {group.name!r}, before its copy to host")
        # bytes moved, each storage once (NOTE [one record per storage])
        group.nbytes = sum(r.plan() for r in group.records.values())
        # NOTE [release one commit later]: the copies queued at a commit (delayed groups, then
        # the group itself) overlap the next group's forward; at every commit, the groups whose
        # copies were queued at earlier commits are waited on and their device memory released
        # (so the last offloaded group is released by the commit of a kept group after it).
        older = self._copying.owners()
        if delay and group.records:
            group.state = _DELAYED
            self._delayed.append(group)
        elif not delay:
            self.flush_delayed()
            if group.records:
                self._copy_out(group)
            else:
                group.state = _READY
        else:
            group.state = _READY
        self._copying.retire(older)         # NOTE [retire at the schedule point]
        return group

    def _check_release(self, group: _Group, release) -> list:
        if release is None:
            return []
        if isinstance(release, torch.Tensor):
            release = [release]
        tensors = list(release)
        offloaded = set(group.records)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"release[{i}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.untyped_storage().data_ptr() not in offloaded:
                raise ValueError(
                    f"release[{i}]: {describe(t)} was not offloaded by group {group.name!r}; "
                    "freeing it would destroy data that backward still reads (only tensors "
                    "whose storage the group copied to host can be released)")
        return tensors

    def _copy_out(self, group: _Group) -> None:
        mark = self._mover.to_host(list(group.records.values()), group.name)
        group.state = _COPYING
        self._copying.add(group, mark, lambda: self._release_device(group))

    def _release_device(self, group: _Group) -> None:
        """After the group's D2H: drop the device tensors and free the forced releases."""
        for rec in group.records.values():
            rec.drop_device()
        for t in group.release:
            t.untyped_storage().resize_(0)
        group.release = []
        group.state = _ON_HOST
        self._mover.log.append(("release", group.name))

    def flush_delayed(self) -> None:
        """Queue the copies of groups committed with ``delay=True`` (also done at the next
        non-delayed commit and when the forward scope closes)."""
        delayed, self._delayed = self._delayed, []
        for group in delayed:
            if group.state == _DELAYED:
                self._copy_out(group)

    @contextlib.contextmanager
    def group(self, name: str | None = None, *, release=None, delay: bool = False):
        """Context manager form of :meth:`group_start` / :meth:`group_commit`.

        Example::

            with off:
                with off.group("attn"):
                    x = attn(x)
        """
        group = self._begin(name)
        try:
            yield group.name
        except BaseException:
            if self._group is group:
                self._group = None
            raise
        self._commit(None, release, delay)

    def group_start(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Open a group; returns ``tensor`` itself (any shape/dtype/device; it only marks the spot).

        Example::

            x = off.group_start(x, "block3")
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        self._begin(name)
        return tensor

    def group_commit(self, tensor: torch.Tensor, name: str | None = None, *, release=None,
                     delay: bool = False) -> torch.Tensor:
        """Close the open group and queue its copy to host; returns ``tensor`` itself.

        Args:
            tensor: the group's output (any shape/dtype, on ``device``). When it requires grad,
                the gradient reaching it starts the group's reload in backward (and the prefetch
                of the group before it), before the first of its saved tensors is needed.
            name: if given, must be the open group's name (catches mismatched start/commit).
            release: tensors (or one) whose storage was offloaded by this group but that
                something other than autograd keeps alive (e.g. a custom Function's ``ctx``);
                their storage is freed (``untyped_storage().resize_(0)``) once the copy is done.
                They must not be read again in forward.
            delay: queue this group's copy later, at the next non-delayed commit or
                :meth:`flush_delayed` (e.g. to keep the copy off a communication phase).

        Example::

            x = off.group_commit(x, "block3")
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        group = self._commit(name, release, delay)
        if tensor.requires_grad:
            tensor.register_hook(lambda grad, g=group: self._backward_reached(g))
        return tensor

    # -- saved-tensor hooks ----------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        group = self._group
        if (group is None or not group.offload or t.numel() * t.element_size() < self.min_tensor_bytes
                or not host_movable(t, self.device)):
            return Kept(t)
        key = storage_key(t)                 # NOTE [one record per storage]
        rec = group.records.get(key)
        if rec is None:
            rec = group.records[key] = StorageRecord(t, group, key)
            group.outstanding += 1
            group.chunk.outstanding += 1
        rec.refs += 1
        handle = HostHandle(rec, rec.add_view(t), t)
        group.saves.append(handle.saved)
        group.handles.append(weakref.ref(handle))
        return handle

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, Kept):
            return packed.unpack()
        rec = packed.owner
        if rec.refs <= 0:
            raise SavedTensorsError("an offloaded saved tensor was used twice: offloaded activations "
                               "support one backward (no retain_graph=True second backward)")
        packed.saved.check("after it was offloaded")
        group = rec.owner
        self._make_ready(group)
        self._prefetch_before(group)
        out = packed.view.back
        rec.refs -= 1
        if rec.refs == 0:
            rec.give_back(self.host_pool)
            group.outstanding -= 1
            group.chunk.outstanding -= 1
            self._retire_if_done(group.chunk)
        return out

    # -- backward --------------------------------------------------------------------------
    def _backward_reached(self, group: _Group) -> None:
        # the gradient reached the group's output: its backward starts now (a kept group's too)
        if group.outstanding:
            self._make_ready(group)
        self._prefetch_before(group)

    def _make_ready(self, group: _Group) -> None:
        """Bring ``group`` to the device (waiting on its copies) before backward reads it."""
        if group.state == _READY:
            return
        if group.state == _OPEN:
            raise SavedTensorsError(f"backward used a tensor of group {group.name!r} while the group "
                               "was still open: commit it before running backward")
        if group.state == _DELAYED:
            # never copied: backward came first, so hand the device tensors over directly
            self._delayed.remove(group)
            self._adopt(group)
        elif group.state == _COPYING:
            # still on the device: wait for the copy (the host buffer may be reused after
            # this), then use the device tensors rather than copying them back
            self._copying.wait(group)
            self._adopt(group)
        elif group.state == _ON_HOST:
            self._reload(group)
        if group.state == _RELOADING:
            self._mover.h2d.wait(group.h2d_mark)
        group.state = _READY

    def _adopt(self, group: _Group) -> None:
        for rec in group.records.values():
            rec.adopt()
        group.release = []
        self._mover.log.append(("adopt", group.name))

    def _reload(self, group: _Group) -> None:
        group.h2d_mark = self._mover.to_device(list(group.records.values()), group.name)
        group.state = _RELOADING

    def _prefetch_before(self, group: _Group) -> None:
        """Queue the reload of the nearest earlier group of the same forward still on the host."""
        for earlier in reversed(group.chunk.groups[: group.index]):
            if earlier.outstanding:
                if earlier.state == _ON_HOST:
                    self._reload(earlier)
                return          # otherwise it is on its way or still on the device

    def _retire_if_done(self, chunk: _Chunk) -> None:
        if chunk.closed and chunk.outstanding == 0 and chunk in self._chunks:
            self._chunks.remove(chunk)
            if not self._chunks and self._chunk is None:
                self._mover.join()

    def _drop_abandoned_chunks(self) -> None:
        """Retire closed forwards whose autograd graph is gone (no handle left alive)."""
        for chunk in list(self._chunks):
            if not chunk.closed:
                continue
            alive = any(ref() is not None for g in chunk.groups for ref in g.handles)
            if not alive:
                self._retire_chunk(chunk)

    def _retire_chunk(self, chunk: _Chunk) -> None:
        for group in chunk.groups:
            self._copying.wait(group)
            if group in self._delayed:
                self._delayed.remove(group)
            if group.state == _RELOADING:
                self._mover.h2d.wait(group.h2d_mark)
            for rec in group.records.values():
                rec.refs = 0
                rec.give_back(self.host_pool)
            group.outstanding = 0
            group.state = _READY
        chunk.outstanding = 0
        chunk.closed = True
        if chunk in self._chunks:
            self._chunks.remove(chunk)

    # -- step-level control ----------------------------------------------------------------
    def reset(self) -> None:
        """Forget every forward whose backward has not run (their saved tensors become unusable),
        join the side streams into the current stream and mark every host buffer free.

        Not needed in a normal loop (state clears itself when backward finishes); call it
        after an exception or a forward whose graph was dropped. Safe inside a capture.
        """
        if self._chunk is not None:
            raise SavedTensorsError("reset() inside `with offloader:`; call it between steps")
        for chunk in list(self._chunks):
            self._retire_chunk(chunk)
        self._mover.join()
        self.host_pool.reclaim()

    def release(self) -> None:
        """:meth:`reset`, then free the host pool (no captured graph using it may replay)."""
        self.reset()
        self.host_pool.release()

    # -- reporting -------------------------------------------------------------------------
    def summary(self) -> dict[str, int]:
        """Bytes offloaded per group name by the last completed forward, plus ``"total"``; each
        device storage counts once however many of its views were saved (NOTE [one record
        per storage])."""
        out: dict[str, int] = {}
        for name, nbytes in self._summary:
            out[name] = out.get(name, 0) + nbytes
        out["total"] = sum(n for _, n in self._summary)
        return out

    def summary_table(self) -> str:
        """An ASCII table of :meth:`summary`: one row per rank (all ranks when torch.distributed
        is initialised, which makes this a collective every rank must call), one column per group.
        """
        rows = [self.summary()]
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rows[0])
            rows = gathered
        return format_bytes_table(rows)


def format_bytes_table(rows: list[dict[str, int]]) -> str:
    """Rows (one per rank) of {column: bytes} as a text table in MiB, ``total`` last."""
    columns: list[str] = []
    for row in rows:
        for name in row:
            if name != "total" and name not in columns:
                columns.append(name)
    columns.append("total")
    table = Table([Column("rank")] + [Column(c, ".2f") for c in columns])
    return table.render([[rank] + [row.get(c, 0) / 2**20 for c in columns]
                         for rank, row in enumerate(rows)], title="offloaded MiB per group")
