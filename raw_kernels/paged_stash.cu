// Paged stash: copy the live rows of a static buffer into pool pages and back.
//
// One launch per stash and one per reload: page allocation from the ring free lists,
// the page-table write, the copy and the publication of the new ring head/tail all
// happen inside the kernel. The last block to finish (an atomic ticket) publishes.
//
// NOTE [buffer ordering]: the Python side orders every stash/reload/reset of one buffer
// after the previous one (an event chain across streams), so the ring counters a launch
// reads at its start cannot change under it. Every block therefore reads them itself and
// all blocks reach the same allocation decision without talking to each other.
//
// NOTE [page order]: a tensor needs sum_s ceil(n_s / page_rows) pages, segment by segment,
// page by page. Page g is taken from the device ring while device pages last, the rest from
// the host ring (spill is per page). The reference backend hands out the same ids.
#include "gs_layout.cuh"

#ifndef GS_THREADS
#define GS_THREADS 256          // threads per block
#endif
#ifndef GS_UNROLL
#define GS_UNROLL 4             // vectors each thread keeps in flight per chunk
#endif
#ifndef GS_MAX_SEGMENTS
#define GS_MAX_SEGMENTS 1024    // most segments (experts) one tensor may have
#endif

#define GS_WARPS (GS_THREADS / 32)

// Per-block view of a tensor's segments: live rows and the exclusive prefix sum of pages.
struct SegmentTable {
    int prefix[GS_MAX_SEGMENTS + 1];   // prefix[s] = first page of segment s; prefix[S] = total
    int count[GS_MAX_SEGMENTS];        // live rows of segment s
    int warp_sums[GS_WARPS];
    long long rows_total;
};

__device__ __forceinline__ int load_count(const void* counts, int is64, int s) {
    if (is64) {
        long long v = reinterpret_cast<const long long*>(counts)[s];
        // Clamp to int range but keep it out of bounds so validation still rejects it.
        return v < 0 ? -1 : (v > 0x3fffffffLL ? 0x3fffffff : static_cast<int>(v));
    }
    return reinterpret_cast<const int*>(counts)[s];
}

// Fill the segment table from S counts (device memory, int32 or int64 by is64).
// Returns, block-uniformly, whether any count was < 0 or > cap.
__device__ bool build_segments(SegmentTable& t, const void* counts, int is64, int S, int cap,
                               int page_rows) {
    const int per_thread = (S + GS_THREADS - 1) / GS_THREADS;
    const int first = threadIdx.x * per_thread;
    int local_pages = 0;
    int bad = 0;
    long long local_rows = 0;
    for (int i = 0; i < per_thread; ++i) {
        int s = first + i;
        if (s < S) {
            int n = load_count(counts, is64, s);
            if (n < 0 || n > cap) { bad = 1; n = 0; }
            t.count[s] = n;
            local_pages += (n + page_rows - 1) / page_rows;
            local_rows += n;
        }
    }
    // Block-wide exclusive scan of local_pages: warp shuffles, then the warp totals.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = local_pages;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) t.warp_sums[warp] = incl;
    if (threadIdx.x == 0) t.rows_total = 0;
    __syncthreads();
    if (warp == 0) {
        int w = lane < GS_WARPS ? t.warp_sums[lane] : 0;
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < GS_WARPS) t.warp_sums[lane] = w;
    }
    __syncthreads();
    int offset = (warp ? t.warp_sums[warp - 1] : 0) + incl - local_pages;
    for (int i = 0; i < per_thread; ++i) {
        int s = first + i;
        if (s < S) {
            t.prefix[s] = offset;
            offset += (t.count[s] + page_rows - 1) / page_rows;
        }
    }
    if (threadIdx.x == 0) t.prefix[S] = t.warp_sums[GS_WARPS - 1];
    if (local_rows) atomicAdd(reinterpret_cast<unsigned long long*>(&t.rows_total),
                              static_cast<unsigned long long>(local_rows));
    return __syncthreads_or(bad) != 0;
}

// Segment holding page g: the last s with prefix[s] <= g (segments without pages are skipped).
__device__ __forceinline__ int segment_of(const SegmentTable& t, int S, int g) {
    int lo = 0, hi = S - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (t.prefix[mid] <= g) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Copy up to one chunk (GS_THREADS * GS_UNROLL vectors) of n_vec vectors from src to dst.
template <typename V>
__device__ __forceinline__ void copy_chunk(V* __restrict__ dst, const V* __restrict__ src, int n_vec) {
    V r[GS_UNROLL];
    #pragma unroll
    for (int u = 0; u < GS_UNROLL; ++u) {
        int i = threadIdx.x + u * GS_THREADS;
        if (i < n_vec) r[u] = src[i];
    }
    #pragma unroll
    for (int u = 0; u < GS_UNROLL; ++u) {
        int i = threadIdx.x + u * GS_THREADS;
        if (i < n_vec) dst[i] = r[u];
    }
}

template <typename V>
__device__ __forceinline__ void zero_chunk(V* __restrict__ dst, int n_vec) {
    const V z{};
    #pragma unroll
    for (int u = 0; u < GS_UNROLL; ++u) {
        int i = threadIdx.x + u * GS_THREADS;
        if (i < n_vec) dst[i] = z;
    }
}

__device__ __forceinline__ unsigned char* page_address(unsigned char* dev_pages,
                                                       unsigned char* host_pages, int num_dev,
                                                       long long page_bytes, int page_id) {
    return page_id < num_dev ? dev_pages + static_cast<long long>(page_id) * page_bytes
                             : host_pages + static_cast<long long>(page_id - num_dev) * page_bytes;
}

// Ticket taken by every block after its work; true in exactly one block, the last one.
__device__ __forceinline__ bool is_last_block(long long* ticket, int* s_flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned long long t = atomicAdd(reinterpret_cast<unsigned long long*>(ticket), 1ULL);
        *s_flag = (t == gridDim.x - 1);
    }
    __syncthreads();
    return *s_flag != 0;
}

// ---------------------------------------------------------------------------------------
// gs_stash_v<W>: grid-stride over (page, chunk) items, one chunk = GS_THREADS*GS_UNROLL
// vectors of W bytes. Every block reads counts and ring counters and reaches the same
// decision (NOTE [buffer ordering]); the block holding chunk 0 of a page writes its id into
// the handle record. The last block (ticket) writes the record header and counts, moves
// the ring heads, the peaks and the status flags (atomicOr/atomicMax: status is shared).
// ---------------------------------------------------------------------------------------
template <typename V>
__device__ void stash_impl(const unsigned char* __restrict__ src, long long seg_stride,
                           long long row_bytes, int S, int cap, const void* counts,
                           int counts_is64, int page_rows, long long page_bytes,
                           unsigned char* dev_pages, unsigned char* host_pages, int num_dev,
                           int num_host, const int* __restrict__ dev_ring,
                           const int* __restrict__ host_ring, long long* state, int* status,
                           int* rec) {
    __shared__ SegmentTable t;
    __shared__ int s_last;
    const bool bad = build_segments(t, counts, counts_is64, S, cap, page_rows);
    const int total = t.prefix[S];
    const long long dev_head = state[GS_ST_DEV_HEAD], dev_tail = state[GS_ST_DEV_TAIL];
    const long long host_head = state[GS_ST_HOST_HEAD], host_tail = state[GS_ST_HOST_TAIL];
    const int dev_free = static_cast<int>(dev_tail - dev_head);
    const int host_free = static_cast<int>(host_tail - host_head);
    const int dev_take = bad ? 0 : min(total, dev_free);
    const int host_take = bad ? 0 : total - dev_take;
    const bool stored = !bad && host_take <= host_free;

    if (stored) {
        constexpr int chunk_bytes = GS_THREADS * GS_UNROLL * static_cast<int>(sizeof(V));
        const int chunks_per_page = static_cast<int>((page_bytes + chunk_bytes - 1) / chunk_bytes);
        const int items = total * chunks_per_page;
        for (int item = blockIdx.x; item < items; item += gridDim.x) {
            const int g = item / chunks_per_page;
            const int c = item - g * chunks_per_page;
            const int s = S == 1 ? 0 : segment_of(t, S, g);
            const int lp = g - t.prefix[s];
            const int rows = min(page_rows, t.count[s] - lp * page_rows);
            const long long bytes = rows * row_bytes;
            const long long off = static_cast<long long>(c) * chunk_bytes;
            if (off >= bytes) continue;
            const int page_id = g < dev_take
                ? dev_ring[(dev_head + g) % num_dev]
                : host_ring[(host_head + (g - dev_take)) % num_host];
            if (c == 0 && threadIdx.x == 0) rec[GS_H_HEADER + S + g] = page_id;
            const unsigned char* from = src + s * seg_stride +
                                        static_cast<long long>(lp) * page_rows * row_bytes + off;
            unsigned char* to = page_address(dev_pages, host_pages, num_dev, page_bytes, page_id) + off;
            const int n_vec = static_cast<int>(min(static_cast<long long>(chunk_bytes), bytes - off) /
                                               static_cast<long long>(sizeof(V)));
            copy_chunk<V>(reinterpret_cast<V*>(to), reinterpret_cast<const V*>(from), n_vec);
        }
    }

    if (!is_last_block(&state[GS_ST_STASH_TICKET], &s_last)) return;
    for (int s = threadIdx.x; s < S; s += GS_THREADS) rec[GS_H_COUNTS + s] = t.count[s];
    if (threadIdx.x == 0) {
        rec[GS_H_VALID] = stored ? 1 : 0;
        rec[GS_H_PAGES] = bad ? 0 : total;
        rec[GS_H_DEV_PAGES] = stored ? dev_take : 0;
        rec[GS_H_HOST_PAGES] = stored ? host_take : 0;
        if (stored) {
            const long long new_dev_head = dev_head + dev_take, new_host_head = host_head + host_take;
            state[GS_ST_DEV_HEAD] = new_dev_head;
            state[GS_ST_HOST_HEAD] = new_host_head;
            const long long dev_used = num_dev - (dev_tail - new_dev_head);
            const long long host_used = num_host - (host_tail - new_host_head);
            if (dev_used > state[GS_ST_DEV_PEAK]) state[GS_ST_DEV_PEAK] = dev_used;
            if (host_used > state[GS_ST_HOST_PEAK]) state[GS_ST_HOST_PEAK] = host_used;
            if (host_take > 0) atomicOr(&status[GS_SS_HOST_SPILL], 1);
        } else {
            atomicOr(&status[GS_SS_OVERFLOW], bad ? GS_OVERFLOW_COUNT : GS_OVERFLOW_POOL);
        }
        if (!bad) {
            const long long demand = state[GS_ST_DEMAND] + total;
            state[GS_ST_DEMAND] = demand;
            if (demand > state[GS_ST_DEMAND_PEAK]) state[GS_ST_DEMAND_PEAK] = demand;
            const long long rows = t.rows_total;
            if (rows > state[GS_ST_TOKENS_PEAK]) state[GS_ST_TOKENS_PEAK] = rows;
            atomicMax(&status[GS_SS_TOKENS_PEAK], static_cast<int>(min(rows, 0x7fffffffLL)));
        }
        state[GS_ST_STASH_TICKET] = 0;
    }
}

// ---------------------------------------------------------------------------------------
// gs_reload_v<W>: grid-stride over the handle's (page, chunk) items, then, with zero_tail,
// over (segment, chunk) items zero-filling rows [n_s, cap). The block holding chunk 0 of a
// page returns its id to the ring slot tail + (index of the page within its tier). The last
// block moves the ring tails, lowers the demand and marks the record consumed (-1). A record
// that was not stored (valid != 1) makes the launch write nothing but the demand change.
// ---------------------------------------------------------------------------------------
template <typename V>
__device__ void reload_impl(unsigned char* __restrict__ dst, long long seg_stride,
                            long long row_bytes, int S, int cap, int page_rows,
                            long long page_bytes, const unsigned char* dev_pages,
                            const unsigned char* host_pages, int num_dev, int num_host,
                            int* dev_ring, int* host_ring, long long* state, int* rec,
                            int zero_tail) {
    __shared__ SegmentTable t;
    __shared__ int s_last;
    const int valid = rec[GS_H_VALID];
    build_segments(t, rec + GS_H_COUNTS, 0, S, cap, page_rows);
    const int total = t.prefix[S];
    const int dev_pages_n = rec[GS_H_DEV_PAGES];
    const int host_pages_n = rec[GS_H_HOST_PAGES];
    const long long dev_tail = state[GS_ST_DEV_TAIL], host_tail = state[GS_ST_HOST_TAIL];
    constexpr int chunk_bytes = GS_THREADS * GS_UNROLL * static_cast<int>(sizeof(V));

    if (valid == 1) {
        const int chunks_per_page = static_cast<int>((page_bytes + chunk_bytes - 1) / chunk_bytes);
        const int copy_items = total * chunks_per_page;
        const long long seg_bytes = static_cast<long long>(cap) * row_bytes;
        const int zero_per_seg = zero_tail ? static_cast<int>((seg_bytes + chunk_bytes - 1) / chunk_bytes) : 0;
        const int items = copy_items + S * zero_per_seg;
        for (int item = blockIdx.x; item < items; item += gridDim.x) {
            if (item < copy_items) {
                const int g = item / chunks_per_page;
                const int c = item - g * chunks_per_page;
                const int s = S == 1 ? 0 : segment_of(t, S, g);
                const int lp = g - t.prefix[s];
                const int rows = min(page_rows, t.count[s] - lp * page_rows);
                const long long bytes = rows * row_bytes;
                const long long off = static_cast<long long>(c) * chunk_bytes;
                if (off >= bytes) continue;
                const int page_id = rec[GS_H_HEADER + S + g];
                if (c == 0 && threadIdx.x == 0) {
                    if (g < dev_pages_n) dev_ring[(dev_tail + g) % num_dev] = page_id;
                    else host_ring[(host_tail + (g - dev_pages_n)) % num_host] = page_id;
                }
                const unsigned char* from =
                    page_address(const_cast<unsigned char*>(dev_pages),
                                 const_cast<unsigned char*>(host_pages), num_dev, page_bytes, page_id) + off;
                unsigned char* to = dst + s * seg_stride +
                                    static_cast<long long>(lp) * page_rows * row_bytes + off;
                const int n_vec = static_cast<int>(min(static_cast<long long>(chunk_bytes), bytes - off) /
                                                   static_cast<long long>(sizeof(V)));
                copy_chunk<V>(reinterpret_cast<V*>(to), reinterpret_cast<const V*>(from), n_vec);
            } else {
                const int z = item - copy_items;
                const int s = z / zero_per_seg;
                const int c = z - s * zero_per_seg;
                const long long start = static_cast<long long>(t.count[s]) * row_bytes;
                const long long off = start + static_cast<long long>(c) * chunk_bytes;
                if (off >= seg_bytes) continue;
                const int n_vec = static_cast<int>(min(static_cast<long long>(chunk_bytes), seg_bytes - off) /
                                                   static_cast<long long>(sizeof(V)));
                zero_chunk<V>(reinterpret_cast<V*>(dst + s * seg_stride + off), n_vec);
            }
        }
    }

    if (!is_last_block(&state[GS_ST_RELOAD_TICKET], &s_last)) return;
    if (threadIdx.x == 0) {
        if (valid == 1) {
            state[GS_ST_DEV_TAIL] = dev_tail + dev_pages_n;
            state[GS_ST_HOST_TAIL] = host_tail + host_pages_n;
        }
        if (valid >= 0) state[GS_ST_DEMAND] -= rec[GS_H_PAGES];
        rec[GS_H_VALID] = -1;
        state[GS_ST_RELOAD_TICKET] = 0;
    }
}

#define GS_STASH_ARGS                                                                          \
    const unsigned char* src, long long seg_stride, long long row_bytes, int S, int cap,       \
        const void* counts, int counts_is64, int page_rows, long long page_bytes,              \
        unsigned char* dev_pages, unsigned char* host_pages, int num_dev, int num_host,        \
        const int* dev_ring, const int* host_ring, long long* state, int* status, int* rec
#define GS_STASH_PASS                                                                          \
    src, seg_stride, row_bytes, S, cap, counts, counts_is64, page_rows, page_bytes, dev_pages, \
        host_pages, num_dev, num_host, dev_ring, host_ring, state, status, rec
#define GS_RELOAD_ARGS                                                                         \
    unsigned char* dst, long long seg_stride, long long row_bytes, int S, int cap,             \
        int page_rows, long long page_bytes, const unsigned char* dev_pages,                   \
        const unsigned char* host_pages, int num_dev, int num_host, int* dev_ring,             \
        int* host_ring, long long* state, int* rec, int zero_tail
#define GS_RELOAD_PASS                                                                         \
    dst, seg_stride, row_bytes, S, cap, page_rows, page_bytes, dev_pages, host_pages, num_dev, \
        num_host, dev_ring, host_ring, state, rec, zero_tail

// One pair of entry points per vector width W (bytes); the loader picks the widest W that
// divides the row width and every base address.
#define GS_INSTANTIATE(W, V)                                                                   \
    extern "C" __global__ void __launch_bounds__(GS_THREADS) gs_stash_v##W(GS_STASH_ARGS) {    \
        stash_impl<V>(GS_STASH_PASS);                                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GS_THREADS) gs_reload_v##W(GS_RELOAD_ARGS) {  \
        reload_impl<V>(GS_RELOAD_PASS);                                                        \
    }

GS_INSTANTIATE(16, uint4)
GS_INSTANTIATE(8, uint2)
GS_INSTANTIATE(4, unsigned int)
GS_INSTANTIATE(2, unsigned short)
GS_INSTANTIATE(1, unsigned char)
