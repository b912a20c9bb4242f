"""How fast can a kernel move bytes between device memory and pinned host memory?

The host tier of the paged stash moves its pages with the kernel's own loads and stores over
PCIe, not with the copy engines (no host code knows which pages a stash took). This program
measures, in one run, each direction of a ``bytes``-sized transfer three ways:

- ``copy_``: torch ``copy_(non_blocking=True)`` (the copy engines), the baseline;
- ``vector``: a grid-stride kernel of 16-byte loads and stores, ``unroll`` in flight per
  thread (what the stash kernels do today);
- ``bulk``: a kernel that moves ``chunk``-byte pieces with ``cp.async.bulk`` (global to shared
  memory, then shared memory to global), ``stages`` pieces in flight per block, one thread
  issuing (sm_90 and later).

Usage: ``python benchmarks/probes/pcie_probe.py [--mib 90] [--reps 10]``; prints GB/s and the ratio to
``copy_`` per direction and variant. Needs a CUDA GPU and CuPy.
"""
from __future__ import annotations

import argparse

import torch

from graphstash.tools.bench.timing import event_ms

from _copy_kernels import module as _module



def _time(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` event-timed calls (after two warmups)."""
    for _ in range(2):
        fn()
    return event_ms(fn, reps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=89.6, help="bytes moved per transfer (MiB)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    import cupy

    nbytes = int(args.mib * 2**20) // 16 * 16
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev.flip(0).cpu())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    print(f"{torch.cuda.get_device_name()}: {nbytes / 2**20:.1f} MiB per transfer, "
          f"{sms} SMs, median of {args.reps}")

    def gbs(ms):
        return nbytes / ms / 1e6

    directions = {"H2D": (host, dev), "D2H": (dev, host)}
    for name, (src, dst) in directions.items():
        ref = _time(lambda: dst.copy_(src, non_blocking=True), args.reps)
        print(f"\n{name}: copy_ {ref:.3f} ms ({gbs(ref):.1f} GB/s)")
        rows = []
        for unroll, blocks_per_sm in ((8, 1), (8, 2), (4, 4), (16, 1)):
            kernel = _module(unroll, 16384, 4).get_function("vector_copy")
            grid = sms * blocks_per_sm

            def vec(kernel=kernel, grid=grid, src=src, dst=dst):
                with stream:
                    kernel((grid,), (512,), (src.data_ptr(), dst.data_ptr(),
                                             cupy.int64(nbytes // 16)))
            rows.append((f"vector unroll {unroll}, {blocks_per_sm} x 512 threads/SM",
                         _time(vec, args.reps), src, dst))
        for chunk, stages, blocks_per_sm in ((16384, 4, 2), (32768, 3, 2), (8192, 8, 3),
                                             (65536, 2, 1), (4096, 8, 4)):
            kernel = _module(8, chunk, stages).get_function("bulk_copy")
            smem = chunk * stages
            kernel.max_dynamic_shared_size_bytes = smem
            grid = sms * blocks_per_sm

            def bulk(kernel=kernel, grid=grid, smem=smem, src=src, dst=dst):
                with stream:
                    kernel((grid,), (32,), (src.data_ptr(), dst.data_ptr(), cupy.int64(nbytes)),
                           shared_mem=smem)
            rows.append((f"bulk {chunk // 1024} KiB x {stages} stages, {blocks_per_sm} blocks/SM",
                         _time(bulk, args.reps), src, dst))
        for label, ms, _, _ in rows:
            print(f"  {label:<44} {ms:.3f} ms {gbs(ms):7.1f} GB/s  ratio {ref / ms:.3f}")
        # the bytes of the last vector and bulk variants
        dst.zero_()
        bulk()
        torch.cuda.synchronize()
        print(f"  bytes equal after bulk: {bool(torch.equal(dst.cpu(), src.cpu()))}")
        dst.zero_()
        vec()
        torch.cuda.synchronize()
        print(f"  bytes equal after vector: {bool(torch.equal(dst.cpu(), src.cpu()))}")


if __name__ == "__main__":
    main()
