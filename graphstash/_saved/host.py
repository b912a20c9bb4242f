"""Host copies of saved tensors: the pinned pool, one record per device storage, and the
copier that moves records to host and back on side streams (used by offload and swap).
"""
from __future__ import annotations

import collections

import torch

from .._checks import forbid_capture, require_positive_int
from .select import movable
from .streams import Mark, SideStream
from .version import SavedVersion

__all__ = ["HostCopier", "HostHandle", "HostPool", "StorageRecord", "dense_strides_like",
           "host_movable", "is_non_overlapping", "size_class", "storage_key"]


def size_class(nbytes: int) -> int:
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
    host memory. A buffer is taken from a free list of its size class (:func:`size_class`)
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
        size = size_class(nbytes)
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



def _is_dense(t: torch.Tensor) -> bool:
    """True if ``t`` covers exactly ``numel`` consecutive elements (any dim order, no gaps)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def dense_strides_like(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor of ``t``'s shape whose dimensions are ordered like ``t``'s."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), -d))   # innermost first
    strides = [0] * t.dim()
    step = 1
    for d in order:
        strides[d] = step
        step *= t.shape[d]
    return tuple(strides)


def is_non_overlapping(t: torch.Tensor) -> bool:
    """Sufficient test that no two elements of ``t`` share memory (strides sorted, each past the rest)."""
    reach = 0
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda p: p[1]):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True



def host_movable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a saved tensor can be moved to host and back at all (size thresholds aside):
    :func:`~graphstash._saved.select.movable` and no two of its elements share memory."""
    return movable(t, device) and is_non_overlapping(t)


def storage_key(t: torch.Tensor) -> int:
    """Identifies ``t``'s storage among live storages (a record holds its storage alive)."""
    return t.untyped_storage().data_ptr()



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


class StorageRecord:
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
            self.parts = [_Part(v, v.shape, v.stride if v.dense else dense_strides_like(v.device),
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



class HostCopier:
    """The host pool and two side streams (``d2h``, ``h2d``): the copies offload and swap make.

    NOTE [offload ordering]: on top of NOTE [side streams] (``streams.py``) and NOTE [retire
    at the schedule point] (``retire.py``):
      * D2H: the d2h stream forks from the compute stream after the saved tensors were
        produced, copies them into pool buffers and marks the copy; the originals are dropped
        only after the compute stream waited on that mark.
      * H2D: destination tensors are allocated on the compute stream, the h2d stream forks
        from it (the memory may have been freed just before), copies, and marks; the compute
        stream waits on the mark before backward reads the tensors.
      * Host buffers: a buffer goes back to the pool only after the compute stream has waited
        on the H2D that read it; the next D2H into it forks from a later point of the compute
        stream, so the write is ordered after the read (within a step, across steps and
        across replays).
      * Join: :meth:`join` (when the last outstanding tensor was unpacked, and in ``reset()``)
        joins both side streams back before a capture ends.
    On a CPU device the same calls degrade to synchronous copies into the pool (the test path).

    Args:
        device: the device whose tensors move (``torch.device``, CUDA or CPU).
        pool: the :class:`HostPool` the host copies live in.
    """

    def __init__(self, device: torch.device, pool: HostPool):
        self.device = device
        self.pool = pool
        self.cuda = device.type == "cuda"
        self.d2h = SideStream(device, "d2h")
        self.h2d = SideStream(device, "h2d")
        self.log: collections.deque = collections.deque(maxlen=4096)

    def join(self) -> None:
        """Make the compute stream wait on everything queued on the side streams."""
        self.d2h.join()
        self.h2d.join()

    def to_host(self, records: list[StorageRecord], label) -> Mark | None:
        """Queue the D2H copies of ``records`` (device tensors held); returns the mark to wait on."""
        for rec in records:
            rec.make_host_views(self.pool)
        self.log.append(("d2h", label))
        with torch.no_grad(), self.d2h.fork():
            for rec in records:
                for part in rec.parts:
                    part.host.copy_(rec.source(part), non_blocking=self.cuda)
        return self.d2h.mark()

    def to_device(self, records: list[StorageRecord], label) -> Mark | None:
        """Queue the H2D copies of ``records`` into new device tensors; returns the mark to wait on."""
        self.log.append(("h2d", label))
        with torch.no_grad():
            for rec in records:
                rec.alloc_back(self.device)
        with torch.no_grad(), self.h2d.fork():
            for rec in records:
                for part in rec.parts:
                    part.back.copy_(part.host, non_blocking=self.cuda)
        return self.h2d.mark()


class HostHandle:
    """What autograd stores in place of a tensor moved to host: the policy's object for its
    copy (a record, a swap item), the saved view, and its version (NOTE [in-place check])."""

    __slots__ = ("owner", "view", "saved", "__weakref__")

    def __init__(self, owner, view, t: torch.Tensor):
        self.owner = owner
        self.view = view
        self.saved = SavedVersion(t)
