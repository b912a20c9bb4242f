"""Expert parallelism on one GPU: W in-process ranks of ``MoEModel`` exchanging live rows.

Each rank is a host thread with its own CUDA stream and in-process transport (NOTE [in-process
ranks] in ``graphstash/moe/exchange/local.py``): it holds ``E / W`` experts of a preset's
layers, warms up eagerly, captures forward + backward + AdamW in one CUDA graph (captures one
at a time, no device-wide sync) and replays it; the step's flags are summed over the ranks by
the transport inside the graph. Reported per step: the slowest rank's replay time, and the
bytes the ranks wrote into the regions, counted on the device (rows and router weights, then
counts, flags and signals; tests/test_exchange_gpu.py checks that the row bytes are the live
rows x row bytes). Beside it, in the same run, the one-device model with all experts and
``W x tokens`` tokens, captured the same way. The replicated router and norm are not
all-reduced across the ranks (no data-parallel step): this measures the exchange and the
experts.

    python benchmarks/probes/exchange_ep_step.py --ep 2 --preset qwen3-30b-a3b --layers 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from graphstash import _layout as L  # noqa: E402
from graphstash.models.moe import MoEModel, preset  # noqa: E402
from graphstash.moe import budget_rows  # noqa: E402


def _say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _batch(config, rank: int, step: int, device):
    gen = torch.Generator(device=device).manual_seed(1000 * step + rank)
    x = torch.randn(config.num_tokens, config.hidden, device=device, generator=gen)
    return x.to(torch.bfloat16)


def _captured(model, opt, transport, x, device):
    """A CUDA graph of fwd + bwd + AdamW (+ the flags through the transport), captured on a
    side stream with capture_begin (no device-wide sync)."""
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    model.status = status
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        loss = model(x).float().pow(2).mean()
        loss.backward()
        if transport is not None:
            transport.all_reduce_flags_(status[L.SS_OVERFLOW:L.SS_OVER_BUDGET + 1])
        opt.step()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, status


def _eager(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


def _time_replays(graph, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def run(args) -> dict:
    from graphstash.moe.exchange import build_local_transports

    import graphstash

    device = torch.device("cuda", 0)
    W = args.ep
    graphstash.warmup()                  # every kernel compiled before the rank threads start
    config = preset(args.preset, layers=args.layers, num_tokens=args.tokens,
                    capacity_factor=args.capacity_factor)
    budget = budget_rows(config.num_tokens * W, config.topk, config.num_experts,
                         capacity_factor=config.capacity_factor, world_size=W)
    # one device, all experts, W x tokens: the eager warmup also probes the expert GEMMs
    one = preset(args.preset, layers=args.layers, num_tokens=args.tokens * W, capacity_factor=1.0)
    model = MoEModel(one, mode="budget", seed=0, device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=True)
    x = torch.cat([_batch(config, r, 0, device) for r in range(W)])
    for _ in range(2):
        _eager(model, opt, x)
    graph, _ = _captured(model, opt, None, x, device)
    one_ms = statistics.median(_time_replays(graph, args.steps))
    _say(f"one device: {one_ms:.2f} ms per step")
    del graph, model, opt
    torch.cuda.empty_cache()

    transports = build_local_transports(W, capacity_rows=max(budget, config.num_tokens * config.topk),
                                        row_bytes=config.hidden * 2,
                                        max_experts=config.num_experts, device=device)
    lock, captured, done = threading.Lock(), threading.Barrier(W), threading.Barrier(W)
    results, errors = [None] * W, [None] * W

    def rank_main(rank):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                t = transports[rank]
                m = MoEModel(config, mode="budget", exchange=t, seed=0, device=device,
                             dtype=torch.bfloat16)
                o = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True, capturable=True)
                xr = _batch(config, rank, 0, device)
                for _ in range(2):
                    _eager(m, o, xr)
                torch.cuda.current_stream().synchronize()
                _say(f"rank {rank}: eager warmup done")
                with lock:
                    g, status = _captured(m, o, t, xr, device)
                _say(f"rank {rank}: captured")
                captured.wait()
                g.replay()
                torch.cuda.current_stream().synchronize()
                t.reset_counters()
                times = _time_replays(g, args.steps)
                done.wait()
                counters = t.counters()
                t.check()
                results[rank] = {"ms": times, "counters": counters,
                                 "flags": status[:3].tolist(), "budget": budget}
        except BaseException as exc:
            errors[rank] = exc
            captured.abort()
            done.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise RuntimeError(f"rank {rank} failed") from exc
    step_ms = statistics.median(max(r["ms"][i] for r in results) for i in range(args.steps))
    per_step = {k: sum(r["counters"][k] for r in results) / args.steps
                for k in ("row_bytes_remote", "row_bytes_local", "meta_bytes", "rows_sent")}
    return {"preset": args.preset, "layers": args.layers, "tokens_per_rank": args.tokens,
            "ep": W, "capacity_factor": args.capacity_factor, "budget_rows": budget,
            "ep_step_ms": step_ms, "one_device_step_ms": one_ms,
            "bytes_per_step": per_step, "flags": [r["flags"] for r in results],
            "device": torch.cuda.get_device_name(0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--capacity-factor", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    r = run(args)
    b = r["bytes_per_step"]
    live = b["row_bytes_remote"] + b["row_bytes_local"]
    print(f"\n{r['preset']}, {r['layers']} layers, {r['tokens_per_rank']} tokens per rank, "
          f"EP {r['ep']} in one process on {r['device']}, capacity factor "
          f"{r['capacity_factor']}")
    print(f"step (graph, slowest rank):  {r['ep_step_ms']:.2f} ms   one device, all experts, "
          f"same tokens: {r['one_device_step_ms']:.2f} ms")
    print(f"bytes written into regions per step (all ranks): rows + weights {live / 2**20:.1f} "
          f"MiB (other ranks {b['row_bytes_remote'] / 2**20:.1f} MiB), counts/flags/signals "
          f"{b['meta_bytes'] / 2**10:.1f} KiB, rows {b['rows_sent']:.0f}; flags {r['flags']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
