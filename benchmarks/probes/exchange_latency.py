"""Can ranks that share one GPU spin-wait on each other at a usable speed?

Measures the exchange's barrier (``gs_xchg_barrier``: raise a signal at every rank, spin until
every rank's arrived) and one push round (copy ``rows`` live rows of ``row_bytes`` into the
other rank's region, then a barrier) for W ranks on one GPU:

- ``ipc``: W processes, CUDA IPC transport (the GPU time-slices between processes);
- ``threads``: W threads of one process, in-process transports, one stream each;
- ``single``: one rank alone (a barrier with itself: the floor of a launch + a poll).

Eager: ``n`` launches back to back, then a sync; graphed: the same ``n`` captured in one CUDA
graph per rank and replayed. Prints one table (microseconds per barrier / per round, and the
round's bandwidth) and writes JSON next to it with ``--json``.

    python benchmarks/probes/exchange_latency.py --world 2 --n 200
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from graphstash.moe.exchange import layout as X  # noqa: E402


def _workload(transport, rows: int, row_bytes: int, device):
    src = torch.randn(rows, row_bytes // 4, device=device)
    W = transport.world_size
    peer = torch.full((rows,), (transport.rank + 1) % W, dtype=torch.int32, device=device)
    dest = torch.arange(rows, dtype=torch.int32, device=device)
    count = torch.tensor([rows], dtype=torch.int32, device=device)

    def barrier():
        transport.barrier()

    def round_():
        transport.push(X.XF_ROWS, src, None, peer, dest, count, 0, rows)
        transport.barrier()

    return barrier, round_


def _time(fn, n: int, graphed: bool, align) -> float:
    """Seconds per call of ``fn`` over ``n`` calls (eager, or one graph of n calls)."""
    if graphed:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            for _ in range(n):
                fn()
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        align()
        graph.replay()                      # warm
        torch.cuda.current_stream().synchronize()
        align()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.current_stream().synchronize()
        return (time.perf_counter() - t0) / n
    for _ in range(5):
        fn()
    torch.cuda.current_stream().synchronize()
    align()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.current_stream().synchronize()
    return (time.perf_counter() - t0) / n


def _measure(transport, args, align) -> dict:
    device = transport.device
    barrier, round_ = _workload(transport, args.rows, args.row_bytes, device)
    out = {}
    for graphed in (False, True):
        tag = "graph" if graphed else "eager"
        out[f"barrier_{tag}_us"] = 1e6 * _time(barrier, args.n, graphed, align)
        out[f"round_{tag}_us"] = 1e6 * _time(round_, max(1, args.n // 4), graphed, align)
    transport.check()
    out["round_GBps"] = args.rows * args.row_bytes / (out["round_graph_us"] * 1e-6) / 1e9
    return out


def _ipc_rank(rank: int, world: int, store: str, args, path: str) -> None:
    import torch.distributed as dist

    from graphstash.moe.exchange import build_ipc_transport

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    transport = build_ipc_transport(capacity_rows=args.rows, row_bytes=args.row_bytes,
                                    max_experts=8, device="cuda:0", timeout_s=60.0)
    result = _measure(transport, args, lambda: dist.barrier())
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    transport.close()
    dist.destroy_process_group()


def run_ipc(args) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_ipc_rank, args=(args.world, os.path.join(tmp, "store"), args, path),
                 nprocs=args.world, join=True)
        with open(path) as f:
            return json.load(f)


def run_threads(args) -> dict:
    from graphstash.moe.exchange import build_local_transports

    transports = build_local_transports(args.world, capacity_rows=args.rows,
                                        row_bytes=args.row_bytes, max_experts=8,
                                        device="cuda:0", timeout_s=60.0)
    meet = threading.Barrier(args.world)
    results, errors = [None] * args.world, [None] * args.world

    def run(rank):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                results[rank] = _measure(transports[rank], args, meet.wait)
        except BaseException as exc:
            errors[rank] = exc
            meet.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(args.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results[0]


def run_single(args) -> dict:
    from graphstash.moe.exchange import build_local_transports

    (transport,) = build_local_transports(1, capacity_rows=args.rows, row_bytes=args.row_bytes,
                                          max_experts=8, device="cuda:0")
    return _measure(transport, args, lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--row-bytes", type=int, default=4096)
    parser.add_argument("--modes", default="single,threads,ipc")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        try:
            rows[mode] = {"single": run_single, "threads": run_threads, "ipc": run_ipc}[mode](args)
        except Exception as exc:           # a mode that fails is a finding, not the end
            rows[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        rows[mode]["wall_s"] = time.perf_counter() - t0
    print(f"\nexchange latency on {torch.cuda.get_device_name(0)}, world={args.world}, "
          f"round = {args.rows} rows x {args.row_bytes} B")
    cols = ["barrier_eager_us", "barrier_graph_us", "round_eager_us", "round_graph_us",
            "round_GBps", "wall_s"]
    print(f"{'mode':8s} " + " ".join(f"{c:>17s}" for c in cols))
    for mode, r in rows.items():
        if "error" in r:
            print(f"{mode:8s} {r['error']}")
            continue
        print(f"{mode:8s} " + " ".join(f"{r[c]:17.1f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "rows": args.rows, "row_bytes": args.row_bytes,
                       "device": torch.cuda.get_device_name(0), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
