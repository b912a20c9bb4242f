// The experts' elementwise work over the permuted buffer, fused and count-aware: the
// activation (SiLU, or SwiGLU's silu(gate) * up), the router-weight scaling, their backward
// and the per-row dot that is the router weight's gradient.
//
// NOTE [count-aware expert kernels] (graphstash/moe/mlp.py): every kernel reads the live row
// count from the device once and touches only rows below it, so budget rows past the count
// cost no time; with zero_tail it writes zeros there instead (for a consumer that reads them).
// The arithmetic is NOTE [expert activation arithmetic] in graphstash/reference/experts.py,
// rounded as NOTE [exact arithmetic] (gs_dtype.cuh) says, so results equal the reference bit
// for bit; the row dot follows NOTE [row dot order] there.
#include "gs_loops.cuh"

#define GS_BLOCK 8              // elements a lane handles together (NOTE [row dot order])

#include "gs_dtype.cuh"

// 8 consecutive elements of a row, starting at element j0 < n, into the accumulator type:
// one aligned pack when VEC (n % 8 == 0 and 8-element-aligned base pointers), else element by
// element with zeros past n.
template <typename T, bool VEC>
__device__ __forceinline__ void load8(const T* __restrict__ p, long long j0, long long n,
                                      typename Acc<T>::type v[GS_BLOCK]) {
    if (VEC) {
        const Pack<T, GS_BLOCK> pk = *reinterpret_cast<const Pack<T, GS_BLOCK>*>(p + j0);
        #pragma unroll
        for (int e = 0; e < GS_BLOCK; ++e) v[e] = to_acc(pk.v[e]);
    } else {
        #pragma unroll
        for (int e = 0; e < GS_BLOCK; ++e)
            v[e] = j0 + e < n ? to_acc(p[j0 + e]) : typename Acc<T>::type(0);
    }
}

template <typename T, bool VEC>
__device__ __forceinline__ void store8(T* __restrict__ p, long long j0, long long n,
                                       const typename Acc<T>::type (&v)[GS_BLOCK]) {
    if (VEC) {
        *reinterpret_cast<Pack<T, GS_BLOCK>*>(p + j0) = to_pack<T, GS_BLOCK>(v);
    } else {
        #pragma unroll
        for (int e = 0; e < GS_BLOCK; ++e)
            if (j0 + e < n) p[j0 + e] = from_acc<T>(v[e]);
    }
}

template <typename T, bool VEC>
__device__ __forceinline__ void zero8(T* __restrict__ p, long long j0, long long n) {
    typename Acc<T>::type z[GS_BLOCK];
    #pragma unroll
    for (int e = 0; e < GS_BLOCK; ++e) z[e] = typename Acc<T>::type(0);
    store8<T, VEC>(p, j0, n, z);
}

template <typename A>
__device__ __forceinline__ A silu_of(A g) { return acc_div(g, acc_add(A(1), acc_exp(-g))); }

// The rows an expert kernel's warp walks (gs_loops.cuh) and the geometry of a row: pre is
// [rows, ffn] or, gated, [rows, 2 * ffn]; a row is `blocks` blocks of GS_BLOCK elements.
struct ExpertRows : WarpRows {
    long long pre_stride;   // elements between two rows of pre (and of grad_pre)
    long long blocks;       // GS_BLOCK-element blocks of a row (the last one may be partial)
};

template <bool GATED>
__device__ __forceinline__ ExpertRows expert_rows(const long long* __restrict__ live,
                                                  long long rows, long long ffn, int zero_tail) {
    ExpertRows e;
    static_cast<WarpRows&>(e) = warp_rows(live, rows, zero_tail);
    e.pre_stride = GATED ? 2 * ffn : ffn;
    e.blocks = (ffn + GS_BLOCK - 1) / GS_BLOCK;
    return e;
}

// ---------------------------------------------------------------------------------------
// gs_expert_act_fwd_<dtype>_g<GATED>_v<W>: out[r, j] = act(pre[r])[j] * w[r] for r < live.
// One warp per row (grid-stride over rows, persistent grid); lane l handles the 8-element
// blocks l, l + 32, ... of the row. pre is [rows, ffn] or, gated, [rows, 2 * ffn] (gate, then
// up). w may be null (weight 1). Rows in [live, rows) are written as zeros when zero_tail,
// else not at all. No atomics, no shared memory.
// ---------------------------------------------------------------------------------------
template <typename T, bool GATED, bool VEC>
__device__ void act_fwd_impl(T* __restrict__ out, const T* __restrict__ pre,
                             const T* __restrict__ row_weight, const long long* __restrict__ live,
                             long long rows, long long ffn, int zero_tail) {
    using A = typename Acc<T>::type;
    const ExpertRows w = expert_rows<GATED>(live, rows, ffn, zero_tail);
    for (long long r = w.first; r < w.end; r += w.step) {
        T* o = out + r * ffn;
        if (r >= w.live) {
            for (long long b = w.lane; b < w.blocks; b += 32) zero8<T, VEC>(o, b * GS_BLOCK, ffn);
            continue;
        }
        const T* g_row = pre + r * w.pre_stride;
        const bool weighted = row_weight != nullptr;
        const A scale = weighted ? to_acc(row_weight[r]) : A(1);
        #pragma unroll 2
        for (long long b = w.lane; b < w.blocks; b += 32) {
            const long long j0 = b * GS_BLOCK;
            A g[GS_BLOCK], a[GS_BLOCK];
            load8<T, VEC>(g_row, j0, ffn, g);
            if (GATED) {
                A u[GS_BLOCK];
                load8<T, VEC>(g_row + ffn, j0, ffn, u);
                #pragma unroll
                for (int e = 0; e < GS_BLOCK; ++e) a[e] = acc_mul(silu_of(g[e]), u[e]);
            } else {
                #pragma unroll
                for (int e = 0; e < GS_BLOCK; ++e) a[e] = silu_of(g[e]);
            }
            if (weighted) {
                #pragma unroll
                for (int e = 0; e < GS_BLOCK; ++e) a[e] = acc_mul(a[e], scale);
            }
            store8<T, VEC>(o, j0, ffn, a);
        }
    }
}

// ---------------------------------------------------------------------------------------
// gs_expert_act_bwd_<dtype>_g<GATED>_v<W>: for r < live, from grad_out [rows, ffn]:
// grad_pre[r] (gated: [grad_gate | grad_up]) and, when grad_row is not null,
// grad_row[r] = <grad_out[r], act(pre[r])> (accumulator type; NOTE [row dot order]: each lane
// sums its blocks' rounded products in order, then a shuffle-down tree; lane 0 writes).
// Same mapping as the forward; rows in [live, rows) get zeros when zero_tail, else nothing.
// When act_out is not null it also gets the forward's output, recomputed: act_out[r] =
// act(pre[r]) * w[r], rounded as the forward rounds it (gs_expert_act_fwd writes the same
// bits), so the second GEMM's weight gradient needs no separate recomputation pass.
// grad_pre may be pre itself and act_out may be grad_out itself (NOTE [expert backward
// temporaries] in graphstash/moe/mlp.py): the lane that writes an element of grad_pre (both
// halves when gated) or of act_out has read the elements of pre and grad_out it needs in the
// same step, and no lane reads an element another lane writes; those pointers are therefore
// not __restrict__.
// ---------------------------------------------------------------------------------------
template <typename T, bool GATED, bool VEC>
__device__ void act_bwd_impl(T* grad_pre, typename Acc<T>::type* __restrict__ grad_row,
                             T* act_out, const T* grad_out, const T* pre,
                             const T* __restrict__ row_weight, const long long* __restrict__ live,
                             long long rows, long long ffn, int zero_tail) {
    using A = typename Acc<T>::type;
    const ExpertRows w = expert_rows<GATED>(live, rows, ffn, zero_tail);
    for (long long r = w.first; r < w.end; r += w.step) {
        T* gp = grad_pre + r * w.pre_stride;
        if (r >= w.live) {
            for (long long b = w.lane; b < w.blocks; b += 32) {
                zero8<T, VEC>(gp, b * GS_BLOCK, ffn);
                if (GATED) zero8<T, VEC>(gp + ffn, b * GS_BLOCK, ffn);
                if (act_out != nullptr) zero8<T, VEC>(act_out + r * ffn, b * GS_BLOCK, ffn);
            }
            if (grad_row != nullptr && w.lane == 0) grad_row[r] = A(0);
            continue;
        }
        const T* g_row = pre + r * w.pre_stride;
        const T* go_row = grad_out + r * ffn;
        const bool weighted = row_weight != nullptr;
        const A scale = weighted ? to_acc(row_weight[r]) : A(1);
        T* act_row = act_out != nullptr ? act_out + r * ffn : nullptr;
        A dot = A(0);
        #pragma unroll 2
        for (long long b = w.lane; b < w.blocks; b += 32) {
            const long long j0 = b * GS_BLOCK;
            A g[GS_BLOCK], u[GS_BLOCK], ga[GS_BLOCK], dg[GS_BLOCK], a[GS_BLOCK];
            load8<T, VEC>(g_row, j0, ffn, g);
            load8<T, VEC>(go_row, j0, ffn, ga);
            if (GATED) load8<T, VEC>(g_row + ffn, j0, ffn, u);
            #pragma unroll
            for (int e = 0; e < GS_BLOCK; ++e) {
                const A s = silu_of(g[e]);
                const A sg = acc_div(A(1), acc_add(A(1), acc_exp(-g[e])));
                const A ds = acc_mul(sg, acc_add(A(1), acc_mul(g[e], acc_sub(A(1), sg))));
                a[e] = GATED ? acc_mul(s, u[e]) : s;        // the forward's activation
                if (grad_row != nullptr && j0 + e < ffn) dot = acc_add(dot, acc_mul(ga[e], a[e]));
                if (weighted) a[e] = acc_mul(a[e], scale);  // ... and its output
                const A gw = weighted ? acc_mul(ga[e], scale) : ga[e];
                if (GATED) {
                    dg[e] = acc_mul(acc_mul(gw, u[e]), ds);
                    u[e] = acc_mul(gw, s);              // the up projection's gradient
                } else {
                    dg[e] = acc_mul(gw, ds);
                }
            }
            store8<T, VEC>(gp, j0, ffn, dg);
            if (GATED) store8<T, VEC>(gp + ffn, j0, ffn, u);
            if (act_row != nullptr) store8<T, VEC>(act_row, j0, ffn, a);
        }
        if (grad_row != nullptr) {
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot = acc_add(dot, __shfl_down_sync(0xffffffffu, dot, o));
            if (w.lane == 0) grad_row[r] = dot;
        }
    }
}

#define GS_EXPERT_KERNELS(NAME, T, GATED, VEC, W)                                              \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_expert_act_fwd_##NAME##_g##GATED##_v##W(                                            \
            T* out, const T* pre, const T* row_weight, const long long* live, long long rows,  \
            long long ffn, int zero_tail) {                                                    \
        act_fwd_impl<T, GATED, VEC>(out, pre, row_weight, live, rows, ffn, zero_tail);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_expert_act_bwd_##NAME##_g##GATED##_v##W(                                            \
            T* grad_pre, Acc<T>::type* grad_row, T* act_out, const T* grad_out, const T* pre,  \
            const T* row_weight, const long long* live, long long rows, long long ffn,         \
            int zero_tail) {                                                                   \
        act_bwd_impl<T, GATED, VEC>(grad_pre, grad_row, act_out, grad_out, pre, row_weight,    \
                                    live, rows, ffn, zero_tail);                               \
    }
// Per dtype (element size SIZE bytes, GS_BLOCK * SIZE = PACK): plain and gated, element by
// element (W = SIZE) and in GS_BLOCK-element packs (W = PACK).
#define GS_EXPERT_DTYPE(NAME, T, SIZE, PACK)                                                   \
    static_assert(sizeof(T) == SIZE && PACK == GS_BLOCK * SIZE, "W of the " #NAME " kernels"); \
    GS_EXPERT_KERNELS(NAME, T, 0, 0, SIZE)                                                     \
    GS_EXPERT_KERNELS(NAME, T, 0, 1, PACK)                                                     \
    GS_EXPERT_KERNELS(NAME, T, 1, 0, SIZE)                                                     \
    GS_EXPERT_KERNELS(NAME, T, 1, 1, PACK)

GS_EXPERT_DTYPE(bf16, Bf16, 2, 16)
GS_EXPERT_DTYPE(f16, F16, 2, 16)
GS_EXPERT_DTYPE(f32, float, 4, 32)
GS_EXPERT_DTYPE(f64, double, 8, 64)
