"""``graphstash bench stash``: stashing activations through autograd, next to its baselines.

An MoE-like stack (each layer an expert MLP on a static ``[budget, hidden]`` buffer with a
device count of live rows, masked residual) runs forward + backward three ways in the same
process: without stashing, with :func:`graphstash.stash_activations`, and an exact-size eager
version (each layer computes on its live rows only, what a dropless eager step would do).
It reports peak memory of the step's activations, step time (eagerly and replayed from a
CUDA graph) and, from CUDA events, how much of the stash/reload copy time ran beside compute.

:func:`config_run` and :func:`sized_peak` are public: the bench's tests run them too. The
model is :class:`graphstash.models.ExpertStack`.
"""
from __future__ import annotations

import gc

import torch

from ...models import ExpertStack, make_inputs
from ...stash import StashConfig, StashManager
from ...tables import Column
from .. import progress
from ..output import Output
from .spread import spread
from .timing import call_samples_interleaved, capture, replay_samples_interleaved

SUMMARY = "stashing activations through autograd, next to its baselines"
DESCRIPTION = ("Runs an MoE-like stack of expert MLPs on static budget buffers, half their rows "
               "live, three ways in one process: without stashing, with stash_activations and "
               "exact-size; prints peak memory, step time eagerly and replayed from a CUDA graph, "
               "and how much of the copy time ran beside compute.")
COLUMNS = (Column("config", width=13), Column("L", width=2, align="right"),
           Column("budget", width=6, align="right"), Column("hidden", width=6, align="right"),
           Column("ffn", width=5, align="right"), Column("peak MiB plain", ".1f", width=14),
           Column("stash", ".1f", width=7), Column("ratio", ".3f", width=5),
           Column("exact", ".1f", width=7), Column("ms plain", ".2f", width=8),
           Column("stash", ".2f", width=7), Column("ratio", ".3f", width=5),
           Column("exact", ".2f", width=7), Column("graph plain", ".2f", width=11),
           Column("stash", ".2f", width=7), Column("copy ms", ".2f", width=7),
           Column("overlap", width=7, align="right"))


# ---- the benchmark ------------------------------------------------------------------------
def _step(model, x, counts, manager=None):
    if manager is not None:
        manager.begin_step()
    loss = model(x, counts, manager=manager).float().square().mean()
    loss.backward()
    if manager is not None:
        # the benchmark reads the status once, after the timed steps (``status_after``); a
        # check per step would add a host sync to the eager timings (NOTE [eager overflow])
        manager.end_step(check=False)
    return loss


def _peak(fn, device) -> tuple[int, int]:
    """Peak and left-over allocated bytes of ``fn()`` above the allocation just before it.

    NOTE [measuring peaks]: garbage from earlier code (reference cycles holding CUDA tensors)
    is collected first and the cyclic collector is off while ``fn`` runs, so nothing is freed
    between reading the baseline and resetting the peak, or in the middle of ``fn``. The
    baseline is read *after* the reset, so ``peak >= baseline`` always holds and a negative
    value can only mean a bug here. Memory allocated before (the stash pool) is not in the
    returned peak; callers add it.
    """
    gc.collect()
    torch.cuda.synchronize(device)
    enabled = gc.isenabled()
    gc.disable()
    try:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        after = torch.cuda.memory_allocated(device)
    finally:
        if enabled:
            gc.enable()
    return peak - before, after - before


def _mallocs(device) -> int:
    """cudaMalloc calls of the caching allocator so far (segments ever allocated)."""
    return torch.cuda.memory_stats(device).get("segment.all.allocated", 0)


def _kernel_overlap(fn) -> tuple[float, float] | None:
    """``(overlap, copy_ms)`` from a CUDA kernel trace of ``fn()``: the share of the stash and
    reload kernels' time (``gs_stash*``, ``gs_reload*``) during which some other kernel (the
    compute stream's) was running. None if the profiler recorded no copy kernels."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    copies, computes = [], []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        s, e = float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))
        name = ev.get("name", "")
        if name.startswith(("gs_stash", "gs_reload")):
            copies.append((name, s, e))
        else:
            computes.append((s, e))
    if not copies:
        return None
    return _overlap(copies, computes), sum(e - s for _, s, e in copies) / 1e3


def _overlap(copies, computes) -> float:
    """Fraction of the copy time that falls inside some compute interval."""
    total = sum(e - s for _, s, e in copies)
    if total <= 0:
        return 0.0
    covered = 0.0
    for _, s, e in copies:
        spans = sorted((max(s, cs), min(e, ce)) for cs, ce in computes if ce > s and cs < e)
        last = s
        for a, b in spans:
            a = max(a, last)
            if b > a:
                covered += b - a
                last = b
    return covered / total


def _pool_state(manager) -> dict:
    """``{key: (buffer id, device page address, device bytes)}`` of the manager's buffers."""
    return {k: (id(b), b.pages_ptr, b.device_bytes)
            for k, b in manager.buffers.items() if not b.released}


def sized_peak(model: ExpertStack, x: torch.Tensor, counts: list, device,
               config: StashConfig) -> int:
    """Peak bytes of one steady-state stash step of ``model`` with a fresh manager of
    ``config`` (warmed up and sized as in :func:`config_run`), its pool included.

    ``x``: ``[budget, hidden]`` input of ``model``'s dtype on the CUDA ``device``;
    ``counts[l]``: int32 ``(1,)`` device tensor, live rows of layer ``l``. Example::

        peak = sized_peak(model, x, counts, device, StashConfig(prefetch="after_release"))
    """
    manager = StashManager(config, device=device)
    for _ in range(2):
        _step(model, x, counts, manager)
    manager.size_from_demand()
    for _ in range(2):
        _step(model, x, counts, manager)
    pool = sum(b for _, _, b in _pool_state(manager).values())
    peak, _ = _peak(lambda: _step(model, x, counts, manager), device)
    manager.release()
    return peak + pool


def config_run(name: str, layers: int, budget: int, hidden: int, ffn: int, iters: int,
               graphs: bool, device, *, profile_overlap: bool = True) -> tuple[str, dict]:
    """Measure one configuration of the benchmark on the CUDA ``device``: an
    :class:`ExpertStack` of ``layers`` bf16 layers on a ``[budget, hidden]`` buffer with half
    of its rows live, without stashing, with :func:`graphstash.stash_activations` and exact-size.

    Returns ``(name, figures)``; the figures (bytes, milliseconds) are those :func:`run`
    prints: ``peak_plain``, ``peak_stash`` (pool included), ``peak_exact``,
    ``peak_stash_after_release``, ``pool_bytes``, ``stashed_bytes``, ``time_plain_ms``,
    ``time_stash_ms``, ``time_exact_ms``, ``mallocs_in_timed_stash_steps``,
    ``steady_state_sync`` (None, or the host sync a steady-state stash step made), the copy
    overlap figures and, with ``graphs``, ``graph_plain_ms`` / ``graph_stash_ms``.
    ``iters``: timing samples; ``profile_overlap``: also trace the kernels (CUPTI). Example::

        name, figures = config_run("memory", 8, 4096, 1024, 4096, iters=3, graphs=False,
                                   device=torch.device("cuda"))
    """
    import graphstash

    gen = torch.Generator().manual_seed(0)
    model = ExpertStack(layers, hidden, ffn, dtype=torch.bfloat16, device=device, generator=gen)
    live = budget // 2
    x = make_inputs(1, budget, hidden, dtype=torch.bfloat16, device=device, generator=gen)[0]
    counts = [torch.tensor([live], dtype=torch.int32, device=device) for _ in range(layers)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    graphstash.warmup()
    manager = StashManager(StashConfig(), device=device)
    # Warmup sizing (NOTE [warmup sizing] in graphstash/stash/buffers.py): the first step
    # measures demand on the host, the buffers are sized from it, and further steps run the
    # steady state (schedule recorded, buffers fixed) that everything below measures.
    for _ in range(2):
        _step(model, x, counts, manager)
    manager.size_from_demand()
    for _ in range(2):
        _step(model, x, counts, manager)
    pools = _pool_state(manager)
    pool = sum(b for _, _, b in pools.values())
    res = {"layers": layers, "budget": budget, "live": live, "hidden": hidden, "ffn": ffn,
           "pool_bytes": pool,
           # bytes the pool must hold: the live rows of every group but the last (kept)
           "stashed_bytes": (layers - 1) * live * (hidden + 2 * ffn) * 2}
    # ---- memory: peak above the allocation before the step (NOTE [measuring peaks]) -------
    res["peak_plain"], res["left_plain"] = _peak(lambda: _step(model, x, counts), device)
    peak, res["left_stash"] = _peak(lambda: _step(model, x, counts, manager), device)
    if _pool_state(manager) != pools:
        raise AssertionError("the stash pool was (re)allocated during a steady-state step")
    res["peak_stash_above_pool"] = peak
    res["peak_stash"] = peak + pool        # the pool was allocated before the baseline
    res["peak_exact"], _ = _peak(lambda: model.forward_exact(x, [live] * layers).float()
                                 .square().mean().backward(), device)
    res["peak_stash_after_release"] = sized_peak(model, x, counts, device,
                                                  StashConfig(prefetch="after_release"))
    # ---- host syncs and allocations in the steady state ------------------------------------
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, x, counts, manager)
        res["steady_state_sync"] = None
    except RuntimeError as exc:
        res["steady_state_sync"] = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    # ---- step time, steady state -----------------------------------------------------------
    # Plain and stash steps alternate (NOTE [interleaved timing] in graph.py); neither may
    # cudaMalloc once warm, so the count over all timed steps is the stash steps' count.
    for _ in range(2):
        _step(model, x, counts, manager)
        _step(model, x, counts)
    torch.cuda.synchronize()
    mallocs = _mallocs(device)
    times = call_samples_interleaved({"plain": lambda: _step(model, x, counts),
                                      "stash": lambda: _step(model, x, counts, manager)},
                                     repeats=iters, inner=3, warmup=3)
    for key in ("plain", "stash"):
        res[f"time_{key}_ms_spread"] = spread(times[key])
        res[f"time_{key}_ms"] = res[f"time_{key}_ms_spread"]["median"]
    res["mallocs_in_timed_stash_steps"] = _mallocs(device) - mallocs
    if _pool_state(manager) != pools:
        raise AssertionError("the stash pool was (re)allocated during the timed steps")
    exact = call_samples_interleaved({"exact": lambda: model.forward_exact(x, [live] * layers)
                                      .float().square().mean().backward()}, repeats=iters,
                                     inner=3, warmup=3)["exact"]
    res["time_exact_ms_spread"] = spread(exact)
    res["time_exact_ms"] = res["time_exact_ms_spread"]["median"]
    # ---- overlap evidence --------------------------------------------------------------------
    # Event intervals: copies on the side streams against expert compute (forward, timed from
    # after the group's entry, so a wait for the previous stash is not counted as compute).
    model.compute_events = []
    base = torch.cuda.Event(enable_timing=True)
    base.record()
    with manager.trace(timing=True) as trace:
        _step(model, x, counts, manager)
    copies = trace.copy_intervals(base)
    computes = [(base.elapsed_time(s), base.elapsed_time(e)) for _, s, e in model.compute_events]
    model.compute_events = None
    res["copies"] = [(k, g, round(s, 3), round(e, 3)) for k, g, _, s, e in copies]
    res["copy_ms"] = sum(e - s for _, _, _, s, e in copies)
    res["copy_overlap_events"] = _overlap([(k, s, e) for k, _, _, s, e in copies], computes)
    res["copy_overlap"], res["overlap_method"] = res["copy_overlap_events"], "events"
    # Kernel trace: copy kernels against every other kernel, forward and backward.
    if profile_overlap:
        try:
            traced = _kernel_overlap(lambda: _step(model, x, counts, manager))
        except Exception as exc:          # no CUPTI: keep the event-based number
            res["overlap_trace_error"] = f"{type(exc).__name__}: {exc}"
            traced = None
        if traced is not None:
            res["copy_overlap"], res["copy_kernel_ms"] = traced
            res["overlap_method"] = "kernel trace"
    # ---- CUDA graphs -----------------------------------------------------------------------
    if graphs:
        try:
            graphs = {"plain": capture(lambda: _step(model, x, counts))}
            manager.clear_status()
            graphs["stash"] = capture(lambda: _step(model, x, counts, manager))
            times = replay_samples_interleaved(graphs, iters)
            for key in ("plain", "stash"):
                res[f"graph_{key}_ms_spread"] = spread(times[key])
                res[f"graph_{key}_ms"] = res[f"graph_{key}_ms_spread"]["median"]
            del graphs
            res["status_after"] = {k: v for k, v in manager.read_status().items()
                                   if k in ("overflow", "host_spill")}
        except Exception as exc:      # report it next to the eager numbers
            res["graph_error"] = f"{type(exc).__name__}: {exc}"
    manager.release()
    return name, res


def run(quick: bool = False, args=None, *, out: Output | None = None) -> dict:
    """Run the benchmark on the current CUDA device; print each configuration's row as soon as
    it is measured (a progress bar on stderr) and return the numbers (each median time with
    its ``*_spread`` beside it)."""
    if not torch.cuda.is_available():
        raise RuntimeError("graphstash bench stash: needs a CUDA GPU; torch sees none")
    out = Output() if out is None else out
    device = torch.device("cuda", torch.cuda.current_device())
    iters = 3 if quick else 10
    configs = [("memory", 8, 4096 if quick else 8192, 1024, 4096),
               ("compute-heavy", 8, 4096 if quick else 8192, 2048 if quick else 4096,
                8192 if quick else 16384)]
    results = {}
    mib = 1 / 2**20
    out.title(f"stash_activations on {torch.cuda.get_device_name(device)} (bf16, budget = 2 x "
              "live; peak MiB, then ms eager, then ms replayed from a CUDA graph)")
    table = out.table(COLUMNS)
    notes = []
    with progress.bar(len(configs), "bench stash", unit="config") as bar:
        for name, layers, budget, hidden, ffn in configs:
            key, r = config_run(name, layers, budget, hidden, ffn, iters, True, device)
            results[key] = r
            torch.cuda.empty_cache()
            table.row([name, r["layers"], r["budget"], r["hidden"], r["ffn"],
                       r["peak_plain"] * mib, r["peak_stash"] * mib,
                       r["peak_stash"] / r["peak_plain"], r["peak_exact"] * mib,
                       r["time_plain_ms"], r["time_stash_ms"],
                       r["time_stash_ms"] / r["time_plain_ms"], r["time_exact_ms"],
                       r.get("graph_plain_ms"), r.get("graph_stash_ms"), r["copy_ms"],
                       f"{r['copy_overlap']:.1%}"])
            bar.update()
            if r.get("steady_state_sync"):
                notes.append(f"{name}: host sync in a steady-state stash step: "
                             f"{r['steady_state_sync']}")
            if "graph_error" in r:
                notes.append(f"{name}: graph capture failed: {r['graph_error']}")
            notes.append(f"{name}: peak with StashConfig(prefetch='after_release') "
                         f"{r['peak_stash_after_release'] * mib:.1f} MiB, ratio "
                         f"{r['peak_stash_after_release'] / r['peak_plain']:.3f}")
    for line in notes:
        out.note(line)
    out.note("peak: max allocated during one fwd+bwd above the memory before it (stash: plus "
             "its pool); overlap: share of stash/reload kernel time beside another kernel "
             "(kernel trace; else beside a forward expert-compute interval)")
    return results
