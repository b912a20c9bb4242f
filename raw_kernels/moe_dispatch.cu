// MoE token dispatch and combine: move token rows between the token order and the
// expert-grouped (permuted) order of a static-budget buffer.
//
// The routing metadata (counts per expert, padded offsets, each pair's destination row and
// its inverse) is computed on the device by graphstash.moe before these kernels run; the
// kernels only move and reduce rows, so every launch has a static shape and never reads
// anything back to the host.
//
// The weighted sums follow NOTE [exact arithmetic] (gs_dtype.cuh), slot by slot in k order;
// graphstash/reference/moe.py performs the same operations in the same order, so GPU and
// reference results agree bit for bit.
#include "gs_loops.cuh"

#include "gs_dtype.cuh"

// ---------------------------------------------------------------------------------------
// gs_moe_gather_v<W>: dst[i] = index[i] >= 0 ? src[index[i]] : 0, a bitwise row copy.
// Grid-stride over the flat (row, vector) space of dst, W-byte vectors, 64-bit offsets; each
// dst element is written exactly once (zero for rows without a source: padding, budget tail,
// dropped). No atomics; index is read once per vector (cached).
// ---------------------------------------------------------------------------------------
template <typename V, bool Keep>
__device__ void gather_impl(V* __restrict__ dst, const V* __restrict__ src,
                            const int* __restrict__ index, long long rows_out,
                            long long vec_per_row, long long src_rows) {
    const ThreadItems t = thread_items();
    for (long long v = t.first; v < rows_out * vec_per_row; v += t.step) {
        const long long row = v / vec_per_row;
        const long long col = v - row * vec_per_row;
        const int j = __ldg(index + row);
        const bool sourced = j >= 0 && j < src_rows;
        if (Keep && !sourced) continue;
        V value{};
        if (sourced) value = src[static_cast<long long>(j) * vec_per_row + col];
        dst[v] = value;
    }
}

// gs_moe_place_v<W>: dst[i] = src[index[i]] where index[i] is a source row; every other row
// of dst is left as it is (where the gather zeroes it). Two calls fill one buffer from two
// sources: the resend's copy-out takes the received rows from the region and a rank's own
// rows straight from its tokens (NOTE [resent own rows] in graphstash/moe/exchange/autograd.py).
#define GS_GATHER(NAME, KEEP, W, V)                                                            \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_moe_##NAME##_v##W(V* dst, const V* src, const int* index, long long rows_out,       \
                             long long vec_per_row, long long src_rows) {                      \
        gather_impl<V, KEEP>(dst, src, index, rows_out, vec_per_row, src_rows);                \
    }
GS_GATHER(gather, false, 16, uint4)
GS_GATHER(gather, false, 8, uint2)
GS_GATHER(gather, false, 4, unsigned int)
GS_GATHER(gather, false, 2, unsigned short)
GS_GATHER(gather, false, 1, unsigned char)
GS_GATHER(place, true, 16, uint4)
GS_GATHER(place, true, 8, uint2)
GS_GATHER(place, true, 4, unsigned int)
GS_GATHER(place, true, 2, unsigned short)
GS_GATHER(place, true, 1, unsigned char)

// ---------------------------------------------------------------------------------------
// gs_moe_spread_v<W>: the same result as gs_moe_gather_v<W> (dst[i] = src[index[i]], zero
// where index[i] is no source row), computed from the inverse map: inverse[j, k] is the dst
// row fed by source row j in its slot k (-1: none), and every row i with a source appears
// there exactly once.
//
// NOTE [spread rows]: a gather reads a source row once per destination (K times for a token
// routed to K experts), so at MoE widths it is bound by L2 traffic (91 % of L2 throughput
// under ncu, 113 us for 65536 rows of 4 KiB on an H200). Here a warp owns a source row,
// reads it once (U vectors per lane in flight) and writes it to its K destinations, and the
// rows without a source are zeroed by a warp-per-row pass: 87 us, against 81 us for zeroing
// the same bytes (docs/moe-performance.md, change 9). Each dst element is written exactly
// once, bitwise, so the result equals the gather's; no atomics. K <= 32 (the launcher falls
// back to the gather above that).
// ---------------------------------------------------------------------------------------
template <typename V, int U>
__device__ void spread_impl(V* __restrict__ dst, const V* __restrict__ src,
                            const int* __restrict__ index, const int* __restrict__ inverse,
                            int K, long long rows_out, long long vec_per_row,
                            long long src_rows) {
    const int lane = threadIdx.x & 31;
    const long long first = static_cast<long long>(blockIdx.x) * GS_WARPS + (threadIdx.x >> 5);
    const long long warps = static_cast<long long>(gridDim.x) * GS_WARPS;
    for (long long j = first; j < src_rows; j += warps) {
        int my_row = lane < K ? __ldg(inverse + j * K + lane) : -1;
        if (my_row >= rows_out) my_row = -1;
        if (__ballot_sync(0xffffffffu, my_row >= 0) == 0u) continue;    // nothing to feed
        const V* s = src + j * vec_per_row;
        // every lane runs every step (the shuffles need the whole warp), masked past the row
        for (long long c0 = 0; c0 < vec_per_row; c0 += 32 * U) {
            V v[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const long long c = c0 + 32 * u + lane;
                if (c < vec_per_row) v[u] = s[c];
            }
            for (int k = 0; k < K; ++k) {
                const int row = __shfl_sync(0xffffffffu, my_row, k);
                if (row < 0) continue;
                V* d = dst + static_cast<long long>(row) * vec_per_row;
                #pragma unroll
                for (int u = 0; u < U; ++u) {
                    const long long c = c0 + 32 * u + lane;
                    if (c < vec_per_row) d[c] = v[u];
                }
            }
        }
    }
    for (long long i = first; i < rows_out; i += warps) {      // rows without a source
        const int j = __ldg(index + i);
        if (j >= 0 && j < src_rows) continue;
        V* d = dst + i * vec_per_row;
        for (long long c = lane; c < vec_per_row; c += 32) d[c] = V{};
    }
}

#define GS_SPREAD(W, V)                                                                        \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_moe_spread_v##W(V* dst, const V* src, const int* index, const int* inverse, int K,  \
                           long long rows_out, long long vec_per_row, long long src_rows) {    \
        spread_impl<V, 4>(dst, src, index, inverse, K, rows_out, vec_per_row, src_rows);       \
    }
GS_SPREAD(16, uint4)
GS_SPREAD(8, uint2)
GS_SPREAD(4, unsigned int)
GS_SPREAD(2, unsigned short)
GS_SPREAD(1, unsigned char)

// ---------------------------------------------------------------------------------------
// gs_moe_combine_<dtype>_v<W>: dst[i] = sum_k weight[i, k] * src[index[i, k]] over the K
// slots of row i with index >= 0 (weight == nullptr means 1). Grid-stride over the flat
// (row, pack) space of dst, N elements (W bytes) per pack; each dst pack is written once, accumulated
// in registers in k order (NOTE [exact arithmetic]). No atomics.
// ---------------------------------------------------------------------------------------
template <typename T, int N>
__device__ void combine_impl(T* __restrict__ dst, const T* __restrict__ src,
                             const int* __restrict__ index,
                             const typename Acc<T>::type* __restrict__ weight, int K,
                             long long rows_out, long long hidden, long long src_rows) {
    using A = typename Acc<T>::type;
    using P = Pack<T, N>;
    const long long packs_per_row = hidden / N;
    const ThreadItems t = thread_items();
    for (long long v = t.first; v < rows_out * packs_per_row; v += t.step) {
        const long long row = v / packs_per_row;
        const long long col = v - row * packs_per_row;
        A acc[N];
        #pragma unroll
        for (int e = 0; e < N; ++e) acc[e] = A(0);
        for (int k = 0; k < K; ++k) {
            const int j = __ldg(index + row * K + k);
            if (j < 0 || j >= src_rows) continue;
            const P p = reinterpret_cast<const P*>(src + static_cast<long long>(j) * hidden)[col];
            if (weight != nullptr) {
                const A w = weight[row * K + k];
                #pragma unroll
                for (int e = 0; e < N; ++e) acc[e] = acc_add(acc[e], acc_mul(w, to_acc(p.v[e])));
            } else {
                #pragma unroll
                for (int e = 0; e < N; ++e) acc[e] = acc_add(acc[e], to_acc(p.v[e]));
            }
        }
        reinterpret_cast<P*>(dst + row * hidden)[col] = to_pack<T, N>(acc);   // NOTE [paired rounding]
    }
}

// ---------------------------------------------------------------------------------------
// gs_moe_weight_grad_<dtype>: out[p] = sum_h grad[p / K, h] * src[index[p], h] (0 when
// index[p] < 0), the router-weight gradient of combine. One warp per pair p, grid-stride
// over pairs; lanes stride the row (coalesced), then a fixed shuffle tree reduces, so the
// result is deterministic. Lane 0 writes out[p] (accumulator dtype). No atomics.
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ void weight_grad_impl(typename Acc<T>::type* __restrict__ out,
                                 const T* __restrict__ grad, const T* __restrict__ src,
                                 const int* __restrict__ index, int K, long long pairs,
                                 long long hidden, long long src_rows) {
    using A = typename Acc<T>::type;
    const int lane = threadIdx.x & 31;
    const long long warps = static_cast<long long>(gridDim.x) * GS_WARPS;
    for (long long p = static_cast<long long>(blockIdx.x) * GS_WARPS + (threadIdx.x >> 5);
         p < pairs; p += warps) {
        const int j = index[p];
        A acc = A(0);
        if (j >= 0 && j < src_rows) {
            const T* g = grad + (p / K) * hidden;
            const T* s = src + static_cast<long long>(j) * hidden;
            for (long long h = lane; h < hidden; h += 32)
                acc = acc_add(acc, acc_mul(to_acc(g[h]), to_acc(s[h])));
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc = acc_add(acc, __shfl_down_sync(0xffffffffu, acc, o));
        if (lane == 0) out[p] = acc;
    }
}

#define GS_COMBINE(NAME, T, N, W)                                                              \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_moe_combine_##NAME##_v##W(T* dst, const T* src, const int* index,                   \
                                     const Acc<T>::type* weight, int K, long long rows_out,    \
                                     long long hidden, long long src_rows) {                   \
        combine_impl<T, N>(dst, src, index, weight, K, rows_out, hidden, src_rows);            \
    }
#define GS_WEIGHT_GRAD(NAME, T)                                                                \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_moe_weight_grad_##NAME(Acc<T>::type* out, const T* grad, const T* src,              \
                                  const int* index, int K, long long pairs, long long hidden,  \
                                  long long src_rows) {                                        \
        weight_grad_impl<T>(out, grad, src, index, K, pairs, hidden, src_rows);               \
    }

// One combine per dtype and pack: N elements of W = 16 bytes, or single elements (W = the
// element size) when the row width or a base address does not allow them; one
// weight-gradient kernel per dtype.
GS_COMBINE(bf16, Bf16, 8, 16)
GS_COMBINE(bf16, Bf16, 1, 2)
GS_COMBINE(f16, F16, 8, 16)
GS_COMBINE(f16, F16, 1, 2)
GS_COMBINE(f32, float, 4, 16)
GS_COMBINE(f32, float, 1, 4)
GS_COMBINE(f64, double, 2, 16)
GS_COMBINE(f64, double, 1, 8)
GS_WEIGHT_GRAD(bf16, Bf16)
GS_WEIGHT_GRAD(f16, F16)
GS_WEIGHT_GRAD(f32, float)
GS_WEIGHT_GRAD(f64, double)
