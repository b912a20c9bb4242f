"""The CUDA caching allocator's history of one recording, replayed into blocks.

NOTE [trace accounting]: ``memory_allocated`` counts a block from its allocation until
``free()`` is called on it. In ``CUDACachingAllocator::free`` the ``allocated_bytes`` stat
drops and the ``free_requested`` trace entry is recorded in the same call; the
``free_completed`` entry comes later (at once, or only after the events of the other streams
that used the block completed, ``record_stream``) and only changes the reuse of the memory.
The replay therefore counts a block from its ``alloc`` to its ``free_requested``. Blocks
allocated before the recording come from the allocator snapshot taken when it starts
(``active_allocated`` blocks of this device's segments). Sizes are the requested sizes the
trace carries, so the replayed peak can sit a little below ``max_memory_allocated``, which
counts whole blocks (rounded up to 512 bytes; a large block may keep an unsplit remainder of
up to 1 MiB); the report gives both.
"""
from __future__ import annotations

import dataclasses
import os

import torch

DEFAULT_MAX_ENTRIES = 1_000_000
_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_MEMORY_ROOT = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclasses.dataclass
class TraceBlock:
    """One allocator block: address, requested bytes, life span in replay events."""

    addr: int
    nbytes: int
    start: int                  # event index of its allocation (-1: allocated before)
    end: int | None = None      # event index of its free (None: alive at the end)
    t_alloc_us: int = 0
    t_free_us: int | None = None
    frames: list = dataclasses.field(default_factory=list)
    in_graph_pool: bool = False


@dataclasses.dataclass
class AllocatorRecording:
    """What a recording left: blocks, ordered events, the allocator's own peak."""

    blocks: list
    events: list                # (block index, +1 | -1)
    allocator_peak: int         # max_memory_allocated during the recording
    truncated: bool             # the history filled max_entries: its oldest part is lost
    times_us: list              # time_us of each event (for placing marks)
    snapshot: dict = dataclasses.field(default=None, repr=False)   # torch's, as it was read


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _private_pools(segments: list) -> list:
    """``[(start, end)]`` address ranges of segments that belong to a private (graph) pool."""
    ranges = []
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id", (0, 0)) or (0, 0))
        if any(pool):
            ranges.append((seg["address"], seg["address"] + seg["total_size"]))
    return ranges


def _in_ranges(addr: int, ranges: list) -> bool:
    return any(lo <= addr < hi for lo, hi in ranges)


def _segments(snapshot: dict, index: int) -> list:
    return [s for s in snapshot.get("segments", []) if s.get("device", index) == index]


class AllocatorRecorder:
    """Turns the allocator history on around a recording (``start`` / ``stop``)."""

    def __init__(self, device: torch.device, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.device = device
        self.index = _device_index(device)
        self.max_entries = max_entries
        self._before: list = []
        self._before_pools: list = []

    def start(self) -> None:
        """Turn the history on (cleared), read the blocks alive now, reset the peak."""
        torch.cuda.synchronize(self.device)
        torch.cuda.memory._record_memory_history(None)
        kwargs = dict(context="alloc", stacks="python", max_entries=self.max_entries)
        try:
            torch.cuda.memory._record_memory_history("all", clear_history=True, **kwargs)
        except TypeError:       # torch without clear_history: enabling resets the history
            torch.cuda.memory._record_memory_history("all", **kwargs)
        snapshot = torch.cuda.memory._snapshot()
        segments = _segments(snapshot, self.index)
        self._before_pools = _private_pools(segments)
        self._before = [(b["address"], b.get("requested_size", b["size"]))
                        for s in segments for b in s.get("blocks", [])
                        if b.get("state") == "active_allocated"]
        torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> AllocatorRecording:
        """Read the history, turn it off and replay it into blocks."""
        try:
            torch.cuda.synchronize(self.device)
            snapshot = torch.cuda.memory._snapshot()
            allocator_peak = torch.cuda.max_memory_allocated(self.device)
        finally:
            torch.cuda.memory._record_memory_history(None)
        traces = snapshot.get("device_traces", [])
        trace = list(traces[self.index]) if self.index < len(traces) else []
        pools = self._before_pools + _private_pools(_segments(snapshot, self.index))
        blocks, events, times = _replay(self._before, trace)
        for b in blocks:
            b.in_graph_pool = _in_ranges(b.addr, pools)
        return AllocatorRecording(blocks, events, allocator_peak,
                                  len(trace) >= self.max_entries, times, snapshot)


def _replay(before: list, trace: list):
    """Blocks and ``(block, +1 | -1)`` events of ``trace`` (NOTE [trace accounting])."""
    blocks = [TraceBlock(addr, size, -1) for addr, size in before]
    live = {b.addr: i for i, b in enumerate(blocks)}
    events, times = [], []

    def close(index: int, t) -> None:
        blocks[index].end = len(events)
        blocks[index].t_free_us = t
        events.append((index, -1))
        times.append(t)

    for entry in trace:
        action = entry.get("action")
        addr = entry.get("addr")
        t = entry.get("time_us", 0)
        if action == "alloc":
            old = live.pop(addr, None)             # only if a free went unrecorded
            if old is not None:
                close(old, t)
            live[addr] = len(blocks)
            blocks.append(TraceBlock(addr, entry["size"], len(events), t_alloc_us=t,
                                     frames=entry.get("frames") or []))
            events.append((live[addr], +1))
            times.append(t)
        elif action == "free_requested":
            index = live.pop(addr, None)
            if index is not None:
                close(index, t)
    return blocks, events, times


def site(frames: list) -> str:
    """``file:line function`` of the innermost frame outside torch and this package."""
    for f in frames:
        name = f.get("filename", "")
        if not name or name.startswith("<") or name == "??":
            continue
        path = os.path.abspath(name)
        if path.startswith((_TORCH_ROOT, _MEMORY_ROOT)):
            continue
        return f"{os.path.basename(path)}:{f.get('line', '?')} {f.get('name', '?')}"
    return "no Python frames"


def match_records(blocks: list, records: list) -> tuple[dict, float, int]:
    """``({block index: record}, share of records matched closely, clock offset in µs)``
    pairing the recorder's storages with allocator blocks.

    NOTE [matching storages to blocks]: a storage's data pointer is its block's address, but
    several blocks may have had that address during the recording, so the pair is the block
    at that address whose allocation and free times are closest to the storage's. Both are
    wall-clock microseconds (the allocator converts its cycle counter to Unix time); a
    constant offset between the two clocks is estimated first, as the median over storages
    whose address had one block only. A storage whose nearest block is more than a
    millisecond off counts as matched loosely; the share of close matches goes into the
    report's notes when it is low.
    """
    by_addr: dict = {}
    for i, b in enumerate(blocks):
        if b.start >= 0:
            by_addr.setdefault(b.addr, []).append(i)
    records = [r for r in records if r.start >= 0 and r.key[1] in by_addr]
    single = sorted(blocks[by_addr[r.key[1]][0]].t_alloc_us - r.t_alloc_us for r in records
                    if len(by_addr[r.key[1]]) == 1)
    offset = single[len(single) // 2] if single else 0
    far = 10 ** 15
    matched, close = {}, 0
    for rec in records:
        best, best_cost = None, None
        for i in by_addr[rec.key[1]]:
            b = blocks[i]
            if (b.t_free_us is None) != (rec.t_free_us is None):
                free_cost = far
            elif b.t_free_us is None:
                free_cost = 0
            else:
                free_cost = abs(b.t_free_us - offset - rec.t_free_us)
            cost = abs(b.t_alloc_us - offset - rec.t_alloc_us) + free_cost
            if best_cost is None or cost < best_cost:
                best, best_cost = i, cost
        if best not in matched:
            matched[best] = rec
            close += best_cost <= 2000
    return matched, close / max(1, len(records)), offset
