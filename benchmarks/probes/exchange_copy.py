"""Copy speed of the exchange's kernels against torch copying the same rows, in the same run.

For each case, ``live`` rows of ``row_bytes`` bytes (out of a ``rows``-row token buffer, picked
by a random map as a dispatch picks them) are moved on one GPU:

- ``push``: ``gs_xchg_push_v16`` gathers them by token index and writes them into the regions
  of two ranks (in-process transports: half the rows each), as a dispatch does; ``push+w``
  the same launch also moving each row's router weight (bf16), as the dispatch runs it;
- ``copy_out``: graphstash's gather kernel copies a region's live rows into a permuted buffer
  (zeros past them), as the receiver does;
- torch: ``dst[:n].copy_(src[:n])`` (a contiguous copy of the same bytes: the bar the stash
  kernels are held to), ``torch.index_select(src, 0, index, out=dst[:n])`` (the same
  gather) and, for ``copy_out``, the same gather followed by zeros past the live rows.

Bandwidth counts bytes read plus bytes written of the live rows. Times are medians over
``--reps`` CUDA-event timings of a graph of ``--inner`` launches. Prints a table; ``--json``
writes it. ``--variants`` also times the 16-byte push compiled with other ``GS_XCHG_UNROLL``
and ``GS_XCHG_MIN_BLOCKS`` (CuPy directly: a tuning run, not the library's launcher).

    python benchmarks/probes/exchange_copy.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from graphstash.moe.exchange import layout as X  # noqa: E402

CASES = [  # (live rows, token rows, row bytes): Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek widths
    (45875, 65536, 4096),
    (11468, 16384, 8192),
    (11468, 16384, 14336),
]


def _median_ms(fn, reps: int, inner: int) -> float:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph.capture_begin()
        for _ in range(inner):
            fn()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def run_case(live: int, rows: int, row_bytes: int, reps: int, inner: int) -> dict:
    from graphstash._kernels import moe as moe_ops
    from graphstash.moe.exchange import build_local_transports

    device = torch.device("cuda", 0)
    dtype = torch.bfloat16
    width = row_bytes // 2
    gen = torch.Generator(device=device).manual_seed(live + row_bytes)
    transports = build_local_transports(2, capacity_rows=rows, row_bytes=row_bytes,
                                        max_experts=8, device=device)
    t0 = transports[0]
    src = torch.randn(rows, width, device=device, generator=gen).to(dtype)
    token = torch.randperm(rows, device=device, generator=gen)[:live].to(torch.int32)
    peer = (torch.arange(live, device=device) % 2).to(torch.int32)
    dest = (torch.arange(live, device=device) // 2).to(torch.int32)
    count = torch.tensor([live], dtype=torch.int32, device=device)
    field = X.XF_ROWS
    received = t0.field_view(field, dtype, width, rows)
    weights = torch.rand(rows, device=device, generator=gen).to(dtype)
    out = torch.empty(rows, width, dtype=dtype, device=device)
    back = torch.full((rows,), -1, dtype=torch.int32, device=device)
    back[:live] = torch.arange(live, dtype=torch.int32, device=device)
    dst = torch.empty(rows, width, dtype=dtype, device=device)

    def push():
        t0.push(field, src, token, peer, dest, count, 0, rows)

    def push_w():
        t0.push(field, src, token, peer, dest, count, 0, rows, weights=weights,
                weights_index=token)

    def copy_out():
        moe_ops.gather_rows(out, received, back)

    def torch_copy():
        dst[:live].copy_(src[:live])

    index = token.long()
    back_live = back[:live].long()

    def torch_gather():
        torch.index_select(src, 0, index, out=dst[:live])

    def torch_copy_out():                  # copy_out's work in torch: the gather, then zeros
        torch.index_select(received, 0, back_live, out=out[:live])
        out[live:].zero_()

    moved = 2 * live * row_bytes
    ms = {name: _median_ms(fn, reps, inner) for name, fn in
          (("push", push), ("push_w", push_w), ("copy_out", copy_out), ("torch_copy", torch_copy),
           ("torch_index_select", torch_gather), ("torch_copy_out", torch_copy_out))}
    t0.check()
    gbps = {f"{k}_GBps": moved / (v * 1e-3) / 1e9 for k, v in ms.items()}
    # copy_out also writes zeros past the live rows: its bytes are counted as the live ones
    result = {"live": live, "rows": rows, "row_bytes": row_bytes, **{f"{k}_ms": v for k, v in
                                                                      ms.items()}, **gbps}
    result["push_vs_copy"] = ms["torch_copy"] / ms["push"]
    result["push_w_vs_copy"] = ms["torch_copy"] / ms["push_w"]
    result["push_vs_index_select"] = ms["torch_index_select"] / ms["push"]
    result["copy_out_vs_copy"] = ms["torch_copy"] / ms["copy_out"]
    result["copy_out_vs_torch_copy_out"] = ms["torch_copy_out"] / ms["copy_out"]
    for t in transports:
        t.close()
    return result


def variants(live: int, rows: int, row_bytes: int, reps: int, inner: int) -> list[dict]:
    """The 16-byte push compiled with other unroll / min-blocks values, same arguments."""
    import warnings

    import cupy
    import numpy as np

    warnings.filterwarnings("ignore", category=DeprecationWarning)   # cupy's ExternalStream
    from graphstash import _kernels as K
    from graphstash._kernels.exchange import lanes_per_row
    from graphstash.moe.exchange import build_local_transports
    from raw_kernels import source_path

    device = torch.device("cuda", 0)
    width = row_bytes // 2
    gen = torch.Generator(device=device).manual_seed(7)
    transports = build_local_transports(2, capacity_rows=rows, row_bytes=row_bytes,
                                        max_experts=8, device=device)
    t0 = transports[0]
    src = torch.randn(rows, width, device=device, generator=gen).to(torch.bfloat16)
    token = torch.randperm(rows, device=device, generator=gen)[:live].to(torch.int32)
    peer = (torch.arange(live, device=device) % 2).to(torch.int32)
    dest = (torch.arange(live, device=device) // 2).to(torch.int32)
    count = torch.tensor([live], dtype=torch.int32, device=device)
    dst = torch.empty(rows, width, dtype=torch.bfloat16, device=device)
    base = _median_ms(lambda: dst[:live].copy_(src[:live]), reps, inner)
    vec = row_bytes // 16
    out = []
    for unroll in (2, 4, 8):
        for min_blocks in (1, 2):
            opts = tuple(o for o in K.compile_options() if not o.startswith("-DGS_XCHG_")) + (
                                          f"-DGS_XCHG_UNROLL={unroll}",
                                          f"-DGS_XCHG_MIN_BLOCKS={min_blocks}")
            fn = cupy.RawModule(code=source_path("moe_exchange.cu").read_text(),
                                options=opts).get_function("gs_xchg_push_v16")
            lanes = lanes_per_row(-(-vec // unroll))
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            per_sm = max(1, min(65536 // (max(fn.num_regs, 1) * K.THREADS), 2048 // K.THREADS))
            grid = (max(1, min(-(-live * lanes // K.THREADS), per_sm * sms)), 1, 1)
            args = (K.ptr(t0.table), K.ptr(t0.state), np.int32(2), np.int32(0),
                    np.int32(X.XF_ROWS), K.ptr(src), np.int32(rows), K.ptr(token), K.ptr(peer),
                    K.ptr(dest), K.ptr(count), np.int32(live), np.int32(vec),
                    np.int32(lanes.bit_length() - 1), np.int32(0), np.int32(rows),
                    np.int32(rows), np.int32(X.XF_WEIGHTS), np.uint64(0), np.int32(0),
                    np.uint64(0), np.int32(0))

            def push():
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    fn(grid, (K.THREADS, 1, 1), args)

            ms = _median_ms(push, reps, inner)
            out.append({"unroll": unroll, "min_blocks": min_blocks, "regs": fn.num_regs,
                        "grid": grid[0], "ms": ms, "vs_copy": base / ms,
                        "GBps": 2 * live * row_bytes / (ms * 1e-3) / 1e9})
    for t in transports:
        t.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--variants", action="store_true")
    args = parser.parse_args()
    results = [run_case(*case, args.reps, args.inner) for case in CASES]
    print(f"\nexchange copy kernels vs torch on {torch.cuda.get_device_name(0)} "
          f"(GB/s of live bytes read + written; ratio = torch time / ours)")
    print(f"{'live':>7s} {'row B':>6s} {'push':>8s} {'push+w':>8s} {'copy_out':>8s} "
          f"{'copy_':>8s} {'idx_sel':>8s} {'push/copy_':>10s} {'push+w/copy_':>12s} "
          f"{'push/idx':>9s} {'out/copy_':>9s} {'out/torch':>9s}")
    for r in results:
        print(f"{r['live']:7d} {r['row_bytes']:6d} {r['push_GBps']:8.0f} "
              f"{r['push_w_GBps']:8.0f} {r['copy_out_GBps']:8.0f} {r['torch_copy_GBps']:8.0f} "
              f"{r['torch_index_select_GBps']:8.0f} {r['push_vs_copy']:10.3f} "
              f"{r['push_w_vs_copy']:12.3f} {r['push_vs_index_select']:9.3f} "
              f"{r['copy_out_vs_copy']:9.3f} {r['copy_out_vs_torch_copy_out']:9.3f}")
    print("push/idx: against index_select of the same rows (torch's copy of them); out/torch: "
          "against torch doing copy_out's work (the same gather, then zeros past the live rows)")
    tuned = []
    if args.variants:
        for live, rows, row_bytes in CASES:
            tuned += [dict(v, row_bytes=row_bytes) for v in
                      variants(live, rows, row_bytes, args.reps, args.inner)]
        print(f"\n{'row B':>6s} {'unroll':>6s} {'minblk':>6s} {'regs':>5s} {'grid':>5s} "
              f"{'GB/s':>7s} {'vs copy_':>8s}")
        for v in tuned:
            print(f"{v['row_bytes']:6d} {v['unroll']:6d} {v['min_blocks']:6d} {v['regs']:5d} "
                  f"{v['grid']:5d} {v['GBps']:7.0f} {v['vs_copy']:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "results": results,
                       "variants": tuned}, f, indent=1)


if __name__ == "__main__":
    main()
