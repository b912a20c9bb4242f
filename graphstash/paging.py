"""Paged stash storage: :class:`PagedStashBuffer` (pages in two tiers, device free lists,
status flags, reset / release / reallocate) and :class:`PagedTensor` (a stashed tensor's handle).

The hot path (``stash``, ``reload``, ``reset``) allocates no pool memory, never reads back to
the host on the CuPy backend, and takes every count from device tensors; all pool memory is
allocated when the buffer is created or reallocated.
"""
from __future__ import annotations

import bisect
import dataclasses
import weakref

import torch

from . import _backend, _kernels
from ._kernels import paged_stash as _cupy_paged
from . import _layout as L
from ._checks import (check_counts, describe, forbid_capture, is_capturing, normalize_device,
                      require_positive_int)
from .errors import CaptureError, PoolExhaustedError, ReleasedError, StaleHandleError
from .reference import paged_stash as _reference
from .status import check_status, new_status

__all__ = ["MAX_PAGES", "MAX_PAGE_SIZE", "PagedStashBuffer", "PagedTensor"]

# Bounds of a pool the kernels can address: page ids, page counts and record offsets are
# 32-bit, and a page's rows are counted in 32 bits next to a segment's live rows (which the
# kernels clamp below 2**30), so larger values could never be allocated or addressed.
MAX_PAGES = 2**31 - 1
MAX_PAGE_SIZE = 2**30


def check_pool_size(*, page_size: int, device_rows: int, host_rows: int, row_bytes: int,
                    device: torch.device, names: tuple[str, str, str] = (
                        "page_size", "max_tokens", "host_tokens")) -> None:
    """Refuse a pool no GPU could hold, before anything is allocated: ValueError naming the
    argument (``names``: how the caller calls page size, device rows and host rows), the
    range expected and the value. Allocates nothing, reads no device memory."""
    page_name, dev_name, host_name = names
    if page_size > MAX_PAGE_SIZE:
        raise ValueError(f"{page_name}: expected an int in [1, {MAX_PAGE_SIZE}] (rows per page; "
                         f"the kernels count rows in 32 bits), got {page_size}")
    pages = -(-device_rows // page_size) + -(-host_rows // page_size)
    if pages > MAX_PAGES:
        raise ValueError(f"{dev_name}: {device_rows} device + {host_rows} host rows make "
                         f"{pages} pages of {page_size} rows; expected at most {MAX_PAGES} pages "
                         "(32-bit page ids)")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        need = -(-device_rows // page_size) * page_size * row_bytes
        if need > total:
            raise ValueError(f"{dev_name}: {device_rows} rows of {row_bytes} bytes take "
                             f"{need / 2**30:.1f} GiB in pages; expected at most the "
                             f"{total / 2**30:.1f} GiB of {device}")


class _RecordSlots:
    """First-fit allocator of handle records in the int32 record table (host-side bookkeeping).

    NOTE [record slots]: a record (header, counts, page ids) is written by the stash launch and
    read by the reload launch. Slots are handed out on the host when a stash is enqueued and
    freed when its reload is enqueued; the buffer's event chain (NOTE [buffer ordering] in
    paged_stash.cu) orders a later stash that reuses the slot after that reload. The choice of
    slot is deterministic, so a captured graph replays with the same slots.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]   # sorted (start, length)

    def alloc(self, length: int) -> int | None:
        for i, (start, size) in enumerate(self._free):
            if size >= length:
                if size == length:
                    del self._free[i]
                else:
                    self._free[i] = (start + length, size - length)
                return start
        return None

    def free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, length))
        # merge with the right neighbour, then the left one
        if i + 1 < len(self._free) and start + length == self._free[i + 1][0]:
            self._free[i] = (start, length + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def reset(self) -> None:
        self._free = [(0, self.capacity)]

    @property
    def free_entries(self) -> int:
        return sum(size for _, size in self._free)


@dataclasses.dataclass
class _Pool:
    """The tensors the kernels work on; both backends take this."""

    dev_pages: torch.Tensor | None   # uint8 [num_dev, page_bytes], on the device (None: lent
                                     # pages not taken; NOTE [lent pages])
    host_pages: torch.Tensor   # uint8 [num_host, page_bytes], pinned host memory (CPU for CPU)
    dev_ring: torch.Tensor     # int32 [num_dev] page ids 0..num_dev-1, on the device
    host_ring: torch.Tensor    # int32 [num_host] page ids num_dev..num_dev+num_host-1, on the device
    state: torch.Tensor        # int64 [STATE_SIZE] ring counters and peaks, on the device
    status: torch.Tensor       # int32 [STATUS_SIZE] sticky flags, on the device (maybe shared)
    table: torch.Tensor        # int32 [record_entries] handle records, on the device
    ring_init: torch.Tensor    # int64 [4] fresh (dev head, dev tail, host head, host tail)
    page_rows: int
    page_bytes: int

    @property
    def num_dev(self) -> int:
        return self.dev_ring.shape[0]

    @property
    def num_host(self) -> int:
        return self.host_ring.shape[0]


class PagedTensor:
    """Handle of a tensor stashed in a :class:`PagedStashBuffer`; pass it to ``buf.reload``.

    It holds no tensor data: the rows live in pool pages, described by a record (counts and
    page ids) in the buffer's record table on the device.
    """

    __slots__ = ("_buffer", "_offset", "_length", "shape", "num_segments", "rows_per_segment",
                 "_generation", "_reloaded", "_finalizer", "__weakref__")

    def __init__(self, buffer, offset, length, shape, num_segments, rows_per_segment, generation):
        self._buffer = buffer
        self._offset = offset
        self._length = length
        self.shape = torch.Size(shape)
        self.num_segments = num_segments
        self.rows_per_segment = rows_per_segment
        self._generation = generation
        self._reloaded = False
        self._finalizer = None

    @property
    def buffer(self) -> "PagedStashBuffer":
        """The :class:`PagedStashBuffer` that holds the rows."""
        return self._buffer

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the stashed tensor (the buffer's)."""
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        """Device of the stashed tensor (the buffer's)."""
        return self._buffer.device

    @property
    def reloaded(self) -> bool:
        """True once ``reload`` consumed the handle (its pages are free again)."""
        return self._reloaded

    def record(self) -> dict:
        """The handle's device record read back to the host (syncs; for diagnostics and tests).

        Returns ``{"valid", "num_pages", "device_pages", "host_pages", "counts", "page_ids"}``;
        ``valid`` is 1 when stored, 0 when the stash overflowed, -1 once reloaded (then the
        page counts are 0 and the lists empty: the slot may hold another handle's record now).
        Raises StaleHandleError for a handle stashed before the buffer's last reset.
        """
        forbid_capture("PagedTensor.record()")
        self._buffer._require_live("PagedTensor.record")
        if self._reloaded:       # NOTE [record slots]: its slot was freed at the reload
            return {"valid": -1, "num_pages": 0, "device_pages": 0, "host_pages": 0,
                    "counts": [], "page_ids": []}
        self._require_current()
        rec = self._buffer._pool.table[self._offset: self._offset + self._length].tolist()
        S = self.num_segments
        pages = rec[L.H_PAGES] if rec[L.H_VALID] != 0 else 0
        return {
            "valid": rec[L.H_VALID],
            "num_pages": rec[L.H_PAGES],
            "device_pages": rec[L.H_DEV_PAGES],
            "host_pages": rec[L.H_HOST_PAGES],
            "counts": rec[L.H_COUNTS: L.H_COUNTS + S],
            "page_ids": rec[L.H_HEADER + S: L.H_HEADER + S + pages],
        }

    def _require_current(self) -> None:
        """StaleHandleError if the handle predates its buffer's last reset/release/reallocate."""
        if self._generation != self._buffer._generation:
            raise StaleHandleError("handle: it was stashed before this buffer's last reset(), "
                                   "release() or reallocate(); its pages and record slot were "
                                   "returned then")

    def __repr__(self) -> str:
        state = "reloaded" if self._reloaded else "stashed"
        return (f"PagedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"segments={self.num_segments}, {state})")


class PagedStashBuffer:
    """A pool of fixed-size pages (device tier, then pinned-host tier) for stashing live rows.

    ``stash(x, num_tokens)`` copies rows ``[0, n)`` of ``x`` (or of each segment) into pages
    taken from device-side free lists and returns a :class:`PagedTensor`; ``reload`` copies
    them back and frees the pages. When device pages run out mid-tensor the remaining pages go
    to the host tier; when both run out the stash stores nothing and sets the sticky overflow
    flag in :attr:`status`. Nothing reads back to the host on the CuPy backend, so stash and
    reload replay inside CUDA graphs.

    Args:
        max_tokens: rows the device tier holds (rounded up to whole pages).
        hidden_size: elements per row.
        dtype: element type of the stashed tensors (any: the kernels move bytes).
        device: where tensors live (``"cuda"``, ``"cuda:1"`` or ``"cpu"``).
        page_size: rows per page.
        host_tokens: rows the pinned-host tier holds (0: no host tier).
        backend: ``"auto"``, ``"cupy"`` or ``"reference"``.
        status: optional int32 ``[8]`` tensor on ``device`` shared with other buffers (a
            manager's), or its :class:`~graphstash.status.StepStatus`; by default the buffer
            owns one.
        record_entries: int32 entries of the handle-record table (default: enough for every
            page twice over, and at least 65536).
        lend_pages: the buffer does not hold its device pages: :meth:`take_pages` allocates
            them and :meth:`give_pages_back` frees them (NOTE [lent pages]).

    Example::

        buf = graphstash.PagedStashBuffer(8192, 4096, dtype=torch.bfloat16)
        x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
        n = torch.tensor([5000], device="cuda", dtype=torch.int32)
        handle = buf.stash(x, n)          # rows [0, 5000) now live in pages
        del x                             # the static buffer can be freed / reused
        y = buf.reload(handle)            # [16384, 4096]; rows [0, 5000) restored
    """

    def __init__(self, max_tokens: int, hidden_size: int, *, dtype: torch.dtype, device="cuda",
                 page_size: int = 64, host_tokens: int = 0, backend: str = "auto",
                 status: torch.Tensor | None = None, record_entries: int | None = None,
                 lend_pages: bool = False):
        require_positive_int("max_tokens", max_tokens, allow_zero=True)
        if not isinstance(lend_pages, bool):
            raise TypeError(f"lend_pages: expected a bool, got {type(lend_pages).__name__}")
        require_positive_int("hidden_size", hidden_size)
        require_positive_int("page_size", page_size)
        require_positive_int("host_tokens", host_tokens, allow_zero=True)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
        if max_tokens + host_tokens == 0:
            raise ValueError("max_tokens: expected max_tokens + host_tokens > 0, got 0 + 0")
        self._device = normalize_device(device)
        self._backend, self._backend_reason = _backend.resolve(backend, self._device)
        check_pool_size(page_size=page_size, device_rows=max_tokens, host_rows=host_tokens,
                        row_bytes=hidden_size * dtype.itemsize, device=self._device)
        self._dtype = dtype
        self._hidden_size = hidden_size
        self._page_size = page_size
        self._row_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        if status is not None:
            status = check_status("status", status, self._device)
        self._shared_status = status
        self._record_entries = record_entries
        if record_entries is not None:
            require_positive_int("record_entries", record_entries)
            if record_entries > MAX_PAGES:
                raise ValueError(f"record_entries: expected an int in [1, {MAX_PAGES}] (32-bit "
                                 f"record offsets), got {record_entries}")
        self._generation = 0
        self._event = None            # NOTE [lazy ordering event]
        self._last_stream = None      # stream of the last stash/reload/reset
        self._last_captured = False
        self._pool: _Pool | None = None
        self._lend_pages = lend_pages
        self._pages_stream = None     # the stream that took lent pages (NOTE [lent pages])
        self._max_tokens = max_tokens
        self._host_tokens = host_tokens
        self._allocate()

    # ---- properties ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where stashed tensors live (a CUDA device with an index, or the CPU)."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the tensors this buffer stashes."""
        return self._dtype

    @property
    def hidden_size(self) -> int:
        """Elements per row."""
        return self._hidden_size

    @property
    def page_size(self) -> int:
        """Rows per page."""
        return self._page_size

    @property
    def backend(self) -> str:
        """``"cupy"`` or ``"reference"``: what ``backend="auto"`` resolved to."""
        return self._backend

    @property
    def backend_reason(self) -> str:
        """Why :attr:`backend` was chosen (one line, for logs)."""
        return self._backend_reason

    @property
    def max_tokens(self) -> int:
        """Rows the device tier was asked to hold (before rounding up to pages)."""
        return self._max_tokens

    @property
    def host_tokens(self) -> int:
        """Rows the pinned-host tier was asked to hold (0: no host tier)."""
        return self._host_tokens

    @property
    def num_device_pages(self) -> int:
        """Pages in the device tier (page ids ``0..num_device_pages-1``)."""
        return -(-self._max_tokens // self._page_size)

    @property
    def num_host_pages(self) -> int:
        """Pages in the pinned-host tier (ids follow the device pages)."""
        return -(-self._host_tokens // self._page_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: ``page_size x hidden_size x`` element size."""
        return self._page_size * self._row_bytes

    @property
    def released(self) -> bool:
        """True between ``release()`` and ``reallocate()``."""
        return self._pool is None

    @property
    def status(self) -> torch.Tensor:
        """The int32 ``[8]`` device status tensor (sticky flags; see ``read_status``). No sync."""
        self._require_live("status")
        return self._pool.status

    @property
    def state(self) -> torch.Tensor:
        """The int64 ``[16]`` device ring state (counters and peaks). No sync."""
        self._require_live("state")
        return self._pool.state

    @property
    def free_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int32 device and host free-page rings (``[num_device_pages]``,
        ``[num_host_pages]``, on the device): the page ids in ring order. No sync."""
        self._require_live("free_lists")
        return self._pool.dev_ring, self._pool.host_ring

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory the pages and bookkeeping take (0 after ``release()``)."""
        if self._pool is None:
            return 0
        p = self._pool
        return sum(t.numel() * t.element_size() for t in
                   (p.dev_pages, p.dev_ring, p.host_ring, p.state, p.table) if t is not None)

    @property
    def pages_ptr(self) -> int:
        """Address of the device-tier pages (0 after ``release()``, and for lent pages not
        taken): it changes when the pool is allocated again, which is what benchmarks check
        between timed steps."""
        if self._pool is None or self._pool.dev_pages is None:
            return 0
        return self._pool.dev_pages.data_ptr()

    def tensors(self) -> list:
        """Every tensor the buffer holds now: pages (device and host), rings, state, status,
        record table (empty after ``release()``); what a memory report attributes to it."""
        if self._pool is None:
            return []
        return [v for v in vars(self._pool).values() if isinstance(v, torch.Tensor)]

    @property
    def lend_pages(self) -> bool:
        """Whether the device pages are lent (NOTE [lent pages]) rather than held."""
        return self._lend_pages

    @property
    def pages_taken(self) -> bool:
        """Whether the device pages exist now: always for held pages (until ``release()``),
        between :meth:`take_pages` and :meth:`give_pages_back` for lent ones."""
        return self._pool is not None and self._pool.dev_pages is not None

    # ---- lifecycle ----------------------------------------------------------------------
    def _allocate(self) -> None:
        device, P = self._device, self._page_size
        num_dev, num_host = self.num_device_pages, self.num_host_pages
        pin = device.type == "cuda" and num_host > 0
        entries = self._record_entries or max(65536, 8 * (num_dev + num_host))
        status = self._shared_status
        if status is None:
            status = new_status(device)
        self._pool = _Pool(
            dev_pages=None if self._lend_pages else self._new_pages(num_dev),
            host_pages=torch.empty((num_host, P * self._row_bytes), dtype=torch.uint8,
                                   pin_memory=pin),
            dev_ring=torch.empty(num_dev, dtype=torch.int32, device=device),
            host_ring=torch.empty(num_host, dtype=torch.int32, device=device),
            state=torch.zeros(L.STATE_SIZE, dtype=torch.int64, device=device),
            status=status,
            table=torch.zeros(entries, dtype=torch.int32, device=device),
            ring_init=torch.tensor([0, num_dev, 0, num_host], dtype=torch.int64, device=device),
            page_rows=P,
            page_bytes=P * self._row_bytes,
        )
        self._slots = _RecordSlots(entries)
        self._init_rings(clear_peaks=True)

    def _new_pages(self, num_dev: int) -> torch.Tensor:
        return torch.empty((num_dev, self._page_size * self._row_bytes), dtype=torch.uint8,
                           device=self._device)

    # NOTE [lent pages]: a buffer built with ``lend_pages=True`` keeps its rings, state and
    # record table but not its device pages. take_pages() allocates them on the current
    # stream (inside a CUDA graph capture, from the graph's own pool) and give_pages_back()
    # drops them, so their memory returns to the allocator of the stream that took them:
    # under a capture, later allocations of the same graph reuse it. A stash manager takes a
    # layer group's pages when the group is stashed and gives them back once its reload is
    # done (NOTE [pages per group] in graphstash/stash/scheduler.py), so a step holds the
    # pages of the groups away, not a pool for all of them through the whole step. Giving
    # pages back is safe only when no stash or reload on them is pending on any stream: the
    # caller makes the stream that took them wait for the last reload first (the caching
    # allocator hands freed memory to later work on that stream without further waits).
    def take_pages(self) -> None:
        """Allocate lent device pages now, on the current stream; every page is free (a
        reset() or a completed reload put them on the ring). Capturable."""
        self._require_live("take_pages")
        if not self._lend_pages:
            raise ValueError("take_pages: this buffer holds its pages (built with "
                             "lend_pages=False)")
        if self._pool.dev_pages is not None:
            raise ValueError("take_pages: the pages are taken already; give_pages_back() first")
        self._pool.dev_pages = self._new_pages(self._pool.num_dev)
        if self._device.type == "cuda":
            self._pages_stream = torch.cuda.current_stream(self._device)

    def give_pages_back(self) -> None:
        """Drop lent device pages (NOTE [lent pages]); the caller has ordered the stream that
        took them after every stash and reload on them. A no-op when none are taken."""
        if self._pool is None or not self._lend_pages:
            return
        self._pool.dev_pages = None
        self._pages_stream = None

    @property
    def pages_stream(self):
        """The stream that took the lent pages now taken (None otherwise, and on the CPU)."""
        return self._pages_stream

    def _init_rings(self, clear_peaks: bool) -> None:
        # In-place device ops only (fills, a device-to-device copy): capturable, no host read.
        p = self._pool
        torch.arange(p.num_dev, out=p.dev_ring)
        torch.arange(p.num_dev, p.num_dev + p.num_host, out=p.host_ring)
        if clear_peaks:
            p.state.zero_()
        p.state[L.ST_DEV_HEAD: L.ST_HOST_TAIL + 1].copy_(p.ring_init)
        p.state[L.ST_DEMAND].zero_()

    def reset(self, *, clear_status: bool | None = None, clear_peaks: bool = False) -> None:
        """Return every page to its ring; every outstanding handle becomes stale.

        Graph-safe: no allocation, no host read. ``clear_status`` (default: only when the buffer
        owns its status) also zeroes the sticky flags; ``clear_peaks`` the high-water marks.
        """
        self._require_live("reset")
        capturing = self._device.type == "cuda" and is_capturing()
        self._order_before(capturing)
        self._generation += 1
        self._slots.reset()
        self._init_rings(clear_peaks=clear_peaks)
        if clear_status if clear_status is not None else self._shared_status is None:
            self._pool.status.zero_()
        self._order_after(capturing)

    def release(self) -> None:
        """Free the pages, rings and record table; ``reallocate()`` makes the buffer usable again.

        Waits for the buffer's last kernel first (the pinned tier must not be reused under it).
        """
        forbid_capture("PagedStashBuffer.release()")
        if self._pool is None:
            return
        if self._last_stream is not None and not self._last_captured:
            self._last_stream.synchronize()
        self._pool = None
        self._slots = None
        self._last_stream = None
        self._pages_stream = None
        self._generation += 1

    def reallocate(self, max_tokens: int | None = None, host_tokens: int | None = None) -> None:
        """(Re)allocate the pools, optionally with new sizes; outstanding handles become stale."""
        forbid_capture("PagedStashBuffer.reallocate()")
        if max_tokens is not None:
            require_positive_int("max_tokens", max_tokens, allow_zero=True)
        if host_tokens is not None:
            require_positive_int("host_tokens", host_tokens, allow_zero=True)
        new_max = self._max_tokens if max_tokens is None else max_tokens
        new_host = self._host_tokens if host_tokens is None else host_tokens
        if new_max + new_host == 0:
            raise ValueError("max_tokens: expected max_tokens + host_tokens > 0, got 0 + 0")
        self.release()
        self._max_tokens, self._host_tokens = new_max, new_host
        self._generation += 1
        self._allocate()

    # ---- ordering -----------------------------------------------------------------------
    def _order_before(self, capturing: bool) -> None:
        """Make the current stream wait for this buffer's previous operation on another stream.

        NOTE [lazy ordering event]: nothing is recorded after an operation; only when the next
        one comes on a *different* stream is an event recorded on the previous stream (covering
        everything queued there so far, the previous operation included) and waited for. A run
        of operations on one stream costs no event calls at all.
        """
        if self._device.type != "cuda" or self._last_stream is None:
            return
        stream = torch.cuda.current_stream(self._device)
        if self._last_captured != capturing:
            return   # the other side of a capture boundary: nothing in this graph to wait for
        if self._last_stream != stream:
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(self._last_stream)
            stream.wait_event(self._event)

    def _order_after(self, capturing: bool) -> None:
        if self._device.type != "cuda":
            return
        self._last_stream = torch.cuda.current_stream(self._device)
        self._last_captured = capturing

    # ---- hot path -----------------------------------------------------------------------
    def _require_live(self, op: str) -> None:
        if self._pool is None:
            raise ReleasedError(f"PagedStashBuffer.{op}: the buffer was released; "
                                "call reallocate() first")

    def _require_pages(self, op: str) -> None:
        self._require_live(op)
        if self._pool.dev_pages is None:
            raise ReleasedError(f"PagedStashBuffer.{op}: the buffer's lent pages are not taken; "
                                "call take_pages() first (NOTE [lent pages])")

    def _check_backend_capturable(self, op: str) -> bool:
        """Whether the current stream is capturing; raises CaptureError if ``op`` can't be."""
        if self._device.type != "cuda" or not is_capturing():
            return False
        if self._backend == "reference":
            raise CaptureError(f"PagedStashBuffer.{op} with the reference backend reads counts "
                               "back to the host and cannot be captured; use backend='cupy'")
        if not _kernels.is_compiled(self._device.index):
            raise CaptureError(f"PagedStashBuffer.{op}: the kernels are not compiled yet; call "
                               "graphstash.warmup() before capturing")
        return True

    def stash(self, x: torch.Tensor, num_tokens: torch.Tensor, *,
              max_blocks: int | None = None) -> PagedTensor:
        """Copy the live rows of ``x`` into pages and return their handle.

        Args:
            x: ``[rows, hidden_size]`` (live rows ``[0, n)``) or segmented
                ``[S, cap, hidden_size]`` (live rows ``[0, n_s)`` of each segment); dtype
                ``self.dtype``, on ``self.device``, contiguous.
            num_tokens: int32/int64 ``(1,)`` or ``(S,)`` on ``self.device``: live rows. A count
                below 0 or above the rows of its segment sets the overflow flag (reason
                ``count``) and stores nothing.
            max_blocks: at most this many thread blocks copy (CUDA kernels; default: as many
                as fit on the device). Fewer blocks leave multiprocessors to compute running
                beside the copy on another stream; the result is the same.

        Returns:
            A :class:`PagedTensor`. If the pool could not hold the rows, nothing is stored and
            the status overflow flag is set; reloading that handle writes nothing.
        """
        self._require_pages("stash")
        S, cap = self._check_x("x", x)
        counts = check_counts("num_tokens", num_tokens, device=self._device, segments=S)
        _check_max_blocks(max_blocks)
        capturing = self._check_backend_capturable("stash")
        length = L.H_HEADER + S + S * (-(-cap // self._page_size))
        offset = self._slots.alloc(length)
        if offset is None:
            raise PoolExhaustedError(
                f"PagedStashBuffer.stash: the handle-record table ({self._slots.capacity} "
                f"entries, {self._slots.free_entries} free) cannot hold {length} more; reload "
                "or reset() outstanding handles, or pass a larger record_entries")
        try:
            self._order_before(capturing)
            src = _dense(x).view(torch.uint8).view(S, cap, self._row_bytes)
            p = self._pool
            if self._backend == "cupy":
                _cupy_paged.stash(src, counts, p.dev_pages, p.host_pages, p.dev_ring,
                                  p.host_ring, p.state, p.status, p.table, p.page_rows, offset,
                                  max_blocks)
            else:
                _reference.stash(p, src, counts, offset)
        except BaseException:
            self._slots.free(offset, length)     # no handle holds the slot: give it back
            raise
        self._order_after(capturing)
        handle = PagedTensor(self, offset, length, x.shape, S, cap, self._generation)
        handle._finalizer = weakref.finalize(handle, self._release_slot, offset, length,
                                             self._generation)
        return handle

    def reload(self, handle: PagedTensor, out: torch.Tensor | None = None,
               zero_tail: bool = False, *, max_blocks: int | None = None) -> torch.Tensor:
        """Copy a stashed tensor's rows back and return its pages to the free lists.

        Args:
            handle: a :class:`PagedTensor` from this buffer's ``stash``, not reloaded yet.
            out: optional destination with the stashed tensor's shape, dtype and device,
                contiguous; by default a new tensor (``torch.empty``) is returned.
            zero_tail: also write zeros into the rows past the live count (per segment).
            max_blocks: at most this many thread blocks copy (see :meth:`stash`).

        Returns:
            ``out``: rows ``[0, n)`` hold the stashed rows; other rows are untouched unless
            ``zero_tail``. If the stash had overflowed nothing is written.
        """
        self._require_pages("reload")
        if not isinstance(handle, PagedTensor):
            raise TypeError(f"handle: expected a graphstash.PagedTensor, got {type(handle).__name__}")
        if handle._buffer is not self:
            raise ValueError("handle: it belongs to another PagedStashBuffer")
        if handle._reloaded:
            raise StaleHandleError("handle: it was already reloaded; each stash reloads once")
        handle._require_current()
        if not isinstance(zero_tail, bool):
            raise TypeError(f"zero_tail: expected a bool, got {type(zero_tail).__name__}")
        _check_max_blocks(max_blocks)
        if out is None:
            out = torch.empty(handle.shape, dtype=self._dtype, device=self._device)
        else:
            self._check_out(out, handle)
        capturing = self._check_backend_capturable("reload")
        self._order_before(capturing)
        dst = _dense(out).view(torch.uint8).view(handle.num_segments, handle.rows_per_segment,
                                                 self._row_bytes)
        p = self._pool
        if self._backend == "cupy":
            _cupy_paged.reload(dst, p.dev_pages, p.host_pages, p.dev_ring, p.host_ring, p.state,
                               p.table, p.page_rows, handle._offset, zero_tail, max_blocks)
        else:
            _reference.reload(p, dst, handle._offset, zero_tail)
        self._order_after(capturing)
        handle._reloaded = True
        handle._finalizer.detach()
        self._slots.free(handle._offset, handle._length)
        return out

    def _release_slot(self, offset: int, length: int, generation: int) -> None:
        # A handle dropped without reload: its record slot is free again (its pages come back
        # at the next reset()). Stale generations were already freed by reset/release.
        if generation == self._generation and self._slots is not None:
            self._slots.free(offset, length)

    # ---- checks -------------------------------------------------------------------------
    def _check_x(self, name: str, x) -> tuple[int, int]:
        expected = (f"a contiguous [rows, {self._hidden_size}] or [S, cap, {self._hidden_size}] "
                    f"{self._dtype} tensor on {self._device}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected {expected}, got {type(x).__name__}")
        if x.dtype != self._dtype:
            raise TypeError(f"{name}: expected {expected}, got {describe(x)}")
        if x.device != self._device:
            raise ValueError(f"{name}: expected {expected}, got {describe(x)}")
        if x.dim() not in (2, 3) or x.shape[-1] != self._hidden_size:
            raise ValueError(f"{name}: expected {expected}, got {describe(x)}")
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected {expected}, got a non-contiguous tensor with "
                             f"strides {x.stride()}")
        S, cap = (1, x.shape[0]) if x.dim() == 2 else (x.shape[0], x.shape[1])
        if S > _kernels.MAX_SEGMENTS:
            raise ValueError(f"{name}: at most {_kernels.MAX_SEGMENTS} segments, got {S}")
        return S, cap

    def _check_out(self, out, handle: PagedTensor) -> None:
        expected = f"a contiguous {self._dtype} tensor of shape {tuple(handle.shape)} on {self._device}"
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected {expected}, got {type(out).__name__}")
        if out.dtype != self._dtype:
            raise TypeError(f"out: expected {expected}, got {describe(out)}")
        if out.device != self._device or out.shape != handle.shape or not out.is_contiguous():
            raise ValueError(f"out: expected {expected}, got {describe(out)}"
                             + ("" if out.is_contiguous() else " (non-contiguous)"))

    # ---- diagnostics --------------------------------------------------------------------
    def read_status(self) -> dict:
        """Flags and page counts read back to the host (syncs: for diagnostics, not the step).

        Keys: ``overflow`` (bool), ``overflow_reasons`` (list of ``"pool"``/``"count"``),
        ``host_spill``, ``over_budget`` (bools), ``pages_in_use``, ``host_pages_in_use``,
        ``peak_pages``, ``peak_host_pages``, ``demand_pages``, ``peak_demand_pages``,
        ``peak_tokens``, ``num_device_pages``, ``num_host_pages``, ``page_size``.
        """
        forbid_capture("PagedStashBuffer.read_status()")
        self._require_live("read_status")
        status = self._pool.status.tolist()
        st = self._pool.state.tolist()
        bits = status[L.SS_OVERFLOW]
        num_dev, num_host = self.num_device_pages, self.num_host_pages
        return {
            "overflow": bits != 0,
            "overflow_reasons": [name for bit, name in ((L.OVERFLOW_POOL, "pool"),
                                                        (L.OVERFLOW_COUNT, "count")) if bits & bit],
            "host_spill": bool(status[L.SS_HOST_SPILL]),
            "over_budget": bool(status[L.SS_OVER_BUDGET]),
            "pages_in_use": num_dev - (st[L.ST_DEV_TAIL] - st[L.ST_DEV_HEAD]),
            "host_pages_in_use": num_host - (st[L.ST_HOST_TAIL] - st[L.ST_HOST_HEAD]),
            "peak_pages": st[L.ST_DEV_PEAK],
            "peak_host_pages": st[L.ST_HOST_PEAK],
            "demand_pages": st[L.ST_DEMAND],
            "peak_demand_pages": st[L.ST_DEMAND_PEAK],
            "peak_tokens": st[L.ST_TOKENS_PEAK],
            "num_device_pages": num_dev,
            "num_host_pages": num_host,
            "page_size": self._page_size,
        }

    def __repr__(self) -> str:
        state = "released" if self._pool is None else f"{self.num_device_pages}+{self.num_host_pages} pages"
        return (f"PagedStashBuffer(max_tokens={self._max_tokens}, hidden_size={self._hidden_size}, "
                f"dtype={self._dtype}, device={self._device}, page_size={self._page_size}, "
                f"host_tokens={self._host_tokens}, backend={self._backend!r}, {state})")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``t`` as a view with the row-major strides of its shape (no copy).

    ``is_contiguous()`` ignores the strides of size-1 dimensions, so a ``[rows, 1]`` tensor of
    strides ``(1, rows)`` passes the checks and has the same bytes as a row-major one, but
    ``Tensor.view(dtype)`` refuses its last stride.
    """
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= max(size, 1)
    strides = tuple(reversed(strides))
    return t if t.stride() == strides else t.as_strided(t.shape, strides)


def _check_max_blocks(max_blocks) -> None:
    if max_blocks is not None:
        require_positive_int("max_blocks", max_blocks)
