// Copy kernels the probes in benchmarks/probes/ measure (compiled by _copy_kernels.py).
// Tunables are #ifndef defaults the loader overrides with -D.

#ifndef UNROLL
#define UNROLL 8
#endif
#ifndef CHUNK
#define CHUNK 16384
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef THREADS
#define THREADS 512
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
// vector_copy: grid-stride loop, one 16-byte uint4 per thread and step, UNROLL loads in
// flight before their stores. Writes dst[0, n_vec); no atomics; no ordering between blocks.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
vector_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n_vec) {
    constexpr int U = UNROLL;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n_vec; i += U * stride) {
        uint4 r[U];
        #pragma unroll
        for (int k = 0; k < U; ++k) r[k] = src[i + k * stride];
        #pragma unroll
        for (int k = 0; k < U; ++k) dst[i + k * stride] = r[k];
    }
    for (; i < n_vec; i += stride) dst[i] = src[i];
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// bulk_copy: one thread per block moves CHUNK-byte pieces (piece c = block + k * grid)
// global -> shared -> global with cp.async.bulk, STAGES pieces in flight, each stage guarded
// by an mbarrier. Writes dst[0, bytes); sm_90 and later; needs CHUNK * STAGES bytes of
// dynamic shared memory.
extern "C" __global__ void __launch_bounds__(32, 32)
bulk_copy(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
          long long bytes) {
    extern __shared__ __align__(128) unsigned char stage_mem[];
    __shared__ __align__(8) unsigned long long bars[STAGES];
    if (threadIdx.x != 0) return;
    for (int s = 0; s < STAGES; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const long long n_chunks = (bytes + CHUNK - 1) / CHUNK;
    auto chunk_of = [&](long long k) { return blockIdx.x + k * (long long)gridDim.x; };
    auto load = [&](long long k) {
        const long long c = chunk_of(k);
        if (c >= n_chunks) return;
        const int s = (int)(k % STAGES);
        const unsigned size = (unsigned)min((long long)CHUNK, bytes - c * CHUNK);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(smem_addr(&bars[s])), "r"(size) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(stage_mem + s * CHUNK)), "l"(src + c * CHUNK), "r"(size),
                        "r"(smem_addr(&bars[s])) : "memory");
    };
    for (int k = 0; k < STAGES; ++k) load(k);
    for (long long k = 0; chunk_of(k) < n_chunks; ++k) {
        const long long c = chunk_of(k);
        const int s = (int)(k % STAGES);
        const unsigned parity = (unsigned)((k / STAGES) & 1);
        unsigned done = 0;
        do {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                         " selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(smem_addr(&bars[s])), "r"(parity) : "memory");
        } while (!done);
        const unsigned size = (unsigned)min((long long)CHUNK, bytes - c * CHUNK);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst + c * CHUNK), "r"(smem_addr(stage_mem + s * CHUNK)), "r"(size)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        load(k + STAGES);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
