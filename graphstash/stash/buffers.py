"""``StashBuffers``: the paged buffers of a :class:`~graphstash.StashManager`, one per
(dtype, row width), and how they are sized from the demand measured in warmup steps.

NOTE [warmup sizing]: buffers are created per (dtype, row width) when first needed. With
``StashConfig.initial_tokens == 0`` a group whose buffer does not exist yet keeps its saved
tensors (so the warmup step is correct and as memory-hungry as without stashing), reads its
counts back to the host (a sync, fine in an eager step; under capture this raises
``CaptureError``) and notes the pages it would have taken. At the end of the step the events
are replayed (NOTE [warmup demand]) into high-water marks, and the next ``begin_step()``
outside a capture creates the missing buffers at ``factor x peak``. Once buffers exist the
kernels keep measuring demand on the device (pages wanted, stored or not), and
``size_from_demand()`` re-sizes every buffer from the highest mark seen so far.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import _layout as L
from .._checks import is_capturing
from ..errors import CaptureError, ReleasedError
from ..paging import MAX_PAGES, PagedStashBuffer
from .config import StashConfig


def key_name(key) -> str:
    """``"bfloat16[4096]"`` for the buffer key ``(torch.bfloat16, 4096)``, ``"#3
    bfloat16[4096]"`` for group 3's ``(3, torch.bfloat16, 4096)`` (``pool="per_group"``)."""
    dtype, width = key[-2:]
    name = f"{str(dtype).replace('torch.', '')}[{width}]"
    return name if len(key) == 2 else f"#{key[0]} {name}"


class StashBuffers:
    """The buffers one manager stashes into, their sizes and the demand that set them.

    Args:
        config: the :class:`StashConfig` (page size, tier factors, backend); :meth:`grow`
            replaces it with a grown copy.
        device: where the buffers live.
        status: the int32 ``[8]`` status tensor every buffer shares (on ``device``).

    ``generation`` counts the times the buffers changed under a step (rings reset, re-sized,
    released): a group stashed in an older generation cannot be reloaded. ``fold_device_demand``
    (default True): whether :meth:`collect_peaks` raises the demand that sizes the buffers to
    the pages the device saw; False once the groups' experts compute on the rows their pages
    hold (NOTE [growth to the need] in ``plan.py``).

    Example::

        buffers = StashBuffers(StashConfig(), torch.device("cpu"), new_status("cpu"))
        buffers.note_peak((torch.float32, 64), pages=12, entries=40)
        buffers.size_from_demand()        # one float32[64] buffer of 1.1 x 12 pages
    """

    def __init__(self, config: StashConfig, device: torch.device, status: torch.Tensor):
        if config.backend == "cupy" and device.type != "cuda":
            raise ValueError(f"config: backend='cupy' needs a CUDA device, the stash's device is "
                             f"{device}")
        self.config = config
        self.device = device
        self.status = status
        self.released = False
        self.generation = 0
        self.fold_device_demand = True
        self._buffers: dict = {}          # key -> PagedStashBuffer
        self._sizes: dict = {}            # key -> (device_tokens, host_tokens, record_entries)
        self._peak_pages: dict = {}       # key -> highest demand in pages seen
        self._peak_entries: dict = {}     # key -> highest record-table entries in use seen
        self._live_entries: dict = {}     # key -> record entries of outstanding handles

    # ---- lookup ---------------------------------------------------------------------------
    @property
    def buffers(self) -> dict:
        """``{key: PagedStashBuffer}`` created so far (a copy); a key is ``(dtype, row_width)``,
        or ``(group, dtype, row_width)`` with ``pool="per_group"``."""
        return dict(self._buffers)

    @property
    def per_group(self) -> bool:
        """Whether each layer group has its own buffers, their pages lent (``pool="per_group"``;
        NOTE [pages per group] in ``scheduler.py``)."""
        return self.config.pool == "per_group"

    def get(self, key) -> PagedStashBuffer:
        """The buffer of ``key`` (it exists: see :meth:`ensure`)."""
        return self._buffers[key]

    def ensure(self, key) -> bool:
        """Whether ``key`` has a buffer, creating it now if its size is known (measured, or
        ``initial_tokens``); False means the caller notes its demand instead."""
        if key in self._buffers:
            return True
        if self.released:
            raise ReleasedError("stash_activations: the StashManager was released; call "
                                "reallocate() first")
        c = self.config
        if c.initial_tokens > 0 and key not in self._sizes:
            self._sizes[key] = (c.initial_tokens, 0,
                                max(65536, 8 * -(-c.initial_tokens // c.page_size)))
        if key in self._sizes:
            self.create(key)
        return key in self._buffers

    # ---- demand ---------------------------------------------------------------------------
    def note_entries(self, key, delta: int) -> None:
        """Record-table entries of outstanding handles changed by ``delta`` (a stash or reload)."""
        live = self._live_entries.get(key, 0) + delta
        self._live_entries[key] = live
        if live > self._peak_entries.get(key, 0):
            self._peak_entries[key] = live

    def note_peak(self, key, pages: int, entries: int) -> None:
        """A step's replayed demand of ``key`` (NOTE [warmup demand]): raise the high-water marks."""
        self._peak_pages[key] = max(self._peak_pages.get(key, 0), pages)
        self._peak_entries[key] = max(self._peak_entries.get(key, 0), entries)

    def collect_peaks(self) -> None:
        """Fold the buffers' device demand marks into the host-side peaks (syncs; nothing
        without ``fold_device_demand``)."""
        if not self.fold_device_demand:
            return
        for key, buf in self._buffers.items():
            if not buf.released:
                peak = int(buf.state[L.ST_DEMAND_PEAK].item())
                self._peak_pages[key] = max(self._peak_pages.get(key, 0), peak)

    # ---- sizing ---------------------------------------------------------------------------
    def size_for(self, key) -> tuple[int, int, int]:
        """``(device rows, host rows, record entries)`` of ``key`` at the configured factors."""
        c = self.config
        peak = self._peak_pages.get(key, 0)
        dev_pages = math.ceil(c.device_factor * peak - 1e-9)
        host_pages = math.ceil(c.host_factor * peak - 1e-9) if c.host_tier else 0
        if dev_pages + host_pages == 0:
            dev_pages = 1
        if dev_pages + host_pages > MAX_PAGES:
            raise ValueError(
                f"device_factor: {c.device_factor} (host_factor {c.host_factor}) times the peak "
                f"demand of {key_name(key)} rows ({peak} pages) asks for {dev_pages} + "
                f"{host_pages} pages; expected at most {MAX_PAGES} (32-bit page ids)")
        entries = max(65536, 8 * (dev_pages + host_pages), 2 * self._peak_entries.get(key, 0))
        return dev_pages * c.page_size, host_pages * c.page_size, entries

    def create(self, key) -> PagedStashBuffer:
        """(Re)create the buffer of ``key`` at its recorded size."""
        if is_capturing():
            raise CaptureError(
                f"stash_activations: the stash buffer for {key_name(key)} rows would be "
                "created while a CUDA graph is capturing; run an eager warmup step first (its "
                "demand sizes the buffers) or set StashConfig.initial_tokens")
        old = self._buffers.pop(key, None)
        if old is not None:
            old.release()
        dtype, width = key[-2:]
        dev_tokens, host_tokens, entries = self._sizes[key]
        buf = PagedStashBuffer(dev_tokens, width, dtype=dtype, device=self.device,
                               page_size=self.config.page_size, host_tokens=host_tokens,
                               backend=self.config.backend, status=self.status,
                               record_entries=entries, lend_pages=len(key) == 3)
        self._buffers[key] = buf
        return buf

    def create_measured(self) -> None:
        """Create the buffers a warmup step measured but no buffer holds yet (NOTE [warmup
        sizing]); outside a capture only, and not while released."""
        if self.released or is_capturing():
            return
        for key in self._peak_pages:
            if key not in self._sizes:
                self._sizes[key] = self.size_for(key)
                self.create(key)

    def take_pages(self, key) -> None:
        """Allocate the lent pages of ``key``'s buffer now, on the current stream (NOTE [lent
        pages] in ``graphstash/paging.py``); nothing for a buffer that holds its pages."""
        buf = self._buffers[key]
        if buf.lend_pages and not buf.pages_taken:
            buf.take_pages()

    def give_pages_back(self, keys) -> None:
        """Free the lent pages of the buffers of ``keys``; the caller ordered the streams."""
        for key in keys:
            buf = self._buffers.get(key)
            if buf is not None:
                buf.give_pages_back()

    def give_all_pages_back(self) -> None:
        """Free every lent page (a step ends: the caller joined the side streams)."""
        self.give_pages_back(list(self._buffers))

    def reset_rings(self) -> None:
        """Every page back on its ring, for a new step (graph-safe); a new generation."""
        for buf in self._buffers.values():
            buf.reset(clear_status=False)
        self.new_generation()

    def new_generation(self) -> None:
        """The buffers changed under the step: outstanding handles are forgotten."""
        self._live_entries = {}
        self.generation += 1

    def size_from_demand(self) -> bool:
        """(Re)allocate every buffer to its size at the configured factors (syncs); True if
        any buffer was created or changed. The caller starts a new generation then."""
        self.collect_peaks()
        changed = False
        for key in list(self._peak_pages):
            size = self.size_for(key)
            if self._sizes.get(key) == size and (self.released or key in self._buffers):
                continue
            self._sizes[key] = size
            changed = True
            if not self.released:
                self.create(key)
        return changed

    def grow(self, factor: float) -> None:
        """``config`` becomes a copy with ``device_factor x factor`` (``host_factor`` for a
        host-only stash: multiplying 0 would grow nothing); the caller re-sizes."""
        c = self.config
        field = "host_factor" if c.device_factor == 0 else "device_factor"
        self.config = dataclasses.replace(c, **{field: getattr(c, field) * factor})

    def release(self) -> None:
        """Free every buffer; :meth:`reallocate` brings them back at their last sizes."""
        self.collect_peaks()
        self._drop_all()
        self.released = True

    def reallocate(self) -> None:
        """Re-create the buffers at their last sizes."""
        self._drop_all()
        self.released = False
        for key in self._sizes:
            self.create(key)

    def forget(self) -> None:
        """Free every buffer and forget every size and demand mark: the next measured step
        sizes the buffers anew (NOTE [stash plan]: a new plan)."""
        self._drop_all()
        self._sizes, self._peak_pages, self._peak_entries = {}, {}, {}
        self.new_generation()

    def _drop_all(self) -> None:
        for buf in self._buffers.values():
            buf.release()
        self._buffers = {}

    # ---- reporting ------------------------------------------------------------------------
    def read_status(self) -> dict:
        """``buffers`` (per key name, each buffer's :meth:`PagedStashBuffer.read_status`),
        ``demand`` (peak pages per key name, sized or not) and ``unsized`` (syncs)."""
        return {
            "buffers": {} if self.released else
            {key_name(k): b.read_status() for k, b in self._buffers.items()},
            "demand": {key_name(k): v for k, v in self._peak_pages.items()},
            "unsized": [key_name(k) for k in self._peak_pages if k not in self._sizes],
        }

    def describe(self) -> str:
        """``"bfloat16[4096]: 8192+0 rows, ..."`` or ``"released"``."""
        if self.released:
            return "released"
        sizes = ", ".join(f"{key_name(k)}: {v[0]}+{v[1]} rows" for k, v in self._sizes.items())
        return f"buffers {{{sizes}}}"
