"""Bandwidth of the live-row exchange between the GPUs of one host, beside the ceiling and the
peers, all in one run.

Under torchrun, one rank per GPU. For each case (row bytes, rows each rank sends, balanced or
skewed counts) every method moves the same rows:

- ``ceiling``: each rank copies as many contiguous bytes as it sends to the other ranks into
  the next rank's torch symmetric-memory buffer (``Tensor.copy_`` into the peer's mapped
  memory): the most a plain copy gets over the links here;
- ``push``: graphstash's transport push (``gs_xchg_push_v*``: rows gathered by token index and
  written straight into the receivers' regions), then its barrier, as a dispatch runs it;
  ``push@N`` the same with at most ``N`` thread blocks (``Transport.push_blocks``; one block
  per multiprocessor), for each ``N`` of ``--push-blocks``; every push's received rows are
  compared with the first push's (``<method>_matches``);
- ``vpush@N``, ``vpull@N``, ``bpush@N``, ``bpull@N`` (with ``--raw``): the ceiling's contiguous
  bytes moved by ``N`` blocks of the probes' copy kernels (``_copy_kernels.py``): 16-byte
  vectors (``v``) or bulk copies through shared memory (``b``), written into the next rank's
  buffer (``push``) or read from the previous rank's into this one's (``pull``): what a few
  multiprocessors move over the links each way, without the exchange's gather;
- ``copy_out``: the receiver's gather of the rows it received out of its own region into the
  permuted buffer (local: the half of a dispatch that does not cross a link);
- ``nccl``: ``all_to_all_single`` of the same rows with their split sizes;
- ``all_gather``, ``reduce_scatter``: NCCL's ``all_gather_into_tensor`` of a rank's ``rows``
  rows (every rank's rows to every rank) and ``reduce_scatter_tensor`` back, what the gathered
  tokens run (NOTE [gathered tokens] in ``graphstash/moe/exchange/gathered.py``); their GB/s
  count the ``rows x (W - 1)`` rows each rank sends, the bytes of ``--counts remote`` at two
  ranks;
- ``vdev`` (``--methods vdev`` alone: it needs the NVSHMEM backend, the others the CUDA one):
  torch symmetric memory's ``all_to_all_vdev``, or the error that stops it.

With ``--beside-gemm``, for each ``N`` of ``--push-blocks`` and the first row width, the most
rows and balanced counts: a chain of ``--gemms`` grouped GEMMs (``torch._grouped_mm``,
``[rows, hidden] x [experts, hidden, 2 x ffn]`` bf16, the first expert GEMM of a layer) alone,
the same chain captured under ``torch._C._set_sm_carveout_experimental(N)`` (the GEMM leaves
``N`` multiprocessors), the push on ``N`` blocks alone, and the carved chain and the push
forked onto two streams in one graph: ``hidden`` is the share of the push's time that
disappears beside the chain, ``(carved + push - both) / push``, and ``both / apart`` the forked
time over the uncarved chain and the push one after the other (below 1: the overlap pays).

Each method is captured in a CUDA graph of ``--inner`` calls (``vdev``: ``--inner`` eager calls)
and replayed ``--reps`` times after a barrier; a rep's time is the slowest rank's. GB/s: the
bytes a rank sends to other ranks (the largest over the ranks) over that time; ``copy_out``
counts the bytes it reads. SMs: the largest grid among the method's kernels in one profiled
call (torch.profiler's trace), capped at the device's multiprocessors.

    torchrun --nproc-per-node 2 benchmarks/probes/exchange_bandwidth.py --json bw.json
    torchrun --nproc-per-node 2 benchmarks/probes/exchange_bandwidth.py --methods vdev
    torchrun --nproc-per-node 4 benchmarks/probes/exchange_bandwidth.py --rows 65536 \
        --row-bytes 4096 --methods ceiling,push --beside-gemm --experts 32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from graphstash.moe.exchange import layout as X  # noqa: E402

ROW_BYTES = (4096, 8192, 16384, 28672)
ROWS = (1024, 8192, 65536)
COUNTS = ("balanced", "skewed", "remote")
METHODS = ("ceiling", "push", "copy_out", "nccl", "all_gather", "reduce_scatter")
RAW = ("vpush", "vpull", "bpush", "bpull")
SKEW = 3.0              # skewed: rank 0 receives SKEW times the rows of any other rank


def dest_counts(rows: int, world: int, counts: str, rank: int = 0) -> list[int]:
    """Rows ``rank`` sends to each rank (itself included): even (``balanced``), rank 0
    favoured (``skewed``), or even over the other ranks and none to itself (``remote``: every
    row crosses a link)."""
    if counts == "remote":
        weights = [0.0 if r == rank else 1.0 for r in range(world)]
    else:
        weights = [SKEW if counts == "skewed" and r == 0 else 1.0 for r in range(world)]
    out = [int(rows * w / sum(weights)) for w in weights]
    last = max(r for r in range(world) if weights[r] > 0)     # the remainder goes to it
    out[last] += rows - sum(out)
    return out


def _graph_ms(fn, reps: int, inner: int, group, graphed: bool = True) -> float:
    """Median over ``reps`` of the slowest rank's ms per call of ``fn``: a CUDA graph of
    ``inner`` calls, or ``inner`` eager calls (``graphed=False``)."""
    import torch.distributed as dist

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = None
    with torch.cuda.stream(stream):
        fn()                                         # warm: any lazy set-up outside capture
        torch.cuda.synchronize()
        dist.barrier(group=group)
        if graphed:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(inner):
                    fn()
    torch.cuda.current_stream().wait_stream(stream)
    run = graph.replay if graph is not None else (lambda: [fn() for _ in range(inner)])
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end) / inner], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(float(t))
    return statistics.median(times)


def _sms(fn) -> int:
    """The largest grid among the kernels one call of ``fn`` launches, capped at the SMs."""
    from torch.profiler import ProfilerActivity, profile

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    grids = [e["args"]["grid"] for e in events
             if e.get("cat") == "kernel" and "grid" in e.get("args", {})]
    blocks = max((g[0] * g[1] * g[2] for g in grids), default=0)
    return min(blocks, sms)


def run_case(row_bytes: int, rows: int, counts: str, methods, transport, group, reps: int,
             inner: int) -> dict:
    import torch.distributed as dist

    from graphstash._kernels import moe as moe_ops

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device())
    width = row_bytes // 2
    per_dest = dest_counts(rows, world, counts, rank)
    gen = torch.Generator(device=device).manual_seed(rank * 7919 + rows + row_bytes)
    src = torch.randn(rows, width, device=device, generator=gen).to(torch.bfloat16)
    token = torch.randperm(rows, device=device, generator=gen).to(torch.int32)
    peer = torch.repeat_interleave(torch.arange(world, device=device, dtype=torch.int32),
                                   torch.tensor(per_dest, device=device))
    # every sender's rows for a receiver go to rows after those of the ranks before it
    table = torch.tensor([dest_counts(rows, world, counts, r) for r in range(world)])
    offset = table[:rank].sum(0)                  # rows that lower ranks put in each receiver
    start = torch.cumsum(torch.tensor([0] + per_dest[:-1]), 0)
    dest = (torch.arange(rows) - start.repeat_interleave(torch.tensor(per_dest))
            + offset.repeat_interleave(torch.tensor(per_dest))).to(torch.int32).to(device)
    count = torch.tensor([rows], dtype=torch.int32, device=device)
    remote = (rows - per_dest[rank]) * row_bytes
    received = int(table[:, rank].sum())
    remote_all = torch.tensor([remote], device=device, dtype=torch.float64)
    dist.all_reduce(remote_all, op=dist.ReduceOp.MAX, group=group)
    sent = float(remote_all)
    out = {"row_bytes": row_bytes, "rows": rows, "counts": counts, "sent_bytes": sent}
    fns = {}
    if "ceiling" in methods:
        fns["ceiling"] = _ceiling(remote, int(sent), group, device)
    for name in methods:
        kind, _, blocks = name.partition("@")
        if kind in RAW:
            fns[name] = _raw(kind, int(blocks), remote, int(sent), group, device)
    for name in methods:
        kind, _, blocks = name.partition("@")
        if kind == "push":
            fns[name] = _push(transport, int(blocks or 0), src, token, peer, dest, count)
    if "copy_out" in methods:
        region = transport.field_view(X.XF_ROWS, torch.bfloat16, width, received)
        permuted = torch.empty(received, width, dtype=torch.bfloat16, device=device)
        where = torch.arange(received, dtype=torch.int32, device=device)
        fns["copy_out"] = lambda: moe_ops.gather_rows(permuted, region, where)
    if "nccl" in methods:
        ordered = src[token.long()]
        recv_splits = [int(table[r, rank]) for r in range(world)]
        recv = torch.empty(received, width, dtype=torch.bfloat16, device=device)
        fns["nccl"] = lambda: dist.all_to_all_single(recv, ordered, recv_splits, per_dest,
                                                      group=group)
    if "all_gather" in methods or "reduce_scatter" in methods:
        tokens = src[:rows]
        every = torch.empty(world * rows, width, dtype=torch.bfloat16, device=device)
        mine = torch.empty(rows, width, dtype=torch.bfloat16, device=device)
        if "all_gather" in methods:
            fns["all_gather"] = lambda: dist.all_gather_into_tensor(every, tokens, group=group)
        if "reduce_scatter" in methods:
            fns["reduce_scatter"] = lambda: dist.reduce_scatter_tensor(mine, every, group=group)
    if "vdev" in methods:
        fns["vdev"] = _vdev(src, token, per_dest, table, rank, group, device)
    reference = None
    for name, fn in fns.items():
        if isinstance(fn, str):                      # the error that stopped it
            out[f"{name}_error"] = fn
            continue
        if name.partition("@")[0] == "push":
            got = _received(fn, transport, width, received, group)
            if reference is None:
                reference = got
            out[f"{name}_matches"] = bool(torch.equal(got, reference))
        ms = _graph_ms(fn, reps, inner, group, graphed=name != "vdev")
        moved = received * row_bytes if name == "copy_out" else sent
        if name in ("all_gather", "reduce_scatter"):
            moved = rows * row_bytes * (world - 1)
        out[f"{name}_ms"] = ms
        out[f"{name}_GBps"] = moved / (ms * 1e-3) / 1e9
        out[f"{name}_sms"] = _sms(fn)
    if "ceiling_GBps" in out:
        for name in fns:
            if name not in ("ceiling", "copy_out") and f"{name}_GBps" in out:
                out[f"{name}_of_ceiling"] = out[f"{name}_GBps"] / out["ceiling_GBps"]
    return out


def beside_gemm(row_bytes: int, rows: int, blocks: list[int], transport, group, reps: int,
                inner: int, gemms: int, experts: int, ffn: int) -> list[dict]:
    """The push beside a chain of expert GEMMs with ``N`` SMs carved out, for each ``N`` of
    ``blocks`` (module docstring, ``--beside-gemm``): one dict per ``N``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device())
    width = row_bytes // 2
    per_dest = dest_counts(rows, world, "balanced")
    gen = torch.Generator(device=device).manual_seed(rank * 7919 + rows)
    src = torch.randn(rows, width, device=device, generator=gen).to(torch.bfloat16)
    token = torch.randperm(rows, device=device, generator=gen).to(torch.int32)
    peer = torch.repeat_interleave(torch.arange(world, device=device, dtype=torch.int32),
                                   torch.tensor(per_dest, device=device))
    start = torch.cumsum(torch.tensor([0] + per_dest[:-1]), 0)
    dest = (torch.arange(rows) - start.repeat_interleave(torch.tensor(per_dest))
            + rank * torch.tensor(per_dest).repeat_interleave(torch.tensor(per_dest))
            ).to(torch.int32).to(device)
    count = torch.tensor([rows], dtype=torch.int32, device=device)
    x = torch.randn(rows, width, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(experts, 2 * ffn, width, device=device, generator=gen).to(torch.bfloat16)
    offs = (torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (rows // experts))

    def chain():
        for _ in range(gemms):
            torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    side = torch.cuda.Stream()
    flops = 2.0 * rows * width * 2 * ffn * gemms
    full_ms = _graph_ms(chain, reps, inner, group)
    out = []
    for n in blocks:
        push = _push(transport, n, src, token, peer, dest, count)

        def both(push=push):
            here = torch.cuda.current_stream()
            side.wait_stream(here)
            with torch.cuda.stream(side):
                push()
            chain()
            here.wait_stream(side)
        push_ms = _graph_ms(push, reps, inner, group)
        torch._C._set_sm_carveout_experimental(n)
        try:
            carved_ms = _graph_ms(chain, reps, inner, group)
            both_ms = _graph_ms(both, reps, inner, group)
        finally:
            torch._C._set_sm_carveout_experimental(None)
        out.append({"row_bytes": row_bytes, "rows": rows, "blocks": n, "gemm_ms": full_ms,
                    "gemm_tflops": flops / full_ms / 1e9, "carved_gemm_ms": carved_ms,
                    "push_ms": push_ms, "both_ms": both_ms,
                    "hidden": (carved_ms + push_ms - both_ms) / push_ms,
                    "both_over_apart": both_ms / (full_ms + push_ms)})
    transport.push_blocks = 0
    return out


def _received(fn, transport, width: int, received: int, group) -> torch.Tensor:
    """The rows one call of the push ``fn`` leaves in this rank's region, cleared before."""
    import torch.distributed as dist

    region = transport.field_view(X.XF_ROWS, torch.bfloat16, width, received)
    region.zero_()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    return region.clone()


def _push(transport, blocks: int, src, token, peer, dest, count):
    """The transport's push of the case's rows with at most ``blocks`` blocks (0: all), then
    its barrier."""
    def push():
        transport.push_blocks = blocks
        transport.push(X.XF_ROWS, src, token, peer, dest, count, 0, transport.capacity_rows)
        transport.barrier()
    return push


def _raw(kind: str, blocks: int, nbytes: int, largest: int, group, device):
    """``nbytes`` contiguous bytes pushed into the next rank's symmetric-memory buffer or
    pulled from the previous rank's, by ``blocks`` blocks of a copy kernel of
    ``_copy_kernels.py`` (``kind``: ``vpush``, ``vpull``, ``bpush``, ``bpull``)."""
    import cupy
    import numpy as np
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    import _copy_kernels

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = max(nbytes, 16) // 16 * 16
    buf = symm_mem.empty(max(largest, n), dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group)
    local = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    if kind.endswith("push"):
        src, dst = local, handle.get_buffer((rank + 1) % world, (n,), torch.uint8)
    else:
        src, dst = handle.get_buffer((rank - 1) % world, (n,), torch.uint8), local
    chunk, stages = 16384, 4
    module = _copy_kernels.module(unroll=8, chunk=chunk, stages=stages)
    if kind[0] == "v":
        kernel, threads, shared = module.get_function("vector_copy"), 512, 0
        size = np.int64(n // 16)
    else:
        kernel, threads, shared = module.get_function("bulk_copy"), 32, chunk * stages
        kernel.max_dynamic_shared_size_bytes = shared
        size = np.int64(n)
    keep = (buf, handle, module)

    def copy():
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        kernel((blocks,), (threads,), (src.data_ptr(), dst.data_ptr(), size),
               shared_mem=shared, stream=stream)
        return keep
    return copy


def _ceiling(nbytes: int, largest: int, group, device):
    """A copy of ``nbytes`` contiguous bytes into the next rank's symmetric-memory buffer
    (``largest`` bytes on every rank: a rendezvous needs the same size everywhere)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = max(nbytes, 1)
    buf = symm_mem.empty(max(largest, n), dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group)
    target = handle.get_buffer((rank + 1) % world, (n,), torch.uint8)
    local = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    keep = (buf, handle)                          # the mapping lives as long as the closure

    def copy():
        target.copy_(local)
        return keep
    return copy


def _vdev(src, token, per_dest, table, rank, group, device):
    """torch symmetric memory's ``all_to_all_vdev`` of the same rows, or its error."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        width = src.shape[1]
        world = len(per_dest)
        inp = symm_mem.empty(src.numel(), dtype=src.dtype, device=device)
        inp.copy_(src[token.long()].reshape(-1))
        out = symm_mem.empty(int(table.sum(0).max()) * width, dtype=src.dtype, device=device)
        # torch 2.11: (input, out, in_splits [world], out_splits_offsets [2, world], group)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device=device)
        in_splits.copy_(torch.tensor(per_dest, device=device) * width)
        out_splits = symm_mem.empty(2, world, dtype=torch.int64, device=device)
        name = group.group_name
        for t in (inp, out, in_splits, out_splits):
            symm_mem.rendezvous(t, name)

        def call():
            torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits, name)
        call()
        torch.cuda.synchronize()
        return call
    except Exception as exc:          # noqa: BLE001 - the probe reports why it cannot run
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated: {', '.join(METHODS + ('vdev',))}")
    parser.add_argument("--row-bytes", default=",".join(map(str, ROW_BYTES)))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--push-blocks", default="16,32",
                        help="comma-separated block caps: a push@N method for each")
    parser.add_argument("--raw", action="store_true",
                        help="also vpush@N, vpull@N, bpush@N, bpull@N for every N")
    parser.add_argument("--counts", default="balanced,skewed",
                        help=f"comma-separated: {', '.join(COUNTS)}")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--beside-gemm", action="store_true",
                        help="also the push on N blocks beside expert GEMMs with N SMs carved out")
    parser.add_argument("--gemms", type=int, default=1, help="GEMMs in the chain (--beside-gemm)")
    parser.add_argument("--experts", type=int, default=32, help="experts of the chain's GEMMs")
    parser.add_argument("--ffn", type=int, default=768, help="expert ffn width (2 x ffn columns)")
    args = parser.parse_args()
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = sorted(set(methods) - set(METHODS) - {"vdev"})
    if "push" in methods and args.push_blocks:
        at = methods.index("push") + 1
        methods = methods[:at] + tuple(f"push@{int(b)}" for b in args.push_blocks.split(",")
                                       if b) + methods[at:]
    if args.raw and args.push_blocks:
        at = methods.index("ceiling") + 1 if "ceiling" in methods else 0
        methods = methods[:at] + tuple(f"{k}@{int(b)}" for k in RAW
                                       for b in args.push_blocks.split(",") if b) + methods[at:]
    if unknown:
        parser.error(f"--methods: unknown {unknown}")
    counts = tuple(c for c in args.counts.split(",") if c)
    if not counts or set(counts) - set(COUNTS):
        parser.error(f"--counts: one or more of {', '.join(COUNTS)}, not {args.counts!r}")
    if "vdev" in methods and len(methods) > 1:
        parser.error("--methods: vdev runs alone (it needs the NVSHMEM backend)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    if "remote" in counts and dist.get_world_size(group) < 2:
        parser.error("--counts remote: needs two ranks or more (every row goes to another rank)")
    import torch.distributed._symmetric_memory as symm_mem

    try:
        symm_mem.set_backend("NVSHMEM" if "vdev" in methods else "CUDA")
    except (AttributeError, RuntimeError):
        pass
    row_bytes = [int(v) for v in args.row_bytes.split(",")]
    rows = [int(v) for v in args.rows.split(",")]
    transport = None
    if any(m.startswith("push") for m in methods) or "copy_out" in methods:
        from graphstash import _kernels
        from graphstash.moe.exchange import build_transport

        _kernels.warmup(device, modules=("moe_exchange", "moe_dispatch"))  # what the probe launches
        world = dist.get_world_size(group)       # a skewed receiver gets more than it sends
        transport = build_transport(group, kind="symmetric", device=device,
                                    capacity_rows=world * max(rows), row_bytes=max(row_bytes),
                                    max_experts=dist.get_world_size(group))
    results = []
    for rb in row_bytes:
        for n in rows:
            for c in counts:
                results.append(run_case(rb, n, c, methods, transport, group, args.reps,
                                        args.inner))
                if dist.get_rank() == 0:
                    print(json.dumps(results[-1]), flush=True)
    beside = []
    if args.beside_gemm:
        if transport is None or not args.push_blocks:
            parser.error("--beside-gemm: needs the push method and --push-blocks")
        if not hasattr(torch._C, "_set_sm_carveout_experimental"):
            parser.error("--beside-gemm: this torch has no torch._C._set_sm_carveout_experimental")
        beside = beside_gemm(row_bytes[0], max(rows),
                             [int(b) for b in args.push_blocks.split(",") if b], transport,
                             group, args.reps, args.inner, args.gemms, args.experts, args.ffn)
    if transport is not None:
        transport.check()
        transport.close()
    if dist.get_rank() == 0 and beside:
        first = beside[0]
        print(f"\nthe push beside {args.gemms} grouped GEMM(s) [{first['rows']}, "
              f"{first['row_bytes'] // 2}] x [{args.experts}, {first['row_bytes'] // 2}, "
              f"{2 * args.ffn}] bf16: {first['gemm_ms']:.3f} ms alone "
              f"({first['gemm_tflops']:.0f} TFLOP/s); balanced counts")
        print(f"{'blocks':>6}{'carved ms':>10}{'push ms':>9}{'both ms':>9}{'hidden':>8}"
              f"{'both / apart':>13}")
        for b in beside:
            print(f"{b['blocks']:>6}{b['carved_gemm_ms']:>10.3f}{b['push_ms']:>9.3f}"
                  f"{b['both_ms']:>9.3f}{b['hidden']:>8.2f}{b['both_over_apart']:>13.3f}")
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device)
        print(f"\nexchange bandwidth, {dist.get_world_size()} x {name} (GB/s of the bytes a rank "
              f"sends to other ranks; SMs: the largest grid of the method's kernels)")
        cols = list(methods)
        print("row bytes  rows   counts    " + "  ".join(f"{m:>16}" for m in cols))
        for r in results:
            cells = []
            for m in cols:
                if f"{m}_error" in r:
                    cells.append(f"{'error':>16}")
                else:
                    cells.append(f"{r[m + '_GBps']:8.1f} ({r[m + '_sms']:3d} SM)")
            print(f"{r['row_bytes']:>9}  {r['rows']:>5}  {r['counts']:>8}  " + "  ".join(cells))
        errors = {m: r[f"{m}_error"] for r in results for m in cols if f"{m}_error" in r}
        for m, e in errors.items():
            print(f"{m}: {e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "world": dist.get_world_size(), "results": results,
                           "beside_gemm": beside}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
