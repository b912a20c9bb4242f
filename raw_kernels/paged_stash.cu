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
#include "gs_tunables.cuh"

// Per-block view of a tensor's segments, built once per block from the S live counts. The
// arrays live in dynamic shared memory sized for S by the launcher (_segment_smem in
// graphstash/_kernels/paged_stash.py): an unsegmented tensor takes a few bytes, so the kernel
// does not force a large shared-memory carve-out on the multiprocessors it shares with
// compute kernels.
struct SegmentTable {
    long long* rows;    // [S + 1] rows[s] = live rows before segment s; rows[S] = all
    int* pages;         // [S + 1] pages[s] = first page of segment s; pages[S] = all
    int* count;         // [S] live rows of segment s
    long long* warp_rows;
    int* warp_pages;
};

extern __shared__ long long gs_segment_smem[];

__device__ __forceinline__ SegmentTable segment_table(int S) {
    __shared__ long long warp_rows[GS_WARPS];
    __shared__ int warp_pages[GS_WARPS];
    SegmentTable t;
    t.rows = gs_segment_smem;
    t.pages = reinterpret_cast<int*>(t.rows + S + 1);
    t.count = t.pages + S + 1;
    t.warp_rows = warp_rows;
    t.warp_pages = warp_pages;
    return t;
}

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
__device__ bool build_segments(const SegmentTable& t, const void* counts, int is64, int S, int cap,
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
// NOTE [balanced split]: every block of the (fully resident) grid gets the same number of
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

// Ticket taken by every block after its work; true in exactly one block, the last one. No
// fence: the last block reads nothing the other blocks wrote (they wrote pages, page-table and
// ring entries for later launches, which see them at the kernel boundary).
__device__ __forceinline__ bool is_last_block(long long* ticket, int* s_flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long t = atomicAdd(reinterpret_cast<unsigned long long*>(ticket), 1ULL);
        *s_flag = (t == gridDim.x - 1);
    }
    __syncthreads();
    return *s_flag != 0;
}

// Page index of this block's first unit (block b starts with unit b; NOTE [dynamic units]).
template <typename V>
__device__ __forceinline__ int first_unit_page(long long page_bytes) {
    constexpr long long chunk = static_cast<long long>(GS_THREADS) * GS_UNROLL * sizeof(V);
    return static_cast<int>(blockIdx.x / ((page_bytes + chunk - 1) / chunk));
}

// NOTE [dynamic units]: the live rows are cut into units that never cross a page: unit u is
// chunk (u % units_per_page) of page (u / units_per_page), one chunk being GS_THREADS*GS_UNROLL
// vectors. Block b starts with unit b; later units come from an atomic counter, so fast
// multiprocessors take more of them and no block is left finishing a fixed share alone.
// Thread 0 claims the next unit *and* looks up its page id while the current unit's loads are
// in flight (double-buffered in shared memory), so neither the atomic nor the page-table load
// sits between two units' copies.
template <bool kSrcIsPage, typename V, typename Lookup, typename Commit, typename TensorAt>
__device__ __forceinline__ void for_each_unit(const SegmentTable& t, int S, long long row_bytes,
                                              int page_rows, long long page_bytes,
                                              unsigned char* dev_pages, unsigned char* host_pages,
                                              int num_dev, unsigned long long* work,
                                              int first_page_id, Lookup lookup, Commit commit,
                                              TensorAt tensor_at) {
    constexpr int chunk = GS_THREADS * GS_UNROLL * static_cast<int>(sizeof(V));
    __shared__ int s_unit[2], s_page[2];
    const int units_per_page = static_cast<int>((page_bytes + chunk - 1) / chunk);
    const int total_units = t.pages[S] * units_per_page;
    // Thread 0 publishes the next unit; when the pages are the source (reload) it also looks
    // up that unit's page id and does the page's one-time side effect (commit) ahead of time.
    auto prepare = [&](int u, int slot, bool first) {
        s_unit[slot] = u;
        if (kSrcIsPage && u < total_units) {
            const int g = u / units_per_page;
            const int page_id = first ? first_page_id : lookup(g);
            s_page[slot] = page_id;
            if (u == g * units_per_page) commit(g, page_id);
        }
    };
    if (threadIdx.x == 0) prepare(static_cast<int>(blockIdx.x), 0, true);
    __syncthreads();
    for (int parity = 0;; parity ^= 1) {
        const int u = s_unit[parity];
        if (u >= total_units) break;
        const int g = u / units_per_page;
        const int c = u - g * units_per_page;
        const long long off = static_cast<long long>(c) * chunk;
        const int s = S == 1 ? 0 : find_segment(S, g, [&](int k) { return static_cast<long long>(t.pages[k]); });
        const int lp = g - t.pages[s];
        const long long bytes = min(page_rows, t.count[s] - lp * page_rows) * row_bytes;
        const int n_vec = off < bytes ? static_cast<int>(min(static_cast<long long>(chunk), bytes - off) / static_cast<long long>(sizeof(V))) : 0;
        unsigned char* tensor = tensor_at(s, lp, off);
        int page_id = kSrcIsPage ? s_page[parity] : 0;
        const V* src = reinterpret_cast<const V*>(
            kSrcIsPage ? page_address(dev_pages, host_pages, num_dev, page_bytes, page_id) + off : tensor);
        V r[GS_UNROLL];
        #pragma unroll
        for (int k = 0; k < GS_UNROLL; ++k) {
            const int i = threadIdx.x + k * GS_THREADS;
            if (i < n_vec) r[k] = load_vec(src + i);
        }
        if (!kSrcIsPage) {   // stash: the destination page is looked up while the loads fly
            page_id = lookup(g);
            if (c == 0 && threadIdx.x == 0) commit(g, page_id);
        }
        V* dst = reinterpret_cast<V*>(
            kSrcIsPage ? tensor : page_address(dev_pages, host_pages, num_dev, page_bytes, page_id) + off);
        // With no more units than blocks every unit was handed out statically: no atomic.
        if (threadIdx.x == 0)
            prepare(total_units <= static_cast<int>(gridDim.x)
                        ? total_units
                        : static_cast<int>(gridDim.x + atomicAdd(work, 1ULL)),
                    parity ^ 1, false);
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
    const SegmentTable t = segment_table(S);
    __shared__ int s_last;
    // Every state word this launch reads is loaded up front: the loads overlap the count load
    // and the scan, and the last block's bookkeeping needs no load of its own.
    const long long dev_head = state[GS_ST_DEV_HEAD], dev_tail = state[GS_ST_DEV_TAIL];
    const long long host_head = state[GS_ST_HOST_HEAD], host_tail = state[GS_ST_HOST_TAIL];
    const long long dev_peak = state[GS_ST_DEV_PEAK], host_peak = state[GS_ST_HOST_PEAK];
    const long long demand0 = state[GS_ST_DEMAND], demand_peak = state[GS_ST_DEMAND_PEAK];
    const long long tokens_peak = state[GS_ST_TOKENS_PEAK];
    const int dev_free = static_cast<int>(dev_tail - dev_head);
    // Device or host page depends only on g < free device pages (NOTE [page order]).
    auto lookup = [&](int g) {
        return g < dev_free ? dev_ring[(dev_head + g) % num_dev]
                            : host_ring[(host_head + (g - dev_free)) % num_host];
    };
    const bool bad = build_segments(t, counts, counts_is64, S, cap, page_rows);
    const int total = t.pages[S];
    const int host_free = static_cast<int>(host_tail - host_head);
    const int dev_take = bad ? 0 : min(total, dev_free);
    const int host_take = bad ? 0 : total - dev_take;
    const bool stored = !bad && host_take <= host_free;

    if (stored) {
        for_each_unit<false, V>(t, S, row_bytes, page_rows, page_bytes, dev_pages, host_pages,
            num_dev, reinterpret_cast<unsigned long long*>(&state[GS_ST_STASH_WORK]), 0, lookup,
            [&](int g, int page_id) { rec[GS_H_HEADER + S + g] = page_id; },
            [&](int s, int lp, long long off) {
                return const_cast<unsigned char*>(src) + s * seg_stride +
                       static_cast<long long>(lp) * page_rows * row_bytes + off;
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
            if (dev_used > dev_peak) state[GS_ST_DEV_PEAK] = dev_used;
            if (host_used > host_peak) state[GS_ST_HOST_PEAK] = host_used;
            if (host_take > 0) atomicOr(&status[GS_SS_HOST_SPILL], 1);
        } else {
            atomicOr(&status[GS_SS_OVERFLOW], bad ? GS_OVERFLOW_COUNT : GS_OVERFLOW_POOL);
        }
        if (!bad) {
            const long long demand = demand0 + total;
            state[GS_ST_DEMAND] = demand;
            if (demand > demand_peak) state[GS_ST_DEMAND_PEAK] = demand;
            const long long rows = t.rows[S];
            if (rows > tokens_peak) state[GS_ST_TOKENS_PEAK] = rows;
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
    const SegmentTable t = segment_table(S);
    __shared__ int s_last;
    const int valid = rec[GS_H_VALID];
    const int dev_pages_n = rec[GS_H_DEV_PAGES];
    const int host_pages_n = rec[GS_H_HOST_PAGES];
    const long long dev_tail = state[GS_ST_DEV_TAIL], host_tail = state[GS_ST_HOST_TAIL];
    const long long demand0 = state[GS_ST_DEMAND];
    const int pages_asked = rec[GS_H_PAGES];
    const int max_pages = S * ((cap + page_rows - 1) / page_rows);
    auto lookup = [&](int g) { return rec[GS_H_HEADER + S + g]; };
    int first_page_id = 0;
    const int g0 = first_unit_page<V>(page_bytes);
    if (threadIdx.x == 0 && g0 < max_pages) first_page_id = lookup(g0);   // overlaps the scan
    build_segments(t, rec + GS_H_COUNTS, 0, S, cap, page_rows);
    if (valid == 1) {
        for_each_unit<true, V>(t, S, row_bytes, page_rows, page_bytes,
            const_cast<unsigned char*>(dev_pages), const_cast<unsigned char*>(host_pages), num_dev,
            reinterpret_cast<unsigned long long*>(&state[GS_ST_RELOAD_WORK]), first_page_id, lookup,
            [&](int g, int page_id) {
                if (g < dev_pages_n) dev_ring[(dev_tail + g) % num_dev] = page_id;
                else host_ring[(host_tail + (g - dev_pages_n)) % num_host] = page_id;
            },
            [&](int s, int lp, long long off) {
                return dst + s * seg_stride + static_cast<long long>(lp) * page_rows * row_bytes + off;
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
        if (valid >= 0) state[GS_ST_DEMAND] = demand0 - pages_asked;
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
