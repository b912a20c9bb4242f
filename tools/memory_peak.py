"""Explain where the peak of ``torch.cuda.max_memory_allocated`` comes from, block by block.

Records the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``)
around one call, replays the recorded events to find the moment of peak allocated bytes and
lists the blocks alive at that moment with the Python frames that allocated them. Two
workloads of this repository are built in:

- ``stash``: the "memory" configuration of ``graphstash bench stash`` (one plain step, one
  step with ``stash_activations``);
- ``moe``: a ``graphstash bench moe`` model in modes "graph + budget" and
  "graph + budget + stash" (one eager steady-state step, and the CUDA graph capture).

Usage::

    python tools/memory_peak.py [--workload stash|moe|both] [--min-mib 1] [--top 25]

NOTE [trace accounting]: ``memory_allocated`` counts a block from its allocation until
``free()`` is called on it. In ``CUDACachingAllocator::free`` the ``allocated_bytes`` stat
drops and the ``free_requested`` trace entry is recorded in the same call; the
``free_completed`` entry comes later (at once, or only after the events of the other streams
that used the block have completed, ``record_stream``) and only changes ``active_bytes`` /
``requested_bytes`` and the reuse of the memory. The replay therefore counts a block from
its ``alloc`` to its ``free_requested``. Two differences remain against the allocator's own
peak: the trace carries the *requested* size of a block while ``allocated_bytes`` counts the
block's size (rounded up to 512 bytes, and a large block keeps an unsplit remainder of up to
1 MiB), so the replayed peak is a little lower than ``max_memory_allocated``; both are printed.
Blocks allocated before the recording started are the constant ``before`` (read with
``memory_allocated`` just before the call); a ``free_requested`` of an address the trace never
allocated frees one of those blocks and is subtracted from it.

NOTE [frames]: with ``stacks="python"`` only Python frames are recorded, innermost first. The
autograd engine runs CUDA backward ops on its own device thread, which runs no Python code
except hooks and Python ``backward`` functions, so most backward allocations carry no frames;
they are listed as ``<no Python frames>`` together with the nearest earlier allocation that
had frames (``after ...``). ``--stacks all`` adds C++ frames (slower), which name the
autograd node (``...Backward0::apply``).

Importing this module does no CUDA work.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

MIB = float(2**20)
REPO = Path(__file__).resolve().parents[1]
DEFAULT_MAX_ENTRIES = 1_000_000
FRAMES_SHOWN = 4
SITES_SHOWN = 10

# The "memory" configuration of ``graphstash bench stash`` (``_config_run``).
STASH_LAYERS, STASH_BUDGET, STASH_HIDDEN, STASH_FFN = 8, 8192, 1024, 4096
MOE_MODES = ("graph + budget", "graph + budget + stash")
MOE_WARMUP = 3          # eager steps before the capture, as in ``bench moe``'s ``_run_mode``


# ---- recording ------------------------------------------------------------------------------
@dataclasses.dataclass
class Recording:
    """What one recorded call left: allocator numbers and the device's trace entries."""

    before: int              # memory_allocated just before the call
    after: int               # memory_allocated just after it (synchronized)
    allocator_peak: int      # max_memory_allocated during the call, minus ``before``
    trace: list              # the device's trace entries, oldest first
    truncated: bool          # the history filled ``max_entries``: its oldest part is lost


def _device_index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _start_recording(max_entries: int, stacks: str) -> None:
    """Enable the allocator history (alloc-time stacks) with an empty history."""
    kwargs = dict(context="alloc", stacks=stacks, max_entries=max_entries)
    try:
        torch.cuda.memory._record_memory_history("all", clear_history=True, **kwargs)
    except TypeError:       # torch without clear_history: enabling resets the history
        torch.cuda.memory._record_memory_history("all", **kwargs)


def _stop_recording() -> None:
    torch.cuda.memory._record_memory_history(None)


def record(fn: Callable[[], object], *, device, max_entries: int = DEFAULT_MAX_ENTRIES,
           stacks: str = "python") -> Recording:
    """Run ``fn()`` with the allocator history on; return the trace and allocator numbers.

    As in ``graphstash.bench.stash._peak`` (NOTE [measuring peaks]), garbage is collected
    first and the cyclic collector is off while ``fn`` runs, so nothing unrelated is freed in
    the middle of it.
    """
    gc.collect()
    torch.cuda.synchronize(device)
    _stop_recording()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _start_recording(max_entries, stacks)
        try:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            fn()
            torch.cuda.synchronize(device)
            snapshot = torch.cuda.memory._snapshot(device)
        finally:
            _stop_recording()
        allocator_peak = torch.cuda.max_memory_allocated(device) - before
        after = torch.cuda.memory_allocated(device)
    finally:
        if gc_was_enabled:
            gc.enable()
    traces = snapshot.get("device_traces", [])
    index = _device_index(device)
    trace = list(traces[index]) if index < len(traces) else []
    return Recording(before, after, allocator_peak, trace, len(trace) >= max_entries)


# ---- replay -----------------------------------------------------------------------------------
@dataclasses.dataclass
class TraceBlock:
    """A block allocated during the recording: where, how big, on which stream, by whom."""

    addr: int
    size: int
    stream: int
    frames: list
    event: int               # index of its 'alloc' entry in the trace
    after: str | None = None  # frameless blocks: the nearest earlier allocation with frames


@dataclasses.dataclass
class Replay:
    """The state of the trace at its peak (bytes relative to ``before``)."""

    peak: int                        # allocated bytes above ``before`` at the peak (>= 0)
    peak_event: int | None           # trace index of the 'alloc' that reached it (None: none)
    live: list                       # TraceBlocks alive at the peak
    freed_before_at_peak: int        # bytes of pre-existing blocks freed by then
    freed_before_total: int          # ... by the end of the trace
    end: int                         # allocated bytes above ``before`` at the end
    actions: Counter                 # trace entries by action
    segment_bytes: int               # bytes cudaMalloc'd during the call


def _walk(trace: list, stop: int | None = None) -> dict:
    """Replay ``trace`` (up to and including entry ``stop``); see NOTE [trace accounting]."""
    live: dict[int, TraceBlock] = {}
    state = {"current": 0, "peak": 0, "peak_event": None, "freed_before": 0,
             "freed_before_at_peak": 0, "actions": Counter(), "segment_bytes": 0}
    last_framed = None
    for i, entry in enumerate(trace):
        if stop is not None and i > stop:
            break
        action = entry.get("action")
        state["actions"][action] += 1
        if action == "alloc":
            old = live.pop(entry["addr"], None)    # only if a free went unrecorded
            if old is not None:
                state["current"] -= old.size
            frames = entry.get("frames") or []
            block = TraceBlock(entry["addr"], entry["size"], entry.get("stream", 0), frames, i,
                               None if frames else last_framed)
            if frames:
                last_framed = _where(frames, 1)
            live[block.addr] = block
            state["current"] += block.size
            if state["current"] > state["peak"]:
                state["peak"], state["peak_event"] = state["current"], i
                state["freed_before_at_peak"] = state["freed_before"]
        elif action == "free_requested":
            block = live.pop(entry["addr"], None)
            if block is None:                       # allocated before the recording
                state["freed_before"] += entry["size"]
                state["current"] -= entry["size"]
            else:
                state["current"] -= block.size
        elif action == "segment_alloc":
            state["segment_bytes"] += entry.get("size", 0)
    state["live"] = live
    return state


def replay(trace: list) -> Replay:
    """Find the peak of allocated bytes in ``trace`` and the blocks alive at that moment."""
    full = _walk(trace)
    at_peak = _walk(trace, full["peak_event"]) if full["peak_event"] is not None else None
    return Replay(peak=full["peak"], peak_event=full["peak_event"],
                  live=list(at_peak["live"].values()) if at_peak else [],
                  freed_before_at_peak=full["freed_before_at_peak"],
                  freed_before_total=full["freed_before"], end=full["current"],
                  actions=full["actions"], segment_bytes=full["segment_bytes"])


# ---- frames -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _own_roots() -> tuple:
    """Folders whose frames count as this project's: the package, tools/ and tests/."""
    roots = {REPO / "graphstash", REPO / "tools", REPO / "tests"}
    try:
        import graphstash
        roots.add(Path(graphstash.__file__).resolve().parent)
    except ImportError:
        pass
    return tuple(str(r) + os.sep for r in roots)


@functools.lru_cache(maxsize=None)
def _torch_root() -> str:
    return str(Path(torch.__file__).resolve().parent) + os.sep


@functools.lru_cache(maxsize=None)
def _resolve(filename: str) -> str:
    if not filename or filename.startswith("<") or filename == "??":
        return filename or ""
    try:
        return str(Path(filename).resolve())
    except (OSError, RuntimeError):
        return filename


def _is_own(frame: dict) -> bool:
    return _resolve(frame.get("filename", "")).startswith(_own_roots())


def _is_torch(frame: dict) -> bool:
    path = _resolve(frame.get("filename", ""))
    return path.startswith(_torch_root()) or "/torch/csrc/" in path or "/c10/" in path


_AUTOGRAD_NODE = re.compile(r"\w+Backward\w*::apply")


def pick_frames(frames: list, count: int = FRAMES_SHOWN) -> list:
    """The ``count`` innermost frames of this project (package, tools/, tests/); else the
    innermost autograd node and non-torch frames (C++ stacks), else the innermost frames."""
    own = [f for f in frames if _is_own(f)]
    if own:
        return own[:count]
    nodes = [f for f in frames if _AUTOGRAD_NODE.search(f.get("name", ""))]
    other = [f for f in frames if not _is_torch(f) and f.get("filename") not in ("", "??")]
    picked = (nodes[:1] + other)[:count]
    return picked or frames[:count]


def _short_path(filename: str) -> str:
    path = _resolve(filename)
    for root in (str(REPO) + os.sep, str(Path(_torch_root()).parent) + os.sep):
        if path.startswith(root):
            return path[len(root):]
    parts = Path(path).parts
    return os.path.join(*parts[-2:]) if len(parts) >= 2 else path


def _frame_text(frame: dict) -> str:
    name = frame.get("name", "?")
    if len(name) > 60:                           # C++ signatures
        name = name[:57] + "..."
    return f"{_short_path(frame.get('filename', '?'))}:{frame.get('line', '?')} {name}"


def _where(frames: list, count: int = FRAMES_SHOWN) -> str:
    """Innermost first, each frame called from the next (``<-``)."""
    picked = pick_frames(frames, count)
    return " <- ".join(_frame_text(f) for f in picked) if picked else "<no Python frames>"


def _block_where(block: TraceBlock, count: int = FRAMES_SHOWN) -> str:
    if block.frames:
        return _where(block.frames, count)
    return "<no Python frames>" + (f" (after {block.after})" if block.after else "")


# ---- report -----------------------------------------------------------------------------------
def _stream_names(device, extra: dict | None) -> dict:
    """``{cudaStream_t as int: label}``: the current stream, torch.cuda.graph's capture
    stream (once one exists) and ``extra``."""
    names = {torch.cuda.current_stream(device).cuda_stream: "current",
             torch.cuda.default_stream(device).cuda_stream: "default"}
    capture = getattr(torch.cuda.graph, "default_capture_stream", None)
    if capture is not None:
        names[capture.cuda_stream] = "capture"
    names.update(extra or {})
    return names


def _stream_label(stream: int, names: dict) -> str:
    return names.get(stream, hex(stream))


def _mib(n: int) -> str:
    if abs(n) < MIB:
        return f"{n / 1024:.1f} KiB"
    return f"{n / MIB:.1f} MiB"


def _header_lines(title: str, rec: Recording, rep: Replay) -> list:
    a = rep.actions
    lines = [f"== {title} ==" if title else "== peak report ==",
             f"allocated before: {_mib(rec.before)}; after: {_mib(rec.after)} "
             f"({(rec.after - rec.before) / MIB:+.1f} MiB)",
             f"trace: {len(rec.trace)} entries (alloc {a['alloc']}, free_requested "
             f"{a['free_requested']}, free_completed {a['free_completed']}, segment_alloc "
             f"{a['segment_alloc']} = {_mib(rep.segment_bytes)} cudaMalloc'd)",
             f"peak: {_mib(rep.peak)} above before = {_mib(rec.before + rep.peak)} "
             f"(trace replay, requested sizes); allocator: {_mib(rec.allocator_peak)} above "
             f"before = {_mib(rec.before + rec.allocator_peak)} (max_memory_allocated, block "
             f"sizes)"]
    if rep.freed_before_total:
        lines.append(f"blocks allocated before the call and freed in it: "
                     f"{_mib(rep.freed_before_at_peak)} by the peak, "
                     f"{_mib(rep.freed_before_total)} in all")
    if rec.truncated:
        lines.append("WARNING: the history filled max_entries and lost its oldest entries; "
                     "the replay is wrong: raise --max-entries")
    return lines


def _last_alloc_lines(rec: Recording, rep: Replay, names: dict) -> list:
    if rep.peak_event is None:
        return ["no allocation raised memory above its level before the call"]
    entry = rec.trace[rep.peak_event]
    block = next((b for b in rep.live if b.event == rep.peak_event), None)
    where = _block_where(block) if block else _where(entry.get("frames") or [])
    return [f"last allocation before the peak (entry {rep.peak_event} of {len(rec.trace)}): "
            f"{_mib(entry['size'])} on stream {_stream_label(entry.get('stream', 0), names)}",
            f"    {where}"]


def _block_lines(rep: Replay, names: dict, min_bytes: int, top: int) -> list:
    big = sorted((b for b in rep.live if b.size >= min_bytes), key=lambda b: -b.size)
    small = [b for b in rep.live if b.size < min_bytes]
    lines = [f"alive at the peak (allocated during the call): {len(rep.live)} blocks, "
             f"{_mib(sum(b.size for b in rep.live))}; >= {_mib(min_bytes)}: {len(big)} blocks, "
             f"{_mib(sum(b.size for b in big))} (largest {min(top, len(big))} listed); "
             f"below: {len(small)} blocks, {_mib(sum(b.size for b in small))}",
             f"  {'#':>3} {'MiB':>9}  {'stream':<10} where (innermost first, <- caller)"]
    for i, b in enumerate(big[:top], 1):
        lines.append(f"  {i:>3} {b.size / MIB:>9.2f}  {_stream_label(b.stream, names):<10} "
                     f"{_block_where(b)}")
    return lines


def _site_lines(rep: Replay) -> list:
    """Bytes alive at the peak by allocation site (innermost frame shown)."""
    sites: dict[str, list] = {}
    for b in rep.live:
        key = _block_where(b, 1)
        entry = sites.setdefault(key, [0, 0])
        entry[0] += b.size
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:SITES_SHOWN]
    lines = [f"by site (innermost frame), top {len(ranked)}:"]
    lines += [f"  {size / MIB:>9.2f} MiB in {n:>5} blocks  {site}" for site, (size, n) in ranked]
    return lines


def peak_report(fn: Callable[[], object], *, device, min_bytes: int = 1 << 20, top: int = 25,
                title: str = "", stream_names: dict | None = None,
                max_entries: int = DEFAULT_MAX_ENTRIES, stacks: str = "python") -> str:
    """Run ``fn()`` once under the allocator history and explain its peak of allocated bytes.

    Returns the text: memory before/after, the replayed and the allocator's peak, the last
    allocation before the peak, the blocks alive at the peak of at least ``min_bytes``
    (largest first, up to ``top``; each with MiB, stream and its innermost frames) with the
    total of the smaller ones, and the bytes by allocation site. ``stream_names`` maps
    ``stream.cuda_stream`` to a label. See NOTE [trace accounting] and NOTE [frames].
    """
    rec = record(fn, device=device, max_entries=max_entries, stacks=stacks)
    rep = replay(rec.trace)
    names = _stream_names(device, stream_names)
    lines = _header_lines(title, rec, rep)
    lines += _last_alloc_lines(rec, rep, names)
    lines += _block_lines(rep, names, min_bytes, top)
    lines += _site_lines(rep)
    return "\n".join(lines)


# ---- helpers shared by the workloads -------------------------------------------------------------
def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor) and t.is_cuda)


def _pool_bytes(manager) -> int:
    """Device bytes of the stash manager's buffers (pages and bookkeeping)."""
    return sum(b.device_bytes for b in manager.buffers.values())


def _manager_streams(manager) -> dict:
    if manager is None or manager.pack_stream is None:
        return {}
    return {manager.pack_stream.cuda_stream: "pack", manager.unpack_stream.cuda_stream: "unpack"}


def _allocated(device) -> str:
    torch.cuda.synchronize(device)
    return _mib(torch.cuda.memory_allocated(device))


def _release_memory(device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


# ---- stash workload ---------------------------------------------------------------------------
def _stash_setup(device, prefetch: str = "at_last_unpack"):
    """Model, input, counts and a sized manager, as ``bench stash``'s ``_config_run`` builds
    them for its "memory" configuration (warmup, sizing from demand, steady state)."""
    import graphstash
    from graphstash.bench.stash import ExpertStack, _step, make_inputs

    gen = torch.Generator().manual_seed(0)
    model = ExpertStack(STASH_LAYERS, STASH_HIDDEN, STASH_FFN, dtype=torch.bfloat16,
                        device=device, generator=gen)
    live = STASH_BUDGET // 2
    x = make_inputs(1, STASH_BUDGET, STASH_HIDDEN, dtype=torch.bfloat16, device=device,
                    generator=gen)[0]
    counts = [torch.tensor([live], dtype=torch.int32, device=device)
              for _ in range(STASH_LAYERS)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    graphstash.warmup()
    manager = graphstash.StashManager(graphstash.StashConfig(prefetch=prefetch), device=device)
    for _ in range(2):
        _step(model, x, counts, manager)
    manager.size_from_demand()
    for _ in range(2):
        _step(model, x, counts, manager)
    return model, x, counts, manager, live


def run_stash(device, *, min_bytes: int, top: int, max_entries: int, stacks: str,
              prefetch: str = "at_last_unpack") -> None:
    """Print the peak reports of one plain step and one stash step (``bench stash``)."""
    from graphstash.bench.stash import _step

    print(f"\n#### stash workload: ExpertStack layers={STASH_LAYERS} budget={STASH_BUDGET} "
          f"live={STASH_BUDGET // 2} hidden={STASH_HIDDEN} ffn={STASH_FFN} bf16, "
          f"prefetch={prefetch}")
    model, x, counts, manager, live = _stash_setup(device, prefetch)
    pool = _pool_bytes(manager)
    stashed = (STASH_LAYERS - 1) * live * (STASH_HIDDEN + 2 * STASH_FFN) * 2
    grads = (p.grad for p in model.parameters())
    print(f"weights {_mib(_tensor_bytes(model.parameters()))}, grads "
          f"{_mib(_tensor_bytes(grads))}, input {_mib(_tensor_bytes([x]))}")
    print(f"stash pool: {_mib(pool)} (sum of device_bytes over manager.buffers); live rows of "
          f"every layer but the last: {_mib(stashed)}")
    opts = dict(device=device, min_bytes=min_bytes, top=top, max_entries=max_entries,
                stacks=stacks, stream_names=_manager_streams(manager))
    print(peak_report(lambda: _step(model, x, counts), title="stash workload: plain step", **opts))
    print(peak_report(lambda: _step(model, x, counts, manager),
                      title="stash workload: stash step (the pool is in 'before')", **opts))
    print(f"stash pool after the steps: {_mib(_pool_bytes(manager))}")
    manager.release()


# ---- moe workload -----------------------------------------------------------------------------
def moe_config(layers: int = 8, num_tokens: int = 8192):
    """A memory-bound-like ``MoEConfig`` (capacity factor 2: budget = 2 x the average rows)."""
    from graphstash.models import MoEConfig

    return MoEConfig(hidden=2048, ffn=4096, num_experts=8, topk=2, layers=layers,
                     num_tokens=num_tokens, capacity_factor=2.0, pad_multiple=16)


def _moe_build(mode: str, config, device):
    """Status, manager, model and optimizer as ``bench moe``'s ``_run_mode`` builds them."""
    from graphstash import _layout as L
    from graphstash.bench.moe import _stash_manager
    from graphstash.models import MoEModel

    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    model_mode = "budget" if mode == "graph + budget" else "stash"
    manager = _stash_manager(mode, device, status) if model_mode == "stash" else None
    model = MoEModel(config, mode=model_mode, stash_manager=manager, status=status,
                     seed=0).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    return model, opt, manager


def _on_stream(stream, fn: Callable[[], object], times: int) -> None:
    """Run ``fn`` ``times`` times on ``stream``, ordered after and before the current stream
    (the eager half of ``capture_with_output``)."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    current.wait_stream(stream)


def _moe_static_lines(model, opt, manager) -> str:
    state = [t for s in opt.state.values() for t in s.values()]
    text = (f"weights {_mib(_tensor_bytes(model.parameters()))}, grads "
            f"{_mib(_tensor_bytes(p.grad for p in model.parameters()))}, AdamW state "
            f"{_mib(_tensor_bytes(state))}")
    if manager is not None:
        text += f", stash pool {_mib(_pool_bytes(manager))}"
    return text


def run_moe_mode(mode: str, config, device, *, min_bytes: int, top: int, max_entries: int,
                 stacks: str) -> None:
    """Print the peak reports of one eager steady-state step and of the capture for ``mode``."""
    from graphstash.bench._timing import capture_with_output
    from graphstash.moe import experts as _experts

    _release_memory(device)
    print(f"\n#### moe workload, mode {mode!r}")
    print(f"allocated before the model: {_allocated(device)}")
    model, opt, manager = _moe_build(mode, config, device)
    gen = torch.Generator().manual_seed(1234)
    static_x = torch.randn(config.num_tokens, config.hidden, generator=gen).to(
        device=device, dtype=torch.bfloat16)
    _experts._probe(device, static_x.dtype)
    from graphstash.bench.moe import train_step

    step = train_step(model, opt, manager, static_x)
    side = torch.cuda.Stream(device)
    _on_stream(side, step, MOE_WARMUP)
    print(f"allocated after build and {MOE_WARMUP} eager warmup steps: {_allocated(device)}")
    print(_moe_static_lines(model, opt, manager))
    names = {side.cuda_stream: "eager-side", **_manager_streams(manager)}
    opts = dict(device=device, min_bytes=min_bytes, top=top, max_entries=max_entries,
                stacks=stacks, stream_names=names)
    print(peak_report(lambda: _on_stream(side, step, 1),
                      title=f"moe {mode}: one eager steady-state step", **opts))
    held = {}

    def capture():
        held["graph"], held["out"] = capture_with_output(step, warmup=0)

    print(peak_report(capture, title=f"moe {mode}: CUDA graph capture of one step", **opts))
    print(f"allocated after the capture: {_allocated(device)}; "
          + _moe_static_lines(model, opt, manager))
    held.clear()                    # the graph and its outputs go first, then the pool
    if manager is not None:
        manager.release()


def run_moe(device, *, layers: int, num_tokens: int, min_bytes: int, top: int,
            max_entries: int, stacks: str) -> None:
    """Both graphed modes of ``bench moe`` on :func:`moe_config`."""
    config = moe_config(layers, num_tokens)
    print(f"\n#### moe workload: {config}")
    for mode in MOE_MODES:
        run_moe_mode(mode, config, device, min_bytes=min_bytes, top=top,
                     max_entries=max_entries, stacks=stacks)
        _release_memory(device)     # the mode's model, optimizer and graph are gone now


# ---- command line -------------------------------------------------------------------------------
def _ensure_importable() -> None:
    """Let ``python tools/memory_peak.py`` import the checkout's graphstash."""
    try:
        import graphstash  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("stash", "moe", "both"), default="both")
    p.add_argument("--min-mib", type=float, default=1.0,
                   help="list blocks of at least this many MiB (default 1)")
    p.add_argument("--top", type=int, default=25, help="blocks listed per report (default 25)")
    p.add_argument("--stacks", choices=("python", "all"), default="python",
                   help="'all' adds C++ frames (names backward nodes; slower)")
    p.add_argument("--max-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                   help="allocator history entries kept per report")
    p.add_argument("--prefetch", choices=("at_last_unpack", "after_release"),
                   default="at_last_unpack", help="StashConfig.prefetch of the stash workload")
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--moe-tokens", type=int, default=8192)
    return p


def main(argv: list | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_peak: needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 1
    _ensure_importable()
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"memory_peak on {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    opts = dict(min_bytes=int(args.min_mib * MIB), top=args.top,
                max_entries=args.max_entries, stacks=args.stacks)
    if args.workload in ("stash", "both"):
        run_stash(device, prefetch=args.prefetch, **opts)
        _release_memory(device)
    if args.workload in ("moe", "both"):
        run_moe(device, layers=args.moe_layers, num_tokens=args.moe_tokens, **opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
