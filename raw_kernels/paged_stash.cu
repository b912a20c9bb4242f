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
#define GS_THREADS 512          // threads per block
#endif
#ifndef GS_UNROLL
#define GS_UNROLL 8             // vectors each thread keeps in flight per chunk
#endif
#ifndef GS_MAX_SEGMENTS
#define GS_MAX_SEGMENTS 1024    // most segments (experts) one tensor may have
#endif
#ifndef GS_MIN_BLOCKS
#define GS_MIN_BLOCKS 1         // __launch_bounds__ occupancy hint (caps registers when > 1)
#endif
#ifndef GS_STREAMING
#define GS_STREAMING 0          // 1: evict-first loads/stores (__ldcs/__stcs): rows are moved once
#endif

#define GS_WARPS (GS_THREADS / 32)

// Per-block view of a tensor's segments, built once per block from the S live counts.
struct SegmentTable {
    long long rows[GS_MAX_SEGMENTS + 1];   // rows[s] = live rows before segment s; rows[S] = all
    int pages[GS_MAX_SEGMENTS + 1];        // pages[s] = first page of segment s; pages[S] = all
    int count[GS_MAX_SEGMENTS];            // live rows of segment s
    long long warp_rows[GS_WARPS];
    int warp_pages[GS_WARPS];
};

__device__ __forceinline__ int load_count(const void* counts, int is64, int s) {
    if (is64) {
        long long v = reinterpret_cast<const long long*>(counts)[s];
        // Clamp to int range but keep it out of bounds so validation still rejects it.
        return v < 0 ? -1 : (v > 0x3fffffffLL ? 0x3fffffff : static_cast<int>(v));
    }
    return reinterpret_cast<const int*>(counts)[s];
}

// Exclusive block-wide prefix sum (warp shuffles, then the warp totals); total via *total.
template <typename T>
__device__ T block_exclusive_scan(T value, T* warp_totals, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = value;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_totals[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T w = lane < GS_WARPS ? warp_totals[lane] : T(0);
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            T y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < GS_WARPS) warp_totals[lane] = w;
    }
    __syncthreads();
    *total = warp_totals[GS_WARPS - 1];
    return (warp ? warp_totals[warp - 1] : T(0)) + incl - value;
}

// Fill the segment table from S counts (device memory, int32 or int64 by is64).
// Returns, block-uniformly, whether any count was < 0 or > cap (such counts read as 0).
__device__ bool build_segments(SegmentTable& t, const void* counts, int is64, int S, int cap,
                               int page_rows) {
    if (S == 1) {   // the common unsegmented case: one count, one barrier
        int n = load_count(counts, is64, 0);
        const bool bad = n < 0 || n > cap;
        if (bad) n = 0;
        if (threadIdx.x == 0) {
            t.count[0] = n;
            t.pages[0] = 0;
            t.pages[1] = (n + page_rows - 1) / page_rows;
            t.rows[0] = 0;
            t.rows[1] = n;
        }
        return __syncthreads_or(bad) != 0;
    }
    const int per_thread = (S + GS_THREADS - 1) / GS_THREADS;
    const int first = threadIdx.x * per_thread;
    int local_pages = 0, bad = 0;
    long long local_rows = 0;
    for (int i = 0; i < per_thread; ++i) {
        const int s = first + i;
        if (s < S) {
            int n = load_count(counts, is64, s);
            if (n < 0 || n > cap) { bad = 1; n = 0; }
            t.count[s] = n;
            local_pages += (n + page_rows - 1) / page_rows;
            local_rows += n;
        }
    }
    int total_pages;
    long long total_rows;
    int page_offset = block_exclusive_scan<int>(local_pages, t.warp_pages, &total_pages);
    long long row_offset = block_exclusive_scan<long long>(local_rows, t.warp_rows, &total_rows);
    for (int i = 0; i < per_thread; ++i) {
        const int s = first + i;
        if (s < S) {
            t.pages[s] = page_offset;
            t.rows[s] = row_offset;
            page_offset += (t.count[s] + page_rows - 1) / page_rows;
            row_offset += t.count[s];
        }
    }
    if (threadIdx.x == 0) { t.pages[S] = total_pages; t.rows[S] = total_rows; }
    return __syncthreads_or(bad) != 0;
}

// Last s in [0, S) with key(s) <= x, for a non-decreasing key.
template <typename Key>
__device__ __forceinline__ int find_segment(int S, long long x, Key key) {
    int lo = 0, hi = S - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (key(mid) <= x) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename V>
__device__ __forceinline__ V load_vec(const V* p) {
#if GS_STREAMING
    return __ldcs(p);
#else
    return *p;
#endif
}

template <typename V>
__device__ __forceinline__ void store_vec(V* p, V v) {
#if GS_STREAMING
    __stcs(p, v);
#else
    *p = v;
#endif
}

template <typename V>
__device__ __forceinline__ void zero_span(unsigned char* __restrict__ dst, long long n) {
    V* d = reinterpret_cast<V*>(dst);
    const V z{};
    const long long n_vec = n / static_cast<long long>(sizeof(V));
    for (long long i = threadIdx.x; i < n_vec; i += GS_THREADS) d[i] = z;
}

// This block's share [begin, end) of a byte stream of `bytes` bytes, cut at vector boundaries:
// NOTE [balanced split] every block of the (fully resident) grid gets the same number of
// vectors. Used for zero-filling, where the work is write-only and light.
template <typename V>
__device__ __forceinline__ void block_share(long long bytes, long long* begin, long long* end) {
    const long long n_vec = bytes / static_cast<long long>(sizeof(V));
    *begin = n_vec * blockIdx.x / gridDim.x * static_cast<long long>(sizeof(V));
    *end = n_vec * (blockIdx.x + 1) / gridDim.x * static_cast<long long>(sizeof(V));
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

// NOTE [dynamic units]: the live rows are cut into units that never cross a page: unit u is
// chunk (u % units_per_page) of page (u / units_per_page), one chunk being GS_THREADS*GS_UNROLL
// vectors. Blocks of the persistent grid take units from an atomic counter, so fast
// multiprocessors take more of them and no block is left finishing a fixed share alone. The
// next unit is claimed while the current unit's loads are in flight (double-buffered in
// shared memory), so the atomic's latency hides behind them.
template <typename V, typename Locate>
__device__ __forceinline__ void for_each_unit(const SegmentTable& t, int S, long long row_bytes,
                                              int page_rows, long long page_bytes,
                                              unsigned long long* work, Locate locate) {
    constexpr long long chunk = static_cast<long long>(GS_THREADS) * GS_UNROLL * sizeof(V);
    __shared__ long long s_unit[2];
    const long long units_per_page = (page_bytes + chunk - 1) / chunk;
    const long long total_units = static_cast<long long>(t.pages[S]) * units_per_page;
    if (threadIdx.x == 0) s_unit[0] = static_cast<long long>(atomicAdd(work, 1ULL));
    __syncthreads();
    for (int parity = 0;; parity ^= 1) {
        const long long u = s_unit[parity];
        if (u >= total_units) break;
        const int g = static_cast<int>(u / units_per_page);
        const long long off = (u - g * units_per_page) * chunk;
        const int s = S == 1 ? 0 : find_segment(S, g, [&](int k) { return static_cast<long long>(t.pages[k]); });
        const int lp = g - t.pages[s];
        const long long bytes = min(page_rows, t.count[s] - lp * page_rows) * row_bytes;
        const unsigned char* from;
        unsigned char* to;
        locate(s, g, lp, off, &from, &to);
        const int n_vec = off < bytes ? static_cast<int>(min(chunk, bytes - off) / static_cast<long long>(sizeof(V))) : 0;
        V r[GS_UNROLL];
        const V* src = reinterpret_cast<const V*>(from);
        V* dst = reinterpret_cast<V*>(to);
        #pragma unroll
        for (int k = 0; k < GS_UNROLL; ++k) {
            const int i = threadIdx.x + k * GS_THREADS;
            if (i < n_vec) r[k] = load_vec(src + i);
        }
        if (threadIdx.x == 0) s_unit[parity ^ 1] = static_cast<long long>(atomicAdd(work, 1ULL));
        #pragma unroll
        for (int k = 0; k < GS_UNROLL; ++k) {
            const int i = threadIdx.x + k * GS_THREADS;
            if (i < n_vec) store_vec(dst + i, r[k]);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// gs_stash_v<W>: persistent grid; blocks take page-sized-or-smaller units of the live rows from
// an atomic counter (NOTE [dynamic units]) and copy them in W-byte vectors. Every block reads counts and ring counters and
// reaches the same decision (NOTE [buffer ordering]); the block holding a page's first unit
// writes that page's id into the handle record. The last block (ticket) writes
// the record header and counts, moves the ring heads, the peaks and the status flags
// (atomicOr/atomicMax: status is shared between buffers).
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
    // ring counters first: their loads overlap the count load and the scan
    const long long dev_head = state[GS_ST_DEV_HEAD], dev_tail = state[GS_ST_DEV_TAIL];
    const long long host_head = state[GS_ST_HOST_HEAD], host_tail = state[GS_ST_HOST_TAIL];
    const bool bad = build_segments(t, counts, counts_is64, S, cap, page_rows);
    const int total = t.pages[S];
    const int dev_free = static_cast<int>(dev_tail - dev_head);
    const int host_free = static_cast<int>(host_tail - host_head);
    const int dev_take = bad ? 0 : min(total, dev_free);
    const int host_take = bad ? 0 : total - dev_take;
    const bool stored = !bad && host_take <= host_free;

    if (stored) {
        for_each_unit<V>(t, S, row_bytes, page_rows, page_bytes,
            reinterpret_cast<unsigned long long*>(&state[GS_ST_STASH_WORK]),
            [&](int s, int g, int lp, long long off, const unsigned char** from, unsigned char** to) {
                const int page_id = g < dev_take
                    ? dev_ring[(dev_head + g) % num_dev]
                    : host_ring[(host_head + (g - dev_take)) % num_host];
                if (off == 0 && threadIdx.x == 0) rec[GS_H_HEADER + S + g] = page_id;
                *from = src + s * seg_stride + static_cast<long long>(lp) * page_rows * row_bytes + off;
                *to = page_address(dev_pages, host_pages, num_dev, page_bytes, page_id) + off;
            });
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
            const long long rows = t.rows[S];
            if (rows > state[GS_ST_TOKENS_PEAK]) state[GS_ST_TOKENS_PEAK] = rows;
            atomicMax(&status[GS_SS_TOKENS_PEAK], static_cast<int>(min(rows, 0x7fffffffLL)));
        }
        state[GS_ST_STASH_TICKET] = 0;
        state[GS_ST_STASH_WORK] = 0;
    }
}

// ---------------------------------------------------------------------------------------
// gs_reload_v<W>: persistent grid; blocks take units of the live rows from an atomic counter
// (NOTE [dynamic units]) and copy them back; with zero_tail every block then zero-fills an
// equal share of the dead rows [n_s, cap) (NOTE [balanced split]). The block holding a page's
// first unit returns the page to its ring, at slot
// tail + (index of the page within its tier). The last block moves the ring tails, lowers the
// demand and marks the record consumed (-1). A record that was not stored (valid != 1) makes
// the launch write nothing but the demand change.
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
    const int dev_pages_n = rec[GS_H_DEV_PAGES];
    const int host_pages_n = rec[GS_H_HOST_PAGES];
    const long long dev_tail = state[GS_ST_DEV_TAIL], host_tail = state[GS_ST_HOST_TAIL];
    build_segments(t, rec + GS_H_COUNTS, 0, S, cap, page_rows);

    if (valid == 1) {
        for_each_unit<V>(t, S, row_bytes, page_rows, page_bytes,
            reinterpret_cast<unsigned long long*>(&state[GS_ST_RELOAD_WORK]),
            [&](int s, int g, int lp, long long off, const unsigned char** from, unsigned char** to) {
                const int page_id = rec[GS_H_HEADER + S + g];
                if (off == 0 && threadIdx.x == 0) {
                    if (g < dev_pages_n) dev_ring[(dev_tail + g) % num_dev] = page_id;
                    else host_ring[(host_tail + (g - dev_pages_n)) % num_host] = page_id;
                }
                *from = page_address(const_cast<unsigned char*>(dev_pages),
                                     const_cast<unsigned char*>(host_pages), num_dev, page_bytes,
                                     page_id) + off;
                *to = dst + s * seg_stride + static_cast<long long>(lp) * page_rows * row_bytes + off;
            });
        if (zero_tail) {
            // The dead rows, segment after segment: dead(s) rows lie before segment s.
            auto dead_before = [&](int k) { return (static_cast<long long>(k) * cap - t.rows[k]) * row_bytes; };
            long long o, end;
            block_share<V>(dead_before(S), &o, &end);
            int s = o < end ? (S == 1 ? 0 : find_segment(S, o, dead_before)) : S;
            while (o < end) {
                const long long seg_begin = dead_before(s), seg_end = dead_before(s + 1);
                if (o >= seg_end) { ++s; continue; }
                const long long piece = min(end, seg_end) - o;
                zero_span<V>(dst + s * seg_stride + t.count[s] * row_bytes + (o - seg_begin), piece);
                o += piece;
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
        state[GS_ST_RELOAD_WORK] = 0;
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
    extern "C" __global__ void __launch_bounds__(GS_THREADS, GS_MIN_BLOCKS) gs_stash_v##W(GS_STASH_ARGS) {    \
        stash_impl<V>(GS_STASH_PASS);                                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GS_THREADS, GS_MIN_BLOCKS) gs_reload_v##W(GS_RELOAD_ARGS) {  \
        reload_impl<V>(GS_RELOAD_PASS);                                                        \
    }

GS_INSTANTIATE(16, uint4)
GS_INSTANTIATE(8, uint2)
GS_INSTANTIATE(4, unsigned int)
GS_INSTANTIATE(2, unsigned short)
GS_INSTANTIATE(1, unsigned char)
