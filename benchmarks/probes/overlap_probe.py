"""Can a copy kernel run beside the expert GEMMs instead of taking turns with them?

Stash and reload copies run on a side stream while the main stream computes. A grouped GEMM
(``torch._grouped_mm``) keeps one large block resident on every multiprocessor, so a copy
kernel whose blocks do not fit beside it waits for SMs: the two take turns and the copy's
time is added to the step. This program measures, in one run, a chain of expert GEMMs alone,
a device-to-device copy alone, and both forked on two streams inside one CUDA graph, for
several shapes of copy kernel:

- ``vector``: a grid-stride kernel of 16-byte loads and stores, ``unroll`` in flight per
  thread, ``threads`` per block, registers capped through ``__launch_bounds__``;
- ``bulk``: one thread per block moving ``chunk``-byte pieces with ``cp.async.bulk`` through
  shared memory, ``stages`` pieces in flight (few registers, some shared memory).

``hidden`` is the share of the copy's own time that disappears when it runs beside the
GEMMs: ``(gemm + copy - both) / copy``; ``gemm x`` is how much the GEMM chain slows down.

With ``--carveout N[,M...]`` it also measures, for each ``N``, the GEMM chain captured while
``torch._C._set_sm_carveout_experimental(N)`` holds (torch's CUTLASS grouped GEMM then sizes
its persistent grid to the multiprocessors less ``N``), alone and beside the 512-thread vector
copy on ``N`` blocks: whether a copy, or an exchange's push, given the SMs the GEMM leaves
free, runs beside it instead of taking turns (``gemm x`` there is against the chain without
a carveout).

Usage: ``python benchmarks/probes/overlap_probe.py [--copy-mib 1024] [--gemms 24] [--reps 10]
[--carveout 16,32]``.
Needs a CUDA GPU of compute capability 9.x (``torch._grouped_mm`` in bf16) and CuPy.
"""
from __future__ import annotations

import argparse

import torch

from graphstash.tools.bench.timing import event_ms

from _copy_kernels import module as _copy_module


# (label, kind, threads, min_blocks, unroll or chunk, stages, blocks per SM (float))
VARIANTS = [
    ("vector 512 thr, half the SMs (stash today)", "vector", 512, 1, 8, 0, 0.5),
    ("vector 512 thr, every SM", "vector", 512, 1, 8, 0, 1),
    ("vector 32 thr <=32 regs, 1/SM", "vector", 32, 64, 4, 0, 1),
    ("vector 32 thr <=32 regs, 2/SM", "vector", 32, 64, 4, 0, 2),
    ("vector 64 thr <=32 regs, 1/SM", "vector", 64, 32, 4, 0, 1),
    ("vector 128 thr <=32 regs, 1/SM", "vector", 128, 16, 4, 0, 1),
    ("bulk 2 KiB x 4, 1/SM", "bulk", 32, 32, 2048, 4, 1),
    ("bulk 4 KiB x 4, 1/SM", "bulk", 32, 32, 4096, 4, 1),
    ("bulk 8 KiB x 4, 1/SM", "bulk", 32, 32, 8192, 4, 1),
    ("bulk 16 KiB x 4, 1/SM", "bulk", 32, 32, 16384, 4, 1),
]


def _graph_ms(parts, reps: int) -> float:
    """Median ms of one replay of a graph that forks ``parts`` (callables) onto streams."""
    main = torch.cuda.Stream()
    streams = [torch.cuda.Stream() for _ in parts]
    graph = torch.cuda.CUDAGraph()
    for part in parts:           # warm up outside the capture (compiles, loads cuBLAS)
        part()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=main):
        start = torch.cuda.Event()
        start.record(main)
        ends = []
        for part, stream in zip(parts, streams):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                part()
            end = torch.cuda.Event()
            end.record(stream)
            ends.append(end)
        for end in ends:
            main.wait_event(end)
    graph.replay()
    torch.cuda.synchronize()
    return event_ms(graph.replay, reps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-mib", type=float, default=1024.0, help="bytes one copy moves")
    parser.add_argument("--gemms", type=int, default=24, help="grouped GEMMs in the chain")
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--carveout", default="",
                        help="comma-separated SM counts the GEMMs leave to the copy")
    args = parser.parse_args(argv)
    carveouts = [int(c) for c in args.carveout.split(",") if c.strip()]
    import cupy

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.rows, args.hidden, device=dev, generator=gen).to(torch.bfloat16)
    w = torch.randn(args.experts, args.ffn, args.hidden, device=dev, generator=gen).to(torch.bfloat16)
    offs = torch.arange(1, args.experts + 1, device=dev, dtype=torch.int32) * (args.rows // args.experts)

    def gemms():
        for _ in range(args.gemms):
            torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    nbytes = int(args.copy_mib * 2**20) // 16 * 16
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    flops = 2.0 * args.rows * args.hidden * args.ffn * args.gemms
    gemm_ms = _graph_ms([gemms], args.reps)
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; {args.gemms} grouped GEMMs "
          f"[{args.rows}, {args.hidden}] x [{args.experts}, {args.hidden}, {args.ffn}] bf16: "
          f"{gemm_ms:.3f} ms ({flops / gemm_ms / 1e9:.0f} TFLOP/s); copy {nbytes / 2**20:.0f} MiB "
          f"device to device; median of {args.reps} graph replays")
    print(f"{'copy kernel':<44}{'regs':>5}{'smem':>7}{'copy ms':>9}{'GB/s':>7}{'both ms':>9}"
          f"{'hidden':>8}{'gemm x':>8}  equal")
    stream = lambda: cupy.cuda.Stream.from_external(torch.cuda.current_stream())  # noqa: E731
    for label, kind, threads, min_blocks, size, stages, per_sm in VARIANTS:
        unroll, chunk = (size, 4096) if kind == "vector" else (4, size)
        fn = _copy_module(unroll, chunk, stages, threads, min_blocks).get_function(f"{kind}_copy")
        grid = max(1, int(sms * per_sm))
        smem = chunk * stages if kind == "bulk" else 0
        if smem:
            fn.max_dynamic_shared_size_bytes = smem

        def copy(fn=fn, grid=grid, smem=smem, threads=threads, kind=kind):
            n = cupy.int64(nbytes // 16 if kind == "vector" else nbytes)
            with stream():
                fn((grid,), (threads,), (src.data_ptr(), dst.data_ptr(), n), shared_mem=smem)
        dst.zero_()
        copy_ms = _graph_ms([copy], args.reps)
        equal = bool(torch.equal(dst, src))
        both_ms = _graph_ms([gemms, copy], args.reps)
        hidden = (gemm_ms + copy_ms - both_ms) / copy_ms
        print(f"{label:<44}{fn.num_regs:>5}{fn.shared_size_bytes + smem:>7}{copy_ms:>9.3f}"
              f"{2 * nbytes / copy_ms / 1e6:>7.0f}{both_ms:>9.3f}{hidden:>8.2f}"
              f"{both_ms / gemm_ms:>8.2f}  {equal}")
    if carveouts:
        _carveouts(carveouts, gemms, gemm_ms, src, dst, nbytes, stream, args.reps, sms)


def _carveouts(carveouts, gemms, gemm_ms, src, dst, nbytes, stream, reps, sms) -> None:
    """The GEMM chain with ``N`` SMs carved out, alone and beside the vector copy on ``N``
    blocks, for each ``N`` of ``carveouts`` (module docstring)."""
    import cupy

    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        print("carveout: this torch has no torch._C._set_sm_carveout_experimental")
        return
    fn = _copy_module(8, 4096, 0, 512, 1).get_function("vector_copy")
    print(f"\n{'carveout':>8}{'gemm ms':>9}{'gemm x':>8}{'copy ms':>9}{'GB/s':>7}{'both ms':>9}"
          f"{'hidden':>8}{'both x':>8}  equal")
    for n in carveouts:
        if not 0 < n < sms:
            print(f"{n:>8}  skipped: a carveout is 1 to {sms - 1} SMs here")
            continue

        def copy(n=n):
            with stream():
                fn((n,), (512,), (src.data_ptr(), dst.data_ptr(), cupy.int64(nbytes // 16)))
        torch._C._set_sm_carveout_experimental(n)
        try:
            carved_ms = _graph_ms([gemms], reps)
            dst.zero_()
            copy_ms = _graph_ms([copy], reps)
            equal = bool(torch.equal(dst, src))
            both_ms = _graph_ms([gemms, copy], reps)
        finally:
            torch._C._set_sm_carveout_experimental(None)
        hidden = (carved_ms + copy_ms - both_ms) / copy_ms
        print(f"{n:>8}{carved_ms:>9.3f}{carved_ms / gemm_ms:>8.2f}{copy_ms:>9.3f}"
              f"{2 * nbytes / copy_ms / 1e6:>7.0f}{both_ms:>9.3f}{hidden:>8.2f}"
              f"{both_ms / gemm_ms:>8.2f}  {equal}")


if __name__ == "__main__":
    main()
