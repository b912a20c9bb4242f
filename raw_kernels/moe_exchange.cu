// Expert-parallel exchange of an MoE layer: live rows move between ranks through a table of
// peer addresses (torch symmetric memory across GPUs, CUDA IPC between processes on one GPU,
// or one process's own buffers), inside a CUDA graph: no count reaches the host, every
// launch has a fixed shape, and only the live rows are written.
//
// Every rank owns a shared region (fields and sizes in gs_exchange.cuh and
// graphstash/moe/exchange/layout.py) and a private int64 state; ``table`` (int64 [F][W], on
// the device) holds the address of each field of each rank's region. A dispatch is:
//   gs_xchg_counts  push this rank's per-expert counts into every region, barrier, then derive
//                   the permuted layout of every receiver from the W x E counts (prefix over
//                   source ranks), clip to the budget, raise the flags;
//   gs_xchg_map     per pair / send slot / received row: where it goes and where it came from;
//   gs_xchg_push_v* copy live rows straight into the receivers' regions (16-byte vectors);
//   gs_xchg_barrier every rank's pushes are done; the receiver then copies its rows out of its
//                   region (graphstash's gather kernel), and the region is free again after the
//                   next barrier. Combine is the same push in reverse.
//
// NOTE [exchange signals]: one monotonic epoch per rank, no resets. A barrier increments the
// rank's private epoch e (every rank runs the same sequence of exchanges, so they agree on e),
// stores e with release semantics at system scope into slot ``me`` of every rank's SIGNALS,
// then waits (acquire loads) until every slot of its own SIGNALS holds >= e. Nothing is ever
// reset, so graph replays, eager steps and reruns simply continue the count (an int64 does not
// wrap). Ordering: a kernel that writes into other regions ends each block with __syncthreads
// and a __threadfence_system, and the signal is raised by a later kernel in stream order with a
// fence and a release store at system scope (or, in the same block, after a fence and
// __syncthreads), so a rank that sees epoch e sees everything the signalling rank wrote before
// raising it. Reads of what peers wrote bypass L1 (__ldcg).
// Reuse: a region field is written for exchange n only after a barrier that every rank entered
// after consuming exchange n - 1 of that field (the launchers issue it), except the counts,
// which are written before the dispatch's first barrier: every rank read the previous counts
// before the previous dispatch's data barrier, which the writer has passed. The flag slots
// alternate by the parity of the barrier epoch they are exchanged under, so two calls in a row
// never share a slot while a slower rank still reads it.
//
// NOTE [exchange timeout]: every wait reads %globaltimer; a peer that does not raise its signal
// within timeout_ns makes the rank record GS_XE_TIMEOUT (the peer, the epoch) in its state and
// stop waiting. The error is sticky: later barriers raise their own signals but do not wait, so
// a dead peer costs one timeout per rank, not one per barrier. Everything after reads counts
// that may be stale, so every index is clamped and every write bounds-checked against the
// region; the status gets GS_OVERFLOW_EXCHANGE, all_reduce_flags_ raises every flag, and the
// host reads the state and raises (graphstash.moe.exchange: ExchangeError).
#include "gs_exchange.cuh"
#include "gs_layout.cuh"
#include "gs_tunables.cuh"

#ifndef GS_XCHG_SLEEP_NS
#define GS_XCHG_SLEEP_NS 64     // back-off between two polls of a signal
#endif

#define GS_INT32_MAX 2147483647LL
#define GS_COUNT_MAX 1073741824LL   // counts read from peers are clamped to [0, 2^30]

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ long long load_acquire_sys(const long long* p) {
    long long v;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(long long* p, long long v) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ long long padded(long long n, int pad) {
    return pad > 1 ? (n + pad - 1) / pad * pad : n;
}

__device__ __forceinline__ void record_error(long long* state, long long code, int peer,
                                             long long epoch) {
    unsigned long long* slot = reinterpret_cast<unsigned long long*>(state + GS_XS_ERROR);
    if (atomicCAS(slot, 0ull, static_cast<unsigned long long>(code)) == 0ull) {
        state[GS_XS_ERROR_PEER] = peer;
        state[GS_XS_ERROR_EPOCH] = epoch;
    }
}

// Block-wide barrier (every thread of the block calls it): NOTE [exchange signals]. Returns
// the epoch; afterwards state[GS_XS_ERROR] says whether it (or an earlier one) failed.
__device__ long long block_barrier(const long long* __restrict__ table, long long* state, int W,
                                   int me, long long timeout_ns) {
    __shared__ long long epoch_s;
    __shared__ int failed_s;
    __threadfence_system();            // this block's writes into regions before the signal
    __syncthreads();
    if (threadIdx.x == 0) {
        epoch_s = state[GS_XS_EPOCH] + 1;
        state[GS_XS_EPOCH] = epoch_s;
        failed_s = state[GS_XS_ERROR] != 0;
        state[GS_XS_META_BYTES] += 8LL * W;
    }
    __syncthreads();
    const long long e = epoch_s;
    for (int p = threadIdx.x; p < W; p += blockDim.x)
        store_release_sys(reinterpret_cast<long long*>(table[GS_XF_SIGNALS * W + p]) + me, e);
    if (!failed_s) {
        const long long* mine = reinterpret_cast<const long long*>(table[GS_XF_SIGNALS * W + me]);
        for (int s = threadIdx.x; s < W; s += blockDim.x) {
            const unsigned long long t0 = global_ns();
            while (load_acquire_sys(mine + s) < e) {
                if (global_ns() - t0 > static_cast<unsigned long long>(timeout_ns)) {
                    record_error(state, GS_XE_TIMEOUT, s, e);
                    break;
                }
                __nanosleep(GS_XCHG_SLEEP_NS);
            }
        }
    }
    __syncthreads();
    return e;
}

// ---------------------------------------------------------------------------------------
// gs_xchg_barrier: one block. Raises epoch + 1 at every rank and waits for every rank's
// (block_barrier). Writes W signals (8 bytes each, release, system scope) and the state's
// epoch, byte count and, after a timeout, its error; then, if the exchange failed and a
// status is given, GS_OVERFLOW_EXCHANGE into status[GS_SS_OVERFLOW] (thread 0).
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GS_THREADS)
    gs_xchg_barrier(const long long* __restrict__ table, long long* state, int W, int me,
                    long long timeout_ns, int* status) {
    block_barrier(table, state, W, me, timeout_ns);
    if (threadIdx.x == 0 && status != nullptr && state[GS_XS_ERROR] != 0)
        status[GS_SS_OVERFLOW] |= GS_OVERFLOW_EXCHANGE;
}

// ---------------------------------------------------------------------------------------
// gs_xchg_counts: one block. (1) writes [header, send_counts[E]] into row ``me`` of every
// rank's COUNTS, (2) barrier, (3) copies the W x E counts of its own COUNTS into ``cube``
// (checking each source's header: GS_XE_MISMATCH), (4) lays out every receiver from them
// (NOTE [permuted layout] of graphstash/moe/_routing.py: expert e of receiver d owns rows
// [offs, offs + padded total), source ranks in order inside it) into ``work`` (gs_exchange.cuh),
// and this rank's tokens_per_expert [E / W], live rows, demand and over-budget flag, and raises
// ``status`` (tokens peak, over budget, bad index, exchange failure). Phases are separated by
// __syncthreads; each output is written by one thread. No atomics.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GS_THREADS)
    gs_xchg_counts(const long long* __restrict__ table, long long* state, int W, int me,
                   long long timeout_ns, const int* __restrict__ send_counts, int E, int stride,
                   long long budget, int pad, int row_bytes, const bool* __restrict__ bad_index,
                   int* status, int* __restrict__ cube, long long* __restrict__ work,
                   int* __restrict__ tokens_per_expert, int* __restrict__ live,
                   long long* __restrict__ demand, bool* __restrict__ over_budget) {
    const int El = E / W;
    const int budget32 = static_cast<int>(min(budget, GS_INT32_MAX));
    for (int i = threadIdx.x; i < GS_X_HEADER + E; i += blockDim.x) {
        int v;
        if (i == 0) v = E;
        else if (i == 1) v = budget32;
        else if (i == 2) v = pad;
        else if (i == 3) v = row_bytes;
        else v = max(send_counts[i - GS_X_HEADER], 0);
        for (int p = 0; p < W; ++p)
            reinterpret_cast<int*>(table[GS_XF_COUNTS * W + p])
                [static_cast<long long>(me) * stride + i] = v;
    }
    if (threadIdx.x == 0) state[GS_XS_META_BYTES] += 4LL * W * (GS_X_HEADER + E);
    const long long epoch = block_barrier(table, state, W, me, timeout_ns);

    const int* own = reinterpret_cast<const int*>(table[GS_XF_COUNTS * W + me]);
    for (int s = threadIdx.x; s < W; s += blockDim.x) {
        const int* row = own + static_cast<long long>(s) * stride;
        if (__ldcg(row) != E || __ldcg(row + 1) != budget32 || __ldcg(row + 2) != pad ||
            __ldcg(row + 3) != row_bytes)
            record_error(state, GS_XE_MISMATCH, s, epoch);
    }
    for (long long i = threadIdx.x; i < static_cast<long long>(W) * E; i += blockDim.x) {
        const long long s = i / E, g = i - s * E;
        const long long v = __ldcg(own + s * stride + GS_X_HEADER + g);
        cube[i] = static_cast<int>(min(max(v, 0LL), GS_COUNT_MAX));
    }
    __syncthreads();

    long long* offs = work + GS_XW_OFFS * E;
    long long* total = work + GS_XW_TOTAL * E;
    long long* dst = work + GS_XW_DST * E;
    long long* recv = work + GS_XW_RECV * E;
    long long* src = work + GS_XW_SRC * E;
    long long* slot = work + GS_XW_SLOT * E;
    for (int g = threadIdx.x; g < E; g += blockDim.x) {
        long long t = 0;
        for (int s = 0; s < W; ++s) t += cube[static_cast<long long>(s) * E + g];
        total[g] = t;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < W; d += blockDim.x) {
        long long run = 0;
        for (int e = 0; e < El; ++e) {
            offs[d * El + e] = run;
            run += padded(total[d * El + e], pad);
        }
    }
    __syncthreads();
    for (int g = threadIdx.x; g < E; g += blockDim.x) {
        long long run = offs[g];
        for (int s = 0; s < me; ++s) run += cube[static_cast<long long>(s) * E + g];
        dst[g] = run;
    }
    for (int e = threadIdx.x; e < El; e += blockDim.x) {
        const int g = me * El + e;
        long long run = offs[g];
        for (int s = 0; s < W; ++s) {
            recv[s * El + e] = run;
            run += cube[static_cast<long long>(s) * E + g];
        }
        const long long end = offs[g] + padded(total[g], pad);
        tokens_per_expert[e] = static_cast<int>(min(end, budget) - min(offs[g], budget));
    }
    for (int s = threadIdx.x; s < W; s += blockDim.x) {
        long long run = 0;
        for (int g = 0; g < E; ++g) {
            if (g / El == me) src[s * El + (g - me * El)] = run;
            if (s == me) slot[g] = run;
            run += cube[static_cast<long long>(s) * E + g];
        }
        if (s == me) slot[E] = run;
    }
    if (threadIdx.x == 0) {
        const int last = me * El + El - 1;
        const long long need = El > 0 ? offs[last] + padded(total[last], pad) : 0;
        demand[0] = need;
        live[0] = static_cast<int>(min(min(need, budget), GS_INT32_MAX));
        over_budget[0] = need > budget;
        if (status != nullptr) {
            const int peak = static_cast<int>(min(need, GS_INT32_MAX));
            if (peak > status[GS_SS_TOKENS_PEAK]) status[GS_SS_TOKENS_PEAK] = peak;
            if (need > budget) status[GS_SS_OVER_BUDGET] |= 1;
            if (bad_index != nullptr && bad_index[0]) status[GS_SS_OVERFLOW] |= GS_OVERFLOW_COUNT;
            if (state[GS_XS_ERROR] != 0) status[GS_SS_OVERFLOW] |= GS_OVERFLOW_EXCHANGE;
        }
    }
}

// last index i in [0, n) with a[i] <= v (0 when none); a non-decreasing
__device__ __forceinline__ int last_at_most(const long long* __restrict__ a, int n, long long v) {
    int lo = 0, hi = n;               // answer in [lo, hi)
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] <= v) lo = mid;
        else hi = mid;
    }
    return lo;
}

// ---------------------------------------------------------------------------------------
// gs_xchg_map: grid-stride over max(pairs, rows) items, one thread each (fixed grid). Item i
// as a send slot: slot_peer/slot_row (the rank and row it lands on, -1 when the receiver's
// budget (clip) drops it or the slot is not live) and slot_self (i if kept, else -1); as a
// pair: pair_slot (its slot if kept, else -1); as a received row (i < rows): row_src (i when
// a live, non-padding row, else -1), row_peer / row_slot (the rank and send slot it came
// from). Reads work/cube of gs_xchg_counts and the live count on the device. No atomics.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GS_THREADS)
    gs_xchg_map(const long long* __restrict__ work, const int* __restrict__ cube, int W, int me,
                int E, const int* __restrict__ slot_of_pair, long long pairs, long long clip,
                const int* __restrict__ live, long long rows, int* __restrict__ pair_slot,
                int* __restrict__ slot_peer, int* __restrict__ slot_row,
                int* __restrict__ slot_self, int* __restrict__ row_src,
                int* __restrict__ row_peer, int* __restrict__ row_slot) {
    const int El = E / W;
    const long long* offs = work + GS_XW_OFFS * E;
    const long long* total = work + GS_XW_TOTAL * E;
    const long long* dst = work + GS_XW_DST * E;
    const long long* recv = work + GS_XW_RECV * E;
    const long long* src = work + GS_XW_SRC * E;
    const long long* slot = work + GS_XW_SLOT * E;
    const long long n_slots = min(slot[E], pairs);
    const long long n_live = min(static_cast<long long>(max(live[0], 0)), rows);
    const long long items = max(pairs, rows);
    const long long stride = static_cast<long long>(gridDim.x) * GS_THREADS;
    for (long long i = static_cast<long long>(blockIdx.x) * GS_THREADS + threadIdx.x; i < items;
         i += stride) {
        if (i < pairs) {
            int peer = -1, row = -1, self = -1;
            if (i < n_slots && E > 0) {
                const int g = last_at_most(slot, E, i);
                const long long r = dst[g] + (i - slot[g]);
                if (r < clip && r >= 0) {
                    peer = g / El;
                    row = static_cast<int>(r);
                    self = static_cast<int>(i);
                }
            }
            slot_peer[i] = peer;
            slot_row[i] = row;
            slot_self[i] = self;
            const int q = slot_of_pair[i];
            int kept = -1;
            if (q >= 0 && q < n_slots && E > 0) {
                const int g = last_at_most(slot, E, q);
                const long long r = dst[g] + (q - slot[g]);
                if (r < clip && r >= 0) kept = q;
            }
            pair_slot[i] = kept;
        }
        if (i < rows) {
            int source = -1, peer = -1, sent = -1;
            if (i < n_live && El > 0) {
                const int e = last_at_most(offs + me * El, El, i);
                const int g = me * El + e;
                if (i - offs[g] < total[g]) {
                    int s = 0;
                    for (int t = 1; t < W; ++t)
                        if (recv[t * El + e] <= i) s = t;
                    const long long j = i - recv[s * El + e];
                    if (j >= 0 && j < cube[static_cast<long long>(s) * E + g]) {
                        source = static_cast<int>(i);
                        peer = s;
                        sent = static_cast<int>(src[s * El + e] + j);
                    }
                }
            }
            row_src[i] = source;
            row_peer[i] = peer;
            row_slot[i] = sent;
        }
    }
}

// ---------------------------------------------------------------------------------------
// gs_xchg_push_v<N>: persistent grid; each group of 2^lanes_log2 lanes takes items
// i < min(count[0], max_items) (the live count, read on the device) and copies row
// src_index[i] (or i) of src into rank dest_peer[i]'s field at row dest_row[i] - lo, when
// that row is in the window [lo, hi) and the region (capacity rows); N-byte vectors, each
// lane loading GS_XCHG_UNROLL before storing them, the next item's indices loaded while the
// current row moves. With ``extra`` (the router weights: elem2 bytes per row, 2, 4 or 8), the
// group's first lane also copies extra[extra_index[i]] (or extra[i]) into field2 at the same
// row: one launch moves a row and its weight. Each block ends with __syncthreads and one
// __threadfence_system (NOTE [exchange signals]) and adds its bytes and rows to the state, one
// atomic per counter.
//
// NOTE [push order]: a dispatch's items are its send slots, ordered by global expert, so by
// receiving rank, 0 first, on every rank alike (NOTE [live-row exchange layout]). Taken in
// that order, the resident blocks of every rank write into the same receiver at the same
// time: one rank's links take the whole machine's traffic while the others idle (four H100,
// 64 k rows of 4 KiB each way: 192 GB/s, 0.49 of a plain copy to one peer, and no faster on
// 132 SMs than on 16; docs/exchange.md, "Four GPUs, and the order of the push"). So the
// grid walks the items interleaved: loop step i takes segment (i % W + me + 1) % W of W
// equal segments (q = ceil(n / W) items each), item i / W within it. Where the items are
// grouped by receiver, every window of consecutive steps then writes into every rank alike,
// and ranks start on different receivers (after it: 339 GB/s, 0.87). Each item is still
// moved once; only the order changes (a row's place in its receiver does not depend on it).
// ---------------------------------------------------------------------------------------
struct PushItem {
    int peer, row, src, src2;
};

__device__ __forceinline__ PushItem push_item(long long item, int n,
                                              const int* __restrict__ src_index,
                                              const int* __restrict__ extra_index,
                                              const int* __restrict__ dest_peer,
                                              const int* __restrict__ dest_row) {
    PushItem it{-1, -1, -1, -1};
    if (item < n) {
        it.peer = __ldg(dest_peer + item);
        it.row = __ldg(dest_row + item);
        it.src = src_index != nullptr ? __ldg(src_index + item) : static_cast<int>(item);
        it.src2 = extra_index != nullptr ? __ldg(extra_index + item) : static_cast<int>(item);
    }
    return it;
}

template <typename U>
__device__ __forceinline__ void copy_as(unsigned char* dst, const unsigned char* src) {
    *reinterpret_cast<U*>(dst) = *reinterpret_cast<const U*>(src);
}

__device__ __forceinline__ void copy_small(unsigned char* dst, const unsigned char* src,
                                           int bytes) {
    if (bytes == 8) copy_as<unsigned long long>(dst, src);
    else if (bytes == 4) copy_as<unsigned int>(dst, src);
    else if (bytes == 2) copy_as<unsigned short>(dst, src);
    else for (int b = 0; b < bytes; ++b) dst[b] = src[b];
}

template <typename V>
__device__ void push_impl(const long long* __restrict__ table, long long* state, int W, int me,
                          int field, const V* __restrict__ src, int src_rows,
                          const int* __restrict__ src_index, const int* __restrict__ dest_peer,
                          const int* __restrict__ dest_row, const int* __restrict__ count,
                          int max_items, int vec_per_row, int lanes_log2, int lo, int hi,
                          int capacity, int field2, const unsigned char* __restrict__ extra,
                          int extra_rows, const int* __restrict__ extra_index, int elem2) {
    __shared__ unsigned long long block_bytes[2];
    __shared__ unsigned long long block_rows;
    if (threadIdx.x == 0) {
        block_bytes[0] = block_bytes[1] = 0;
        block_rows = 0;
    }
    __syncthreads();
    const int n = min(max(count[0], 0), max_items);
    const int lanes = 1 << lanes_log2;
    const int sub = threadIdx.x & (lanes - 1);
    const long long thread = static_cast<long long>(blockIdx.x) * GS_THREADS + threadIdx.x;
    const int first = static_cast<int>(thread >> lanes_log2);
    const int groups =
        static_cast<int>((static_cast<long long>(gridDim.x) * GS_THREADS) >> lanes_log2);
    const int step = lanes * GS_XCHG_UNROLL;
    const unsigned long long row_bytes = static_cast<unsigned long long>(vec_per_row) * sizeof(V);
    unsigned long long local = 0, remote = 0;
    unsigned int moved = 0;
    // loop step i moves item (i % W + me + 1) % W * q + i / W, not item i (NOTE [push
    // order]); an item >= n is none. Unsigned 32-bit: n < 2^31, so q * W and i + groups stay
    // below 2^32
    const unsigned int uw = static_cast<unsigned int>(W);
    const unsigned int q = (static_cast<unsigned int>(n) + uw - 1) / uw;
    const unsigned int span = q * uw;
    const unsigned int shift = static_cast<unsigned int>(me) + 1;
    auto item_at = [&](unsigned int i) -> long long {
        const unsigned int k = i / uw;
        return static_cast<long long>((i - k * uw + shift) % uw) * q + k;
    };
    PushItem next = push_item(item_at(first), n, src_index, extra_index, dest_peer, dest_row);
    for (unsigned int i = first; i < span; i += groups) {
        const PushItem it = next;
        next = push_item(item_at(i + groups), n, src_index, extra_index, dest_peer, dest_row);
        if (it.peer < 0 || it.peer >= W || it.row < lo || it.row >= hi || it.row - lo >= capacity
            || it.src < 0 || it.src >= src_rows)
            continue;
        const V* in = src + static_cast<long long>(it.src) * vec_per_row;
        V* out = reinterpret_cast<V*>(table[field * W + it.peer])
                 + static_cast<long long>(it.row - lo) * vec_per_row;
        for (int v0 = sub; v0 < vec_per_row; v0 += step) {
            V buf[GS_XCHG_UNROLL];
            #pragma unroll
            for (int u = 0; u < GS_XCHG_UNROLL; ++u) {
                const int v = v0 + u * lanes;
                if (v < vec_per_row) buf[u] = in[v];
            }
            #pragma unroll
            for (int u = 0; u < GS_XCHG_UNROLL; ++u) {
                const int v = v0 + u * lanes;
                if (v < vec_per_row) out[v] = buf[u];
            }
        }
        if (sub == 0) {
            unsigned long long b = row_bytes;
            if (extra != nullptr && it.src2 >= 0 && it.src2 < extra_rows) {
                copy_small(reinterpret_cast<unsigned char*>(table[field2 * W + it.peer])
                               + static_cast<long long>(it.row - lo) * elem2,
                           extra + static_cast<long long>(it.src2) * elem2, elem2);
                b += elem2;
            }
            if (it.peer == me) local += b;
            else remote += b;
            ++moved;
        }
    }
    if (remote) atomicAdd(&block_bytes[0], remote);
    if (local) atomicAdd(&block_bytes[1], local);
    if (moved) atomicAdd(&block_rows, static_cast<unsigned long long>(moved));
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        unsigned long long* counters = reinterpret_cast<unsigned long long*>(state);
        if (block_bytes[0]) atomicAdd(counters + GS_XS_ROW_BYTES_REMOTE, block_bytes[0]);
        if (block_bytes[1]) atomicAdd(counters + GS_XS_ROW_BYTES_LOCAL, block_bytes[1]);
        if (block_rows) atomicAdd(counters + GS_XS_ROWS_SENT, block_rows);
    }
}

#define GS_PUSH(N, V)                                                                          \
    extern "C" __global__ void __launch_bounds__(GS_THREADS, GS_XCHG_MIN_BLOCKS)               \
        gs_xchg_push_v##N(const long long* table, long long* state, int W, int me, int field,  \
                          const V* src, int src_rows, const int* src_index,                    \
                          const int* dest_peer, const int* dest_row, const int* count,         \
                          int max_items, int vec_per_row, int lanes_log2, int lo, int hi,      \
                          int capacity, int field2, const unsigned char* extra,                \
                          int extra_rows, const int* extra_index, int elem2) {                 \
        push_impl<V>(table, state, W, me, field, src, src_rows, src_index, dest_peer,          \
                     dest_row, count, max_items, vec_per_row, lanes_log2, lo, hi, capacity,    \
                     field2, extra, extra_rows, extra_index, elem2);                           \
    }
GS_PUSH(16, uint4)
GS_PUSH(8, uint2)
GS_PUSH(4, unsigned int)
GS_PUSH(2, unsigned short)
GS_PUSH(1, unsigned char)

// ---------------------------------------------------------------------------------------
// gs_xchg_flags: one block. Sums the int32 flags[n] (n <= GS_X_MAX_FLAGS) and takes the
// maximum of the int32 peaks[m] (m <= GS_X_MAX_PEAKS; NOTE [step peaks] in graphstash/status.py)
// over the ranks in place: writes both into slot [parity][me] of every rank's FLAGS (parity of
// the coming barrier's epoch, NOTE [exchange signals]; flags at 0..n-1, peaks at
// GS_X_MAX_FLAGS..), barrier, then thread i reduces entry i of every rank (__ldcg) and writes it
// back. After a failed exchange every flag is at least 1 (NOTE [exchange timeout]); the peaks
// are what arrived. No atomics.
// ---------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(GS_THREADS)
    gs_xchg_flags(const long long* __restrict__ table, long long* state, int W, int me,
                  long long timeout_ns, int* flags, int n, int* peaks, int m) {
    constexpr int stride = GS_X_MAX_FLAGS + GS_X_MAX_PEAKS;
    __shared__ long long next_s;
    if (threadIdx.x == 0) {
        next_s = state[GS_XS_EPOCH] + 1;
        state[GS_XS_META_BYTES] += 4LL * W * (n + m);
    }
    __syncthreads();
    const long long parity = next_s & 1;
    const int k = n + m;
    for (int i = threadIdx.x; i < W * k; i += blockDim.x) {
        const int p = i / k, f = i - p * k;
        int* slots = reinterpret_cast<int*>(table[GS_XF_FLAGS * W + p]) + (parity * W + me) * stride;
        if (f < n) slots[f] = flags[f];
        else slots[GS_X_MAX_FLAGS + f - n] = peaks[f - n];
    }
    block_barrier(table, state, W, me, timeout_ns);
    const int* own = reinterpret_cast<const int*>(table[GS_XF_FLAGS * W + me]);
    const bool failed = state[GS_XS_ERROR] != 0;
    for (int f = threadIdx.x; f < n; f += blockDim.x) {
        long long sum = 0;
        for (int s = 0; s < W; ++s) sum += __ldcg(own + (parity * W + s) * stride + f);
        if (failed && sum < 1) sum = 1;
        flags[f] = static_cast<int>(min(sum, GS_INT32_MAX));
    }
    for (int j = threadIdx.x; j < m; j += blockDim.x) {
        int top = __ldcg(own + parity * W * stride + GS_X_MAX_FLAGS + j);
        for (int s = 1; s < W; ++s)
            top = max(top, __ldcg(own + (parity * W + s) * stride + GS_X_MAX_FLAGS + j));
        peaks[j] = top;
    }
}
