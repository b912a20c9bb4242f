// The routing plan of a one-device, static-budget MoE dispatch in three launches: where each
// (token, slot) pair goes in the permuted buffer, and the inverse maps, computed on the device.
//
// Same result as graphstash/moe/_routing.py's plan_local (the oracle), bit for bit: the pairs
// are ordered by expert, stably (pair order inside an expert); expert e owns rows
// [offs[e], offs[e] + padded[e]) (NOTE [permuted layout]); rows at or past the budget are
// dropped. Out-of-range expert ids go to bin E: counted as bad, never placed.
//
// A "chunk" is GS_CHUNK consecutive pairs handled by one warp (count, then place), so the
// stable rank of a pair is: its expert's pairs in earlier chunks (exclusive scan over chunks,
// gs_route_layout) + in earlier rounds of 32 pairs of its chunk (a per-warp running count in
// shared memory) + in lower lanes of its round (__match_any_sync).
#include "gs_layout.cuh"

#include "gs_tunables.cuh"
#define GS_CHUNK 256            // pairs per warp chunk: 8 rounds of 32

template <typename I>
__device__ __forceinline__ int expert_key(const I* __restrict__ idx, long long p, int E) {
    const long long e = static_cast<long long>(idx[p]);
    return (e < 0 || e >= E) ? E : static_cast<int>(e);
}

// ---------------------------------------------------------------------------------------
// gs_route_count_<i32|i64>: chunk_counts[c, key] = pairs of chunk c per key (E + 1 bins),
// one warp per chunk (grid-stride), a per-warp histogram in dynamic shared memory
// ([GS_WARPS][E + 1] ints, shared-memory atomics). Also fills pair_of_slot and token_of_slot
// ([R] each) with -1, grid-stride over the threads.
// ---------------------------------------------------------------------------------------
template <typename I>
__device__ void route_count_impl(const I* __restrict__ idx, long long pairs, int E,
                                 int* __restrict__ chunk_counts, long long chunks,
                                 int* __restrict__ pair_of_slot, int* __restrict__ token_of_slot,
                                 long long R) {
    extern __shared__ int hist[];
    const int lane = threadIdx.x & 31;
    int* h = hist + (threadIdx.x >> 5) * (E + 1);
    const long long threads = static_cast<long long>(gridDim.x) * GS_THREADS;
    for (long long r = static_cast<long long>(blockIdx.x) * GS_THREADS + threadIdx.x; r < R;
         r += threads) {
        pair_of_slot[r] = -1;
        token_of_slot[r] = -1;
    }
    const long long warps = static_cast<long long>(gridDim.x) * GS_WARPS;
    for (long long c = static_cast<long long>(blockIdx.x) * GS_WARPS + (threadIdx.x >> 5);
         c < chunks; c += warps) {
        for (int e = lane; e <= E; e += 32) h[e] = 0;
        __syncwarp();
        for (int i = lane; i < GS_CHUNK; i += 32) {
            const long long p = c * GS_CHUNK + i;
            if (p < pairs) atomicAdd(&h[expert_key(idx, p, E)], 1);
        }
        __syncwarp();
        for (int e = lane; e <= E; e += 32) chunk_counts[c * (E + 1) + e] = h[e];
        __syncwarp();
    }
}

// ---------------------------------------------------------------------------------------
// gs_route_layout: one block. Turns chunk_counts into each chunk's exclusive base per key
// (in place), then one thread lays the experts out: padded counts, offsets (offs, int64 [E]),
// tokens_per_expert (padded, clamped to the budget R), live = min(demand, R), demand,
// over_budget = demand > R, bad_index = any pair out of range; and raises the status as
// graphstash.moe.dispatch's _update_status does (tokens peak, over budget, OVERFLOW_COUNT).
// Dynamic shared memory: (E + 1) int64 totals.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GS_THREADS)
    gs_route_layout(int* __restrict__ chunk_counts, long long chunks, int E, long long R,
                    int pad, long long* __restrict__ offs, int* __restrict__ tokens_per_expert,
                    int* __restrict__ live, long long* __restrict__ demand,
                    bool* __restrict__ over_budget, bool* __restrict__ bad_index,
                    int* __restrict__ status) {
    extern __shared__ long long totals[];
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        long long run = 0;
        for (long long c = 0; c < chunks; ++c) {
            const int v = chunk_counts[c * (E + 1) + e];
            chunk_counts[c * (E + 1) + e] = static_cast<int>(run);
            run += v;
        }
        totals[e] = run;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    long long off = 0;
    for (int e = 0; e < E; ++e) {
        const long long n = totals[e];
        const long long padded = pad > 1 ? (n + pad - 1) / pad * pad : n;
        const long long end = off + padded;
        offs[e] = off;
        tokens_per_expert[e] = static_cast<int>(min(end, R) - min(off, R));
        off = end;
    }
    demand[0] = off;
    live[0] = static_cast<int>(min(off, R));
    over_budget[0] = off > R;
    bad_index[0] = totals[E] > 0;
    if (status != nullptr) {
        const int peak = static_cast<int>(min(off, 2147483647LL));
        if (peak > status[GS_SS_TOKENS_PEAK]) status[GS_SS_TOKENS_PEAK] = peak;
        if (off > R) status[GS_SS_OVER_BUDGET] |= 1;
        if (totals[E] > 0) status[GS_SS_OVERFLOW] |= GS_OVERFLOW_COUNT;
    }
}

// ---------------------------------------------------------------------------------------
// gs_route_place_<i32|i64>: one warp per chunk (same mapping as the count), 8 rounds of 32
// pairs. Row of pair p = offs[e] + chunk base + running count of the warp + lower lanes of
// the round with the same expert; slot_of_pair[p] = row (or -1 when dropped or out of
// range), pair_of_slot[row] = p, token_of_slot[row] = p / K. Every kept row is written by
// exactly one lane; no atomics. Dynamic shared memory: [GS_WARPS][E + 1] running counts.
// ---------------------------------------------------------------------------------------
template <typename I>
__device__ void route_place_impl(const I* __restrict__ idx, long long pairs, int K, int E,
                                 const int* __restrict__ chunk_base, long long chunks,
                                 const long long* __restrict__ offs, long long R,
                                 int* __restrict__ slot_of_pair, int* __restrict__ pair_of_slot,
                                 int* __restrict__ token_of_slot) {
    extern __shared__ int running_all[];
    const int lane = threadIdx.x & 31;
    int* running = running_all + (threadIdx.x >> 5) * (E + 1);
    const unsigned lower = (1u << lane) - 1u;
    const long long warps = static_cast<long long>(gridDim.x) * GS_WARPS;
    for (long long c = static_cast<long long>(blockIdx.x) * GS_WARPS + (threadIdx.x >> 5);
         c < chunks; c += warps) {
        for (int e = lane; e <= E; e += 32) running[e] = chunk_base[c * (E + 1) + e];
        __syncwarp();
        for (int round = 0; round < GS_CHUNK / 32; ++round) {
            const long long p = c * GS_CHUNK + round * 32 + lane;
            const bool in_range = p < pairs;
            const int key = in_range ? expert_key(idx, p, E) : E + 1;
            const unsigned peers = __match_any_sync(0xffffffffu, key);
            const int before = in_range ? running[key] : 0;
            __syncwarp();
            if (in_range && lane == __ffs(peers) - 1) running[key] = before + __popc(peers);
            __syncwarp();
            if (!in_range) continue;
            int slot = -1;
            if (key < E) {
                const long long row = offs[key] + before + __popc(peers & lower);
                if (row < R) {
                    slot = static_cast<int>(row);
                    pair_of_slot[row] = static_cast<int>(p);
                    token_of_slot[row] = static_cast<int>(p / K);
                }
            }
            slot_of_pair[p] = slot;
        }
        __syncwarp();
    }
}

#define GS_ROUTE_KERNELS(NAME, I)                                                              \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_route_count_##NAME(const I* idx, long long pairs, int E, int* chunk_counts,         \
                              long long chunks, int* pair_of_slot, int* token_of_slot,         \
                              long long R) {                                                   \
        route_count_impl<I>(idx, pairs, E, chunk_counts, chunks, pair_of_slot, token_of_slot, \
                            R);                                                                \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_route_place_##NAME(const I* idx, long long pairs, int K, int E,                     \
                              const int* chunk_base, long long chunks, const long long* offs,  \
                              long long R, int* slot_of_pair, int* pair_of_slot,               \
                              int* token_of_slot) {                                            \
        route_place_impl<I>(idx, pairs, K, E, chunk_base, chunks, offs, R, slot_of_pair,       \
                            pair_of_slot, token_of_slot);                                      \
    }

GS_ROUTE_KERNELS(i32, int)
GS_ROUTE_KERNELS(i64, long long)
