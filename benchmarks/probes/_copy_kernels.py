"""Copy kernels the probes in ``benchmarks/probes/`` measure: ``copy_kernels.cu``, compiled
with CuPy.

- ``vector_copy(src, dst, n_vec)``: grid-stride 16-byte loads and stores, ``UNROLL`` in flight
  per thread; ``THREADS`` and ``MIN_BLOCKS`` set ``__launch_bounds__`` (defaults 512 and 1).
- ``bulk_copy(src, dst, bytes)``: one thread per block moves ``CHUNK``-byte pieces with
  ``cp.async.bulk`` through shared memory, ``STAGES`` pieces in flight (sm_90 and later);
  launch it with ``CHUNK * STAGES`` bytes of dynamic shared memory.
"""
from __future__ import annotations

import pathlib

SOURCE_PATH = pathlib.Path(__file__).with_name("copy_kernels.cu")


def module(unroll: int = 8, chunk: int = 16384, stages: int = 4, threads: int = 512,
           min_blocks: int = 1):
    """Compile ``copy_kernels.cu`` with the given sizes (a ``cupy.RawModule``)."""
    import cupy

    opts = ("--std=c++17", f"-DTHREADS={threads}", f"-DMIN_BLOCKS={min_blocks}",
            f"-DUNROLL={unroll}", f"-DCHUNK={chunk}", f"-DSTAGES={max(1, stages)}")
    return cupy.RawModule(code=SOURCE_PATH.read_text(), options=opts)
