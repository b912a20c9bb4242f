"""Activation offload to pinned host memory: layer groups, overlapped copies, prefetched reload.

The tensors autograd saves for backward inside a *group* (a layer, or part of one) are copied
to pinned host memory on a device-to-host stream when the group is committed, their device
memory is given back once the copy is done, and in backward they come back on a host-to-device
stream, the group before them being fetched while the current one computes.

The same machinery (host pool, side streams, saved-tensor records, version checks) serves
:mod:`graphstash.swap`.

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

import collections
import contextlib
import dataclasses
import threading
import weakref

import torch

from ._checks import describe, forbid_capture, require_positive_int
from .errors import GraphstashError

__all__ = ["ActivationOffloader", "HostPool", "OffloadError", "SavedTensorModifiedError"]


class OffloadError(GraphstashError):
    """Offload or swap used wrongly: contexts nested or closed out of order, a group misused."""


class SavedTensorModifiedError(OffloadError):
    """A tensor saved for backward was modified in place before backward used it."""


# ---------------------------------------------------------------------------------------------
# Pinned host pool
# ---------------------------------------------------------------------------------------------

def _size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its pool size class: 4 KiB minimum, then 4 classes per power of 2."""
    if nbytes <= 4096:
        return 4096
    top = 1 << (nbytes - 1).bit_length()        # next power of two >= nbytes
    step = top // 8                             # classes at 5/8, 6/8, 7/8, 8/8 of `top`
    return -(-nbytes // step) * step


class HostPool:
    """Reusable host buffers (pinned when they serve a CUDA device) for offloaded tensors.

    NOTE [host pool]: pinned allocation is slow (it maps pages and may synchronize) and is not
    allowed while a CUDA graph is being captured, so offloaded tensors never allocate their own
    host memory. A buffer is taken from a free list of its size class (:func:`_size_class`)
    when a tensor is offloaded and given back once that tensor has been reloaded (or dropped).
    The lists are LIFO and the order of takes follows program order, so the buffers a step
    uses are the same every step: after one eager step the pool holds enough buffers for any
    later step of the same shapes, and a captured step finds all of them already there. A
    capture that would need a new buffer raises :class:`CaptureError` instead. Buffers are only
    freed by :meth:`release` (a captured graph keeps writing to and reading from them).

    Args:
        pin_memory: allocate page-locked memory (needs CUDA). Default: ``torch.cuda.is_available()``.

    Example::

        pool = HostPool(pin_memory=False)
        buf = pool.take(10_000)       # uint8 tensor of >= 10_000 bytes on the CPU
        pool.give(buf)
        assert pool.take(9_000) is buf
    """

    def __init__(self, pin_memory: bool | None = None):
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory: expected a bool or None, got {type(pin_memory).__name__}")
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._in_use: dict[int, torch.Tensor] = {}
        self.allocations = 0            # buffers ever allocated (pinned allocations)
        self.allocated_bytes = 0        # bytes held by the pool, free or in use

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU buffer of at least ``nbytes`` bytes (its size class), reused when possible."""
        require_positive_int("nbytes", nbytes)
        size = _size_class(nbytes)
        free = self._free[size]
        if free:
            buf = free.pop()
        else:
            forbid_capture(f"allocating a {size}-byte host buffer for offload (run one eager step "
                           "before capturing so the host pool holds every buffer the step needs)")
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.allocations += 1
            self.allocated_bytes += size
        self._in_use[id(buf)] = buf
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`take` (uint8, CPU)."""
        if self._in_use.pop(id(buf), None) is None:
            raise ValueError("buf: expected a buffer taken from this pool and not yet given back")
        self._free[buf.numel()].append(buf)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the buffers taken and not yet given back."""
        return sum(b.numel() for b in self._in_use.values())

    def reclaim(self) -> None:
        """Mark every buffer free (after a step was abandoned; see ``ActivationOffloader.reset``)."""
        for buf in self._in_use.values():
            self._free[buf.numel()].append(buf)
        self._in_use.clear()

    def release(self) -> None:
        """Free every buffer. No captured graph that offloads through this pool may replay after."""
        forbid_capture("HostPool.release()")
        self._free.clear()
        self._in_use.clear()
        self.allocated_bytes = 0


# ---------------------------------------------------------------------------------------------
# Saved-tensor records and the copy engine shared with swap.py
# ---------------------------------------------------------------------------------------------

def _is_dense(t: torch.Tensor) -> bool:
    """True if ``t`` covers exactly ``numel`` consecutive elements (any dim order, no gaps)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _dense_strides_like(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor of ``t``'s shape whose dimensions are ordered like ``t``'s."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), -d))   # innermost first
    strides = [0] * t.dim()
    step = 1
    for d in order:
        strides[d] = step
        step *= t.shape[d]
    return tuple(strides)


def _is_non_overlapping(t: torch.Tensor) -> bool:
    """Sufficient test that no two elements of ``t`` share memory (strides sorted, each past the rest)."""
    reach = 0
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda p: p[1]):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base
    return (isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)
            or (t.is_leaf and t.requires_grad) or (base is not None and base.is_leaf and base.requires_grad))


def _storage_ptr(t: torch.Tensor) -> int:
    """Identifies ``t``'s storage among live storages (a record holds its storage alive)."""
    return t.untyped_storage().data_ptr()


def _movable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` can be moved to host and back at all (size thresholds aside)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device == device
            and t.numel() > 0 and not _is_parameter(t) and _is_non_overlapping(t))


class _View:
    """One saved layout of a record's storage: where its bytes lie and how to rebuild it."""

    __slots__ = ("shape", "stride", "offset", "dtype", "itemsize", "dense", "nbytes", "lo", "hi",
                 "device", "back")

    def __init__(self, t: torch.Tensor):
        size = t.element_size()
        self.shape = tuple(t.shape)
        self.stride = t.stride()
        self.offset = t.storage_offset()            # in elements of dtype
        self.dtype = t.dtype
        self.itemsize = size
        self.dense = _is_dense(t)
        self.nbytes = t.numel() * size
        self.lo = self.offset * size                # bytes of the storage the view spans
        self.hi = self.lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * size
        self.device = t.detach()                    # NOTE [detached references]
        self.back = None                            # the device tensor handed to backward

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        return (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Part:
    """One host copy of a record: a byte span of the storage, or one (packed) view."""

    __slots__ = ("view", "shape", "stride", "dtype", "nbytes", "host_buf", "host", "back")

    def __init__(self, view: _View | None, shape, stride, dtype, nbytes: int):
        self.view = view                            # None for a byte span
        self.shape, self.stride, self.dtype, self.nbytes = shape, stride, dtype, nbytes
        self.host_buf = self.host = self.back = None


class _Record:
    """One device storage's journey: device -> host buffer(s) -> device, for every view of it
    saved in one group (offload) or one layer (swap).

    NOTE [one record per storage]: autograd often saves several tensors that share one storage
    (softmax saves its output and the next matmul a reshaped view of it; a fused projection's
    q/k/v slices are saved by attention; ``x`` and ``x.t()``). Moving each view on its own would
    copy the same bytes several times, allocate them several times on reload, and count bytes
    that are freed only once. So records are keyed by storage, and :meth:`plan` decides how the
    views move: when the byte span they cover together is no larger than the sum of their
    sizes (one dense view; views that overlap; slices that tile the storage) the span is moved
    once as raw bytes and every view is rebuilt on the reloaded span with its own strides and
    offset; otherwise (e.g. one slice of a wide storage) each view moves on its own, dense
    views as they are and non-dense ones packed (NOTE [reload layout]). ``nbytes`` is what is
    moved, which is also what the device gives back once the storage is dropped (more, when
    only slices of it were saved).

    NOTE [reload layout]: a dense tensor (any dimension order) comes back with exactly its
    strides. A non-dense view moved on its own (a slice of a fused projection) comes back dense,
    its dimensions in the same stride order (keeping its strides would reload the whole span it
    was cut from); ops in backward then lay out their outputs as they would have without
    offload. The host copy has the reload's strides, so the D2H and H2D copies are single
    memcpys; a non-dense source is first packed into a dense temporary on the d2h stream
    (copying it straight to a host tensor of other strides would make torch stage it through
    pageable memory).
    """

    __slots__ = ("views", "parts", "span", "nbytes", "refs", "owner", "key", "version")

    def __init__(self, t: torch.Tensor, owner, key):
        self.views: dict[tuple, _View] = {}
        self.parts: list[_Part] = []
        self.span = None                     # (lo, hi) bytes when the span moves as one part
        self.nbytes = 0                      # bytes moved (set by plan)
        self.refs = 0                        # handles not yet unpacked
        self.owner = owner                   # the group (offload) or layer (swap) it belongs to
        self.key = key                       # the storage's data_ptr
        self.version = t._version            # shared by every view of the storage
        self.add_view(t)

    def add_view(self, t: torch.Tensor) -> _View:
        key = _View.key(t)
        view = self.views.get(key)
        if view is None:
            view = self.views[key] = _View(t)
        return view

    def plan(self) -> int:
        """Decide how the views move (NOTE [one record per storage]); returns the bytes moved."""
        views = list(self.views.values())
        align = max(v.itemsize for v in views)
        lo = min(v.lo for v in views)
        lo -= lo % align                     # every view's offset stays a whole element
        hi = max(v.hi for v in views)
        if hi - lo <= sum(v.nbytes for v in views):
            self.span = (lo, hi)
            if len(views) == 1:              # one dense view: its span is exactly its bytes
                v = views[0]
                self.parts = [_Part(v, v.shape, v.stride, v.dtype, v.nbytes)]
            else:
                self.parts = [_Part(None, (hi - lo,), (1,), torch.uint8, hi - lo)]
        else:
            self.span = None
            self.parts = [_Part(v, v.shape, v.stride if v.dense else _dense_strides_like(v.device),
                                v.dtype, v.nbytes) for v in views]
        self.nbytes = sum(p.nbytes for p in self.parts)
        return self.nbytes

    def covers(self, t: torch.Tensor) -> bool:
        """Whether a planned record's copy already holds every byte of ``t`` (same version)."""
        if t._version != self.version:
            return False
        if _View.key(t) in self.views:
            return True
        if self.span is None:
            return False
        lo = t.storage_offset() * t.element_size()
        hi = lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
        start, end = self.span
        return start <= lo and hi <= end and (lo - start) % t.element_size() == 0

    def make_host_views(self, pool: HostPool) -> None:
        for part in self.parts:
            part.host_buf = pool.take(part.nbytes)
            flat = part.host_buf[: part.nbytes].view(part.dtype)
            part.host = flat.as_strided(part.shape, part.stride)

    def source(self, part: _Part) -> torch.Tensor:
        """The device tensor laid out like ``part``'s host copy (a temporary on the current
        stream when it is a non-dense view moved on its own)."""
        if part.view is None:                # the raw byte span of the storage
            any_view = next(iter(self.views.values())).device
            lo, hi = self.span
            return torch.empty(0, dtype=torch.uint8, device=any_view.device).set_(
                any_view.untyped_storage(), lo, (hi - lo,), (1,))
        src = part.view.device
        if part.view.dense:
            return src
        tmp = torch.empty_strided(part.shape, part.stride, dtype=part.dtype, device=src.device)
        return tmp.copy_(src)

    def alloc_back(self, device: torch.device) -> None:
        """Allocate the reload destinations (current stream) and rebuild every view on them."""
        for part in self.parts:
            part.back = torch.empty_strided(part.shape, part.stride, dtype=part.dtype,
                                            device=device)
            if part.view is not None:
                part.view.back = part.back
        if self.span is not None:            # byte b of the span is byte b - lo of the reload
            storage, lo = self.parts[0].back.untyped_storage(), self.span[0]
            for v in self.views.values():
                if v is not self.parts[0].view:
                    v.back = torch.empty(0, dtype=v.dtype, device=device).set_(
                        storage, (v.lo - lo) // v.itemsize, v.shape, v.stride)

    def drop_device(self) -> None:
        """Drop the references to the original storage (its D2H copy was waited on)."""
        for v in self.views.values():
            v.device = None

    def adopt(self) -> None:
        """Hand the original device tensors to backward (no copy back needed)."""
        for v in self.views.values():
            v.back, v.device = v.device, None

    def give_back(self, pool: HostPool) -> None:
        for part in self.parts:
            if part.host_buf is not None:
                pool.give(part.host_buf)
            part.host_buf = part.host = part.back = None
        for v in self.views.values():
            v.device = v.back = None


class _Handle:
    """What autograd stores in place of an offloaded tensor: its record, view and saved version."""

    __slots__ = ("record", "view", "ref", "version", "__weakref__")

    def __init__(self, record: _Record, view: _View, t: torch.Tensor):
        self.record = record
        self.view = view
        self.ref = weakref.ref(t)
        self.version = t._version


class _Kept:
    """What autograd stores for a tensor left on the device: the tensor and its saved version.

    Autograd skips its own in-place check when saved-tensor hooks are installed, so every
    tensor packed by graphstash is checked here instead (NOTE [in-place check]).
    """

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach()             # NOTE [detached references]
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            _check_version(lambda: self.tensor, self.version, "it stayed on the device")
        return self.tensor


# NOTE [in-place check]: autograd compares a saved tensor's version counter at unpack only when
# no saved-tensor hooks are installed, so under offload an in-place write to a saved activation
# would silently produce wrong gradients. Every pack records ``tensor._version`` and a weak
# reference to the tensor; the version is compared again before the D2H copy (a write between
# save and copy would be copied to host) and at unpack (a write after the copy). A weak reference
# that died means nothing can write the tensor any more, since views keep their base alive.

def _check_version(ref, saved_version: int, where: str) -> None:
    t = ref() if ref is not None else None
    if t is not None and t._version != saved_version:
        raise SavedTensorModifiedError(
            f"a tensor saved for backward ({describe(t)}) was modified in place after it was "
            f"saved ({where}): version {saved_version} at save, {t._version} now. Backward would "
            "use stale values; clone the tensor before modifying it, or modify a copy")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_device(device) -> torch.device:
    if device is None:
        return _default_device()
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"device: expected a torch.device or str, got {device!r}") from exc
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a CUDA device (or 'cpu' for the test path), got {device}")
    return device


class _Mover:
    """Side streams, events and the host pool: the copies both offload and swap make.

    NOTE [offload ordering]: all compute runs on torch's *current* stream. Every cross-stream
    dependency is an event, so the same code runs eagerly and inside a CUDA graph capture
    (events recorded and waited in a capture become graph edges):
      * D2H: the d2h stream waits on an event recorded on the compute stream after the saved
        tensors were produced, copies them into pool buffers and records ``d2h_event``.
      * Device memory: the original tensor stays referenced by its record until the compute
        stream has waited on ``d2h_event``; only then is the reference dropped, so the caching
        allocator (which frees in compute-stream order) cannot hand the memory out while the
        copy still reads it. No ``record_stream``: under capture it would defer every free to
        the end of the capture and save nothing.
      * H2D: destination tensors are allocated on the compute stream, the h2d stream waits on a
        compute event (the memory may have been freed just before), copies, and records
        ``h2d_event``; the compute stream waits on it before backward reads the tensors.
      * Host buffers: a buffer goes back to the pool only after the compute stream has waited
        on the H2D that read it; the next D2H into it waits on a later compute event, so the
        write is ordered after the read (within a step, across steps and across replays).
      * Join: a side stream used in a capture must be joined back before the capture ends;
        :meth:`join` makes the compute stream wait on each side stream's last event (it is
        called when the last outstanding tensor was unpacked and by ``reset()``).
    On a CPU device the same calls degrade to synchronous copies into the pool (the test path).
    """

    def __init__(self, device: torch.device, pool: HostPool):
        self.device = device
        self.pool = pool
        self.cuda = device.type == "cuda"
        self._d2h = self._h2d = None
        self._tails: dict[str, object] = {}     # side stream name -> last event not yet waited
        self.log: collections.deque = collections.deque(maxlen=4096)

    # -- streams ---------------------------------------------------------------------------
    def _stream(self, which: str):
        if getattr(self, "_" + which) is None:
            forbid_capture(f"creating the {which} stream for offload")
            setattr(self, "_" + which, torch.cuda.Stream(self.device))
        return getattr(self, "_" + which)

    def _compute(self):
        return torch.cuda.current_stream(self.device)

    def _record_on(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event, which: str) -> None:
        """Make the compute stream wait on ``event`` recorded on side stream ``which``."""
        if event is None:
            return
        self._compute().wait_event(event)
        if self._tails.get(which) is event:
            del self._tails[which]

    def join(self) -> None:
        """Make the compute stream wait on everything queued on the side streams."""
        for which, event in list(self._tails.items()):
            self.wait(event, which)

    # -- copies ----------------------------------------------------------------------------
    def to_host(self, records: list[_Record], label) -> object:
        """Queue the D2H copies of ``records`` (device tensors held); returns the event to wait on."""
        for rec in records:
            rec.make_host_views(self.pool)
        self.log.append(("d2h", label))
        if not self.cuda:
            with torch.no_grad():
                for rec in records:
                    for part in rec.parts:
                        part.host.copy_(rec.source(part))
            return None
        stream = self._stream("d2h")
        stream.wait_event(self._record_on(self._compute()))
        with torch.no_grad(), torch.cuda.stream(stream):
            for rec in records:
                for part in rec.parts:
                    part.host.copy_(rec.source(part), non_blocking=True)
        event = self._record_on(stream)
        self._tails["d2h"] = event
        return event

    def to_device(self, records: list[_Record], label) -> object:
        """Queue the H2D copies of ``records`` into new device tensors; returns the event to wait on."""
        self.log.append(("h2d", label))
        with torch.no_grad():
            for rec in records:
                rec.alloc_back(self.device)
        if not self.cuda:
            with torch.no_grad():
                for rec in records:
                    for part in rec.parts:
                        part.back.copy_(part.host)
            return None
        stream = self._stream("h2d")
        stream.wait_event(self._record_on(self._compute()))
        with torch.no_grad(), torch.cuda.stream(stream):
            for rec in records:
                for part in rec.parts:
                    part.back.copy_(part.host, non_blocking=True)
        event = self._record_on(stream)
        self._tails["h2d"] = event
        return event


# ---------------------------------------------------------------------------------------------
# Nesting of graphstash saved-tensor contexts
# ---------------------------------------------------------------------------------------------

_tls = threading.local()


def _active_contexts() -> list:
    if not hasattr(_tls, "stack"):
        _tls.stack = []
    return _tls.stack


def _push_context(ctx, description: str) -> None:
    """Register ``ctx`` as the innermost graphstash saved-tensor context (no nesting allowed).

    NOTE [one hook context]: autograd uses only the innermost saved-tensor hooks, so an offload
    scope inside a swap scope (or two of either) would silently take over the outer one's
    tensors. Nesting is refused with an error naming both contexts.
    """
    stack = _active_contexts()
    if stack:
        raise OffloadError(
            f"{description} entered inside {stack[-1][1]}: graphstash offload/swap contexts do "
            "not nest (autograd would route saved tensors to the inner one only); close the "
            "outer context first")
    stack.append((ctx, description))


def _pop_context(ctx, description: str) -> None:
    stack = _active_contexts()
    if not stack or stack[-1][0] is not ctx:
        top = stack[-1][1] if stack else "nothing"
        raise OffloadError(f"{description} exited while the innermost open context is {top}: "
                           "contexts must be exited in the reverse order they were entered")
    stack.pop()


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
    records: dict = dataclasses.field(default_factory=dict)     # storage ptr -> _Record
    saves: list = dataclasses.field(default_factory=list)       # (tensor weakref, version) per save
    handles: list = dataclasses.field(default_factory=list)     # weakrefs to the _Handles
    release: list = dataclasses.field(default_factory=list)     # tensors to free after D2H
    d2h_event: object = None
    h2d_event: object = None
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
    :meth:`mark_not_offloadable`, parameters, or not on ``device`` stay on the device.

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
        self.device = _check_device(device)
        self.enabled = enabled
        self.host_pool = host_pool if host_pool is not None else HostPool(self.device.type == "cuda")
        self._mover = _Mover(self.device, self.host_pool)
        self._learned_groups: int | None = None
        self._chunk: _Chunk | None = None          # the open forward
        self._group: _Group | None = None          # the open group
        self._chunks: list[_Chunk] = []            # forwards whose backward is not done
        self._copying: list[_Group] = []           # D2H queued, device memory still held
        self._delayed: list[_Group] = []           # committed with delay=True, not yet copied
        self._not_offloadable: list = []           # weak references to marked tensors
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
    def transfer_log(self):
        """Recent copies, oldest first: ``("d2h" | "h2d" | "adopt" | "release", group name)``."""
        return self._mover.log

    # -- forward scope ---------------------------------------------------------------------
    def __enter__(self):
        if self._chunk is not None:
            raise OffloadError("ActivationOffloader entered while its forward is still open: "
                               "each `with offloader:` is one forward and cannot be re-entered")
        _push_context(self, "ActivationOffloader forward scope")
        self._drop_abandoned_chunks()
        self._chunk = _Chunk()
        self._chunks.append(self._chunk)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        chunk = self._chunk
        try:
            _pop_context(self, "ActivationOffloader forward scope")
        finally:
            self._hooks.__exit__(exc_type, exc, tb)
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
            raise OffloadError(f"forward scope closed while group {name!r} is open: "
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
            raise OffloadError(f"group {name!r} started outside `with offloader:`; "
                               "groups live inside a forward scope")
        if self._group is not None:
            raise OffloadError(f"group {name!r} started while group {self._group.name!r} is open: "
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
            raise OffloadError("group_commit() without an open group: call group_start() first")
        if name is not None and name != group.name:
            raise OffloadError(f"group_commit(name={name!r}) but the open group is {group.name!r}")
        if not isinstance(delay, bool):
            raise TypeError(f"delay: expected a bool, got {type(delay).__name__}")
        group.release = self._check_release(group, release)
        self._group = None
        for ref, version in group.saves:
            _check_version(ref, version, f"in group {group.name!r}, before its copy to host")
        # bytes moved, each storage once (NOTE [one record per storage])
        group.nbytes = sum(r.plan() for r in group.records.values())
        # NOTE [release one commit later]: the copies queued at a commit (delayed groups, then
        # the group itself) overlap the next group's forward; at every commit, the groups whose
        # copies were queued at earlier commits are waited on and their device memory released
        # (so the last offloaded group is released by the commit of a kept group after it).
        older = list(self._copying)
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
        for g in older:
            self._release_device(g)
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
        group.d2h_event = self._mover.to_host(list(group.records.values()), group.name)
        group.state = _COPYING
        self._copying.append(group)

    def _release_device(self, group: _Group) -> None:
        """Wait on the group's D2H, drop the device tensors and free the forced releases."""
        self._mover.wait(group.d2h_event, "d2h")
        self._copying.remove(group)
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

    def mark_not_offloadable(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep ``tensor`` (any shape/dtype/device) and every view of its storage on the device.

        Use it for tensors that stay alive anyway (model inputs, tensors held by the caller):
        moving them would cost copies and free nothing. Returns ``tensor``.

        Example::

            off.mark_not_offloadable(batch)
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        self._not_offloadable = [r for r in self._not_offloadable if r() is not None]
        self._not_offloadable.append(weakref.ref(tensor))
        return tensor

    def _is_marked(self, t: torch.Tensor) -> bool:
        if not self._not_offloadable:
            return False
        ptr = t.untyped_storage().data_ptr()
        for ref in self._not_offloadable:
            marked = ref()
            if marked is not None and marked.untyped_storage().data_ptr() == ptr:
                return True
        return False

    # -- saved-tensor hooks ----------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        group = self._group
        if (group is None or not group.offload or t.numel() * t.element_size() < self.min_tensor_bytes
                or not _movable(t, self.device) or self._is_marked(t)):
            return _Kept(t)
        key = _storage_ptr(t)                # NOTE [one record per storage]
        rec = group.records.get(key)
        if rec is None:
            rec = group.records[key] = _Record(t, group, key)
            group.outstanding += 1
            group.chunk.outstanding += 1
        rec.refs += 1
        handle = _Handle(rec, rec.add_view(t), t)
        group.saves.append((handle.ref, handle.version))
        group.handles.append(weakref.ref(handle))
        return handle

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.unpack()
        rec = packed.record
        if rec.refs <= 0:
            raise OffloadError("an offloaded saved tensor was used twice: offloaded activations "
                               "support one backward (no retain_graph=True second backward)")
        _check_version(packed.ref, packed.version, "after it was offloaded")
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
            raise OffloadError(f"backward used a tensor of group {group.name!r} while the group "
                               "was still open: commit it before running backward")
        if group.state == _DELAYED:
            # never copied: backward came first, so hand the device tensors over directly
            self._delayed.remove(group)
            self._adopt(group)
        elif group.state == _COPYING:
            # still on the device: wait for the copy (the host buffer may be reused after
            # this), then use the device tensors rather than copying them back
            self._mover.wait(group.d2h_event, "d2h")
            self._copying.remove(group)
            self._adopt(group)
        elif group.state == _ON_HOST:
            self._reload(group)
        if group.state == _RELOADING:
            self._mover.wait(group.h2d_event, "h2d")
        group.state = _READY

    def _adopt(self, group: _Group) -> None:
        for rec in group.records.values():
            rec.adopt()
        group.release = []
        self._mover.log.append(("adopt", group.name))

    def _reload(self, group: _Group) -> None:
        group.h2d_event = self._mover.to_device(list(group.records.values()), group.name)
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
            if group in self._copying:
                self._mover.wait(group.d2h_event, "d2h")
                self._copying.remove(group)
            if group in self._delayed:
                self._delayed.remove(group)
            if group.state == _RELOADING:
                self._mover.wait(group.h2d_event, "h2d")
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
            raise OffloadError("reset() inside `with offloader:`; call it between steps")
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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def format_bytes_table(rows: list[dict[str, int]]) -> str:
    """Rows (one per rank) of {column: bytes} as an ASCII table in MiB, ``total`` last."""
    columns: list[str] = []
    for row in rows:
        for name in row:
            if name != "total" and name not in columns:
                columns.append(name)
    columns.append("total")
    header = ["rank"] + columns
    body = [[str(rank)] + [_mib(row.get(c, 0)) for c in columns] for rank, row in enumerate(rows)]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    line = "-+-".join("-" * w for w in widths)
    fmt = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join(["offloaded MiB per group", fmt(header), line] + [fmt(r) for r in body])
