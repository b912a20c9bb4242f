"""``graphstash bench graph``: graph_step against the eager loop, launch-bound and
compute-bound.

Each configuration times, in the same run: the eager loop (``zero_grad``, forward, backward,
``optimizer.step()``), the decorated step (staging, replay, status read), and bare
``CUDAGraph.replay()`` of the same graph; the difference between the last two is the per-step
cost of staging the inputs and reading the status. ``status_read_us`` is the host time of
reading the status when the GPU is already idle (event query and the pinned read).
"""
from __future__ import annotations

import time

import torch

from ...graph import graph_step
from ...tables import Column
from .. import progress
from ..output import Output
from .spread import range_text, spread

SUMMARY = "graph_step against the eager loop, launch-bound and compute-bound"
DESCRIPTION = ("Times, in alternating rounds of the same run, the eager training loop, the step "
               "decorated by graph_step (staging, replay, status read) and the bare replay of "
               "its graph, on a launch-bound and a compute-bound model; prints the times, the "
               "speed-up, the per-step overhead and the capture time.")
COLUMNS = (Column("config", width=14), Column("eager ms", ".3f", width=8),
           Column("graph ms", ".3f", width=8), Column("min-max ms", width=13, align="right"),
           Column("replay ms", ".3f", width=9), Column("speedup", ".2f", width=7),
           Column("overhead us", ".1f", width=11), Column("status us", ".1f", width=9),
           Column("capture ms", ".1f", width=10))

CONFIGS = {
    # many small layers: the eager step is bound by kernel launches
    "launch_bound": dict(width=256, depth=48, batch=64, dtype=torch.float32),
    # a few large matmuls: the step is bound by compute
    "compute_bound": dict(width=8192, depth=4, batch=8192, dtype=torch.bfloat16),
}


def _model(width, depth, dtype):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(device="cuda", dtype=dtype)


def _time(fn, iters):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _run_config(width, depth, batch, dtype, iters):
    torch.manual_seed(0)
    x = torch.randn(batch, width, device="cuda", dtype=dtype)
    y = torch.randn(batch, width, device="cuda", dtype=dtype)
    model = _model(width, depth, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)

    def eager():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    @graph_step(optimizer=opt, warmup=2, outputs="static")
    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        eager()
    for _ in range(4):
        train_step(x, y)                      # warmup, capture, replay
    graph = train_step.captured_graphs()[0].graph
    # NOTE [interleaved timing]: eager, decorated step and bare replay are timed in alternating
    # rounds and the median round is kept, so clock or thermal drift over the run (large on a
    # compute-bound step) does not favour whichever was measured first.
    rounds = 5
    per_round = max(1, iters // rounds)
    samples = {"eager": [], "step": [], "replay": []}
    for _ in range(rounds):
        samples["eager"].append(_time(eager, per_round))
        samples["step"].append(_time(lambda: train_step(x, y), per_round))
        samples["replay"].append(_time(graph.replay, per_round))
    spreads = {k: spread(1e3 * t for t in samples[k]) for k in ("eager", "step", "replay")}
    t_eager, t_step, t_replay = (spreads[k]["median"] / 1e3 for k in ("eager", "step", "replay"))
    torch.cuda.synchronize()
    reads = 200
    t0 = time.perf_counter()
    for _ in range(reads):
        train_step.read_flags()       # what a replay does after launching its graph
    status_read_us = 1e6 * (time.perf_counter() - t0) / reads

    st = train_step.stats
    train_step.release()
    return {
        "eager_ms": 1e3 * t_eager,
        "eager_ms_spread": spreads["eager"],
        "graph_step_ms": 1e3 * t_step,
        "graph_step_ms_spread": spreads["step"],
        "bare_replay_ms": 1e3 * t_replay,
        "bare_replay_ms_spread": spreads["replay"],
        "speedup": t_eager / t_step,
        "step_overhead_us": 1e6 * (t_step - t_replay),
        "status_read_us": status_read_us,
        "capture_ms": st.capture_ms,
        "peak_memory_mib": st.peak_memory_bytes / 2 ** 20,
    }


def run(quick: bool = False, args=None, *, out: Output | None = None) -> dict:
    """Time eager vs replayed training steps; print each configuration's row as soon as it is
    measured (a progress bar on stderr) and return the numbers.

    Returns ``{config: {"eager_ms", "graph_step_ms", "bare_replay_ms", "speedup",
    "step_overhead_us", "status_read_us", "capture_ms", "peak_memory_mib"}}``, each median
    time with its ``*_spread`` beside it (the rounds' per-step times).

    Example::

        from graphstash.tools.bench import graph
        results = graph.run(quick=True)
        assert results["launch_bound"]["speedup"] >= 2.5
    """
    if not torch.cuda.is_available():
        raise RuntimeError("graphstash.tools.bench.graph: needs a CUDA GPU; none is visible")
    out = Output() if out is None else out
    iters = 20 if quick else 100
    results = {}
    out.title(f"graph_step against the eager loop on {torch.cuda.get_device_name()}")
    table = out.table(COLUMNS)
    with progress.bar(len(CONFIGS), "bench graph", unit="config") as bar:
        for name, cfg in CONFIGS.items():
            if quick and name == "compute_bound":
                cfg = dict(cfg, width=4096, batch=4096)
            r = results[name] = _run_config(
                iters=iters if name == "launch_bound" else max(5, iters // 5), **cfg)
            table.row([name, r["eager_ms"], r["graph_step_ms"],
                       range_text(r["graph_step_ms_spread"], ".3f"), r["bare_replay_ms"],
                       r["speedup"], r["step_overhead_us"], r["status_read_us"],
                       r["capture_ms"]])
            bar.update()
    out.note("graph ms: the decorated step (staging, replay, status read), min-max over the "
             "rounds; overhead: it less the bare replay")
    return results
