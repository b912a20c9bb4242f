// Tunables of graphstash's kernels: the one place their defaults are written.
//
// graphstash/_kernels reads these defaults from this file (raw_kernels.int_defines) and
// compiles every source with each of them passed as -D, so the block size it launches and the
// one the kernels were compiled for are the same number; GRAPHSTASH_TUNABLES="THREADS=256,..."
// overrides them for a tuning run (docs/kernel-tuning.md has the variants measured). A
// source compiled on its own (nvcc, a probe) gets the same defaults through the #ifndef guards.
#pragma once

#ifndef GS_THREADS
#define GS_THREADS 512          // threads per block of every kernel (the launcher's block size)
#endif
#ifndef GS_UNROLL
#define GS_UNROLL 8             // paged stash: vectors each thread keeps in flight per unit
#endif
#ifndef GS_MIN_BLOCKS
#define GS_MIN_BLOCKS 1         // paged stash: __launch_bounds__ blocks per multiprocessor (caps registers when > 1)
#endif
#ifndef GS_STREAMING
#define GS_STREAMING 0          // paged stash: 1 = evict-first loads/stores (__ldcs/__stcs)
#endif
#ifndef GS_XCHG_UNROLL
#define GS_XCHG_UNROLL 4        // exchange push: vectors each lane loads before it stores them
#endif
#ifndef GS_XCHG_MIN_BLOCKS
#define GS_XCHG_MIN_BLOCKS 2    // exchange push: blocks per multiprocessor the registers must allow
#endif

#define GS_WARPS (GS_THREADS / 32)
