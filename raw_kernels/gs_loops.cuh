// Where a thread or a warp starts and steps in the grid-stride loops of the kernels:
// persistent grids (the launcher sizes the grid to the blocks that fit on the device, never
// more than the work), 64-bit indices. The loops themselves stay in the kernels, so the
// compiler sees the kernels' __restrict__ parameters (a lambda body would hide them and lose
// the read-only loads).
#pragma once

#include "gs_tunables.cuh"

// One thread per item: items first, first + step, ...
struct ThreadItems {
    long long first;    // this thread's first item
    long long step;     // threads in the grid
};

__device__ __forceinline__ ThreadItems thread_items() {
    return {static_cast<long long>(blockIdx.x) * GS_THREADS + threadIdx.x,
            static_cast<long long>(gridDim.x) * GS_THREADS};
}

// One warp per row of a count-aware kernel (NOTE [count-aware expert kernels] in
// moe_experts.cu): the live count is read once; the warp visits rows first, first + step, ...
// below end, and rows at or past live are the dead rows (visited only with zero_tail).
struct WarpRows {
    long long live;     // the live count, clamped to the rows
    long long end;      // rows visited: every row with zero_tail, else the live ones
    long long first;    // this warp's first row
    long long step;     // warps in the grid
    int lane;           // this thread's lane in its warp
};

__device__ __forceinline__ WarpRows warp_rows(const long long* __restrict__ live, long long rows,
                                              int zero_tail) {
    const long long n_live = min(*live, rows);
    return {n_live, zero_tail ? rows : n_live,
            static_cast<long long>(blockIdx.x) * GS_WARPS + (threadIdx.x >> 5),
            static_cast<long long>(gridDim.x) * GS_WARPS, static_cast<int>(threadIdx.x & 31)};
}
