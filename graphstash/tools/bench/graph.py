"""``graphstash bench graph``: graph_step against the eager loop, launch-bound and
compute-bound.

Each configuration times, in the same run: the eager loop (``zero_grad``, forward, backward,
``optimizer.step()``), the decorated step (staging, replay, status read), and bare
``CUDAGraph.replay()`` of the same graph; the difference between the last two is the per-step
cost of staging the inputs and reading the status. ``status_read_us`` is the host time of
reading the status when the GPU is already idle (event query and the pinned read).
"""
from __future__ import annotations

import statistics
import time

import torch

from ...graph import graph_step

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
    t_eager, t_step, t_replay = (statistics.median(samples[k]) for k in ("eager", "step", "replay"))
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
        "graph_step_ms": 1e3 * t_step,
        "bare_replay_ms": 1e3 * t_replay,
        "speedup": t_eager / t_step,
        "step_overhead_us": 1e6 * (t_step - t_replay),
        "status_read_us": status_read_us,
        "capture_ms": st.capture_ms,
        "peak_memory_mib": st.peak_memory_bytes / 2 ** 20,
    }


def run(quick: bool = False) -> dict:
    """Time eager vs replayed training steps; print a table and return the numbers.

    Returns ``{config: {"eager_ms", "graph_step_ms", "bare_replay_ms", "speedup",
    "step_overhead_us", "status_read_us", "capture_ms", "peak_memory_mib"}}``.

    Example::

        from graphstash.tools.bench import graph
        results = graph.run(quick=True)
        assert results["launch_bound"]["speedup"] >= 2.5
    """
    if not torch.cuda.is_available():
        raise RuntimeError("graphstash.tools.bench.graph: needs a CUDA GPU; none is visible")
    iters = 20 if quick else 100
    results = {}
    for name, cfg in CONFIGS.items():
        if quick and name == "compute_bound":
            cfg = dict(cfg, width=4096, batch=4096)
        results[name] = _run_config(iters=iters if name == "launch_bound" else max(5, iters // 5),
                                    **cfg)
    header = (f"{'config':<14} {'eager ms':>9} {'graph ms':>9} {'replay ms':>10} {'speedup':>8} "
              f"{'overhead us':>12} {'status us':>10} {'capture ms':>11}")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<14} {r['eager_ms']:>9.3f} {r['graph_step_ms']:>9.3f} "
              f"{r['bare_replay_ms']:>10.3f} {r['speedup']:>7.2f}x {r['step_overhead_us']:>12.1f} "
              f"{r['status_read_us']:>10.1f} {r['capture_ms']:>11.1f}")
    return results
