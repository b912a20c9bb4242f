// The experts' elementwise work over the permuted buffer, fused and count-aware: the
// activation (plain, or gated: f(gate) * up, gate and up concatenated or interleaved; the kinds
// and constants of NOTE [expert activations] in graphstash/reference/activation.py), the
// per-expert bias of the first GEMM, the router-weight scaling, their backward and the per-row
// dot that is the router weight's gradient.
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

template <typename A>
__device__ __forceinline__ A sigmoid_of(A x) { return acc_div(A(1), acc_add(A(1), acc_exp(-x))); }

// Activation kinds, in the order of graphstash.reference.activation.KINDS (the launcher passes
// the index; tests/test_kernels_compile.py checks the order).
#define GS_ACT_SILU 0
#define GS_ACT_GLU_ALPHA 1
#define GS_ACT_SOFTCAP_SILU 2
#define GS_ACT_GELU 3
#define GS_ACT_GELU_TANH 4
#define GS_ACT_RELU 5
#define GS_ACT_RELU2 6

// SiLU's f(g) and, with GRAD, f'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))): GS_ACT_SILU of
// kind_terms and the whole per-element activation of the PLAIN kernels (NOTE [plain SiLU
// kernels]), so the two compute the same rounded operations in the same order.
template <typename A, bool GRAD>
__device__ __forceinline__ void silu_terms(A g, A& f, A& df) {
    f = silu_of(g);
    if (GRAD) {
        const A sg = acc_div(A(1), acc_add(A(1), acc_exp(-g)));
        df = acc_mul(sg, acc_add(A(1), acc_mul(g, acc_sub(A(1), sg))));
    }
}

// An activation's kind and constants in the accumulator type (each rounded from the double the
// launcher passes, as the reference rounds its constants), and which optional steps apply.
template <typename A>
struct ActParams {
    int kind;
    A alpha, gate_limit, up_limit, up_offset, gate_cap, up_cap;
    bool gate_clamp, up_clamp;
};

template <typename A>
__device__ __forceinline__ ActParams<A> act_params(int kind, double alpha, double gate_limit,
                                                   double up_limit, double up_offset,
                                                   double gate_cap, double up_cap) {
    ActParams<A> p;
    p.kind = kind;
    p.alpha = A(alpha); p.gate_limit = A(gate_limit); p.up_limit = A(up_limit);
    p.up_offset = A(up_offset); p.gate_cap = A(gate_cap); p.up_cap = A(up_cap);
    p.gate_clamp = !isinf(gate_limit);
    p.up_clamp = !isinf(up_limit);
    return p;
}

// f(g) and, with GRAD, f'(g) of the activation kind: the operations and order of _kind_terms
// in graphstash/reference/experts.py (NOTE [expert activation arithmetic]).
template <typename A, bool GRAD>
__device__ __forceinline__ void kind_terms(A g, const ActParams<A>& p, A& f, A& df) {
    switch (p.kind) {
    case GS_ACT_GLU_ALPHA: {
        const A ag = acc_mul(g, p.alpha);
        const A sg = sigmoid_of(ag);
        f = acc_mul(g, sg);
        if (GRAD) df = acc_mul(sg, acc_add(A(1), acc_mul(ag, acc_sub(A(1), sg))));
        break;
    }
    case GS_ACT_SOFTCAP_SILU: {
        const A t = acc_tanh(acc_div(g, p.gate_cap));
        const A c = acc_mul(p.gate_cap, t);
        const A sg = sigmoid_of(g);
        f = acc_mul(c, sg);
        if (GRAD)
            df = acc_add(acc_mul(acc_sub(A(1), acc_mul(t, t)), sg),
                         acc_mul(c, acc_mul(sg, acc_sub(A(1), sg))));
        break;
    }
    case GS_ACT_GELU: {
        const A cdf = acc_mul(A(0.5), acc_add(A(1), acc_erf(acc_mul(g, A(0.7071067811865476)))));
        f = acc_mul(g, cdf);
        if (GRAD)
            df = acc_add(cdf, acc_mul(g, acc_mul(acc_exp(acc_mul(A(-0.5), acc_mul(g, g))),
                                                 A(0.3989422804014327))));
        break;
    }
    case GS_ACT_GELU_TANH: {
        const A beta = A(0.7978845608028654), kappa = A(0.044715), half = A(0.5);
        const A t = acc_tanh(acc_mul(beta, acc_add(g, acc_mul(kappa, acc_mul(acc_mul(g, g), g)))));
        const A hg = acc_mul(half, g);
        f = acc_mul(hg, acc_add(A(1), t));
        if (GRAD)
            df = acc_add(acc_mul(half, acc_add(A(1), t)),
                         acc_mul(hg, acc_mul(acc_sub(A(1), acc_mul(t, t)),
                                             acc_mul(beta, acc_add(A(1), acc_mul(A(3 * 0.044715),
                                                                                 acc_mul(g, g)))))));
        break;
    }
    case GS_ACT_RELU:
        f = g > A(0) ? g : A(0);
        if (GRAD) df = g > A(0) ? A(1) : A(0);
        break;
    case GS_ACT_RELU2: {
        const A r = g > A(0) ? g : A(0);
        f = acc_mul(r, r);
        if (GRAD) df = acc_mul(A(2), r);
        break;
    }
    default:                                            // GS_ACT_SILU
        silu_terms<A, GRAD>(g, f, df);
    }
}

// The gate clamp (min(g, gate_limit); whether the gradient passes) and up's clamp, softcap and
// offset (U; dU, the softcap's derivative, 1 without one; whether the gradient passes), as
// _clamped_gate and _up_terms in graphstash/reference/experts.py.
template <typename A>
__device__ __forceinline__ A clamp_gate(A g, const ActParams<A>& p, bool& passes) {
    passes = true;
    if (!p.gate_clamp) return g;
    passes = g <= p.gate_limit;
    return g > p.gate_limit ? p.gate_limit : g;
}

template <typename A>
__device__ __forceinline__ A up_terms(A u, const ActParams<A>& p, A& du, bool& passes) {
    passes = true;
    du = A(1);
    if (p.up_clamp) {
        const A lim = p.up_limit, neg = -p.up_limit;
        passes = u >= neg && u <= lim;
        u = u > lim ? lim : (u < neg ? neg : u);
    }
    if (p.up_cap != A(0)) {
        const A t = acc_tanh(acc_div(u, p.up_cap));
        u = acc_mul(p.up_cap, t);
        du = acc_sub(A(1), acc_mul(t, t));
    }
    if (p.up_offset != A(0)) u = acc_add(u, p.up_offset);
    return u;
}

// The expert of row r: the first e with ends[e] > r (the last expert for rows past the ends),
// as expert_of_row in graphstash/reference/experts.py. ends: int64 [experts], ascending.
__device__ __forceinline__ long long expert_of(const long long* __restrict__ ends, int experts,
                                               long long r) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (ends[mid] > r) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// Gate and up values of one block of GS_BLOCK elements, j0 <= j < j0 + 8 of a row of width ffn:
// LAYOUT 0 plain (g only), 1 gated [gate | up], 2 gated interleaved [g0 u0 g1 u1 ...].
template <typename T, int LAYOUT, bool VEC>
__device__ __forceinline__ void load_gate_up(const T* __restrict__ row, long long j0, long long ffn,
                                             typename Acc<T>::type g[GS_BLOCK],
                                             typename Acc<T>::type u[GS_BLOCK]) {
    using A = typename Acc<T>::type;
    if (LAYOUT == 2) {
        A t[2 * GS_BLOCK];
        load8<T, VEC>(row, 2 * j0, 2 * ffn, t);
        load8<T, VEC>(row, 2 * j0 + GS_BLOCK, 2 * ffn, t + GS_BLOCK);
        #pragma unroll
        for (int e = 0; e < GS_BLOCK; ++e) { g[e] = t[2 * e]; u[e] = t[2 * e + 1]; }
    } else {
        load8<T, VEC>(row, j0, ffn, g);
        if (LAYOUT == 1) load8<T, VEC>(row + ffn, j0, ffn, u);
    }
}

template <typename T, int LAYOUT, bool VEC>
__device__ __forceinline__ void store_gate_up(T* row, long long j0, long long ffn,
                                              const typename Acc<T>::type (&g)[GS_BLOCK],
                                              const typename Acc<T>::type (&u)[GS_BLOCK]) {
    using A = typename Acc<T>::type;
    if (LAYOUT == 2) {
        A lo[GS_BLOCK], hi[GS_BLOCK];
        #pragma unroll
        for (int e = 0; e < GS_BLOCK / 2; ++e) {
            lo[2 * e] = g[e]; lo[2 * e + 1] = u[e];
            hi[2 * e] = g[e + GS_BLOCK / 2]; hi[2 * e + 1] = u[e + GS_BLOCK / 2];
        }
        store8<T, VEC>(row, 2 * j0, 2 * ffn, lo);
        store8<T, VEC>(row, 2 * j0 + GS_BLOCK, 2 * ffn, hi);
    } else {
        store8<T, VEC>(row, j0, ffn, g);
        if (LAYOUT == 1) store8<T, VEC>(row + ffn, j0, ffn, u);
    }
}

template <typename T, int LAYOUT, bool VEC>
__device__ __forceinline__ void zero_gate_up(T* row, long long j0, long long ffn) {
    using A = typename Acc<T>::type;
    A z[GS_BLOCK];
    #pragma unroll
    for (int e = 0; e < GS_BLOCK; ++e) z[e] = A(0);
    store_gate_up<T, LAYOUT, VEC>(row, j0, ffn, z, z);
}

// The block's gate and up values of pre's row plus, where bias is not null, the bias row of the
// row's expert (added in the accumulator type, before the activation).
template <typename T, int LAYOUT, bool VEC>
__device__ __forceinline__ void load_pre(const T* __restrict__ pre_row, const T* __restrict__ bias_row,
                                         long long j0, long long ffn,
                                         typename Acc<T>::type g[GS_BLOCK],
                                         typename Acc<T>::type u[GS_BLOCK]) {
    using A = typename Acc<T>::type;
    load_gate_up<T, LAYOUT, VEC>(pre_row, j0, ffn, g, u);
    if (bias_row != nullptr) {
        A bg[GS_BLOCK], bu[GS_BLOCK];
        load_gate_up<T, LAYOUT, VEC>(bias_row, j0, ffn, bg, bu);
        #pragma unroll
        for (int e = 0; e < GS_BLOCK; ++e) {
            g[e] = acc_add(g[e], bg[e]);
            if (LAYOUT != 0) u[e] = acc_add(u[e], bu[e]);
        }
    }
}

// The rows an expert kernel's warp walks (gs_loops.cuh) and the geometry of a row: pre is
// [rows, ffn] or, gated, [rows, 2 * ffn]; a row is `blocks` blocks of GS_BLOCK elements.
struct ExpertRows : WarpRows {
    long long pre_stride;   // elements between two rows of pre (and of grad_pre and bias)
    long long blocks;       // GS_BLOCK-element blocks of a row (the last one may be partial)
};

template <int LAYOUT>
__device__ __forceinline__ ExpertRows expert_rows(const long long* __restrict__ live,
                                                  long long rows, long long ffn, int zero_tail) {
    ExpertRows e;
    static_cast<WarpRows&>(e) = warp_rows(live, rows, zero_tail);
    e.pre_stride = LAYOUT != 0 ? 2 * ffn : ffn;
    e.blocks = (ffn + GS_BLOCK - 1) / GS_BLOCK;
    return e;
}

// The activation arguments every expert kernel takes after its own: the kind (GS_ACT_*), six
// constants (NOTE [expert activations]), the first GEMM's per-expert bias [experts, pre width]
// (null: none) and the experts' cumulative row counts ends [experts] (int64; read when bias is
// not null).
#define GS_ACT_ARGS(T)                                                                         \
    int kind, double alpha, double gate_limit, double up_limit, double up_offset,              \
        double gate_cap, double up_cap, const T* __restrict__ bias,                            \
        const long long* __restrict__ ends, int experts
#define GS_ACT_PASS kind, alpha, gate_limit, up_limit, up_offset, gate_cap, up_cap, bias, ends, experts

// NOTE [plain SiLU kernels]: the training path's activation is SiLU (plain) or SwiGLU (gated,
// gate and up concatenated) with no clamp, no softcap or offset on up and no bias; the generic
// per-element code (the kind switch, the clamp tests, the bias row and its expert search) made
// an expert-parallel training step about 3% slower there. Those calls run the kernels compiled
// with PLAIN (gs_expert_silu_*, LAYOUT 0 and 1): per element silu_terms and the products only,
// as before the other kinds existed. They take the generic kernels' arguments and ignore the
// activation ones (kind, constants, bias, ends). Their results equal the generic kernels' with
// GS_ACT_SILU and the default constants bit for bit: every step the generic code adds is then
// an identity (clamp_gate returns g, up_terms returns u with du = 1, both gradients pass) and
// the rest is the same rounded operations in the same order. The launcher
// (graphstash/_kernels/experts.py) picks them; tests/test_experts_gpu.py compares the two.

// ---------------------------------------------------------------------------------------
// gs_expert_act_fwd_<dtype>_g<LAYOUT>_v<W>: out[r, j] = act(pre[r] + bias[e(r)])[j] * w[r] for
// r < live. One warp per row (grid-stride over rows, persistent grid); lane l handles the
// 8-element blocks l, l + 32, ... of the row. pre is [rows, ffn] (LAYOUT 0) or [rows, 2 * ffn]
// (1: gate, then up; 2: gate and up interleaved). w and bias may be null. A row's expert
// (with a bias) is a binary search of ends, once per row. Rows in [live, rows) are written as
// zeros when zero_tail, else not at all. No atomics, no shared memory.
// gs_expert_silu_fwd_<dtype>_g<LAYOUT>_v<W> (PLAIN, LAYOUT 0 and 1): the same with SiLU or
// SwiGLU and no clamp, softcap, offset or bias (NOTE [plain SiLU kernels]).
// ---------------------------------------------------------------------------------------
template <typename T, int LAYOUT, bool VEC, bool PLAIN>
__device__ void act_fwd_impl(T* __restrict__ out, const T* __restrict__ pre,
                             const T* __restrict__ row_weight, const long long* __restrict__ live,
                             long long rows, long long ffn, int zero_tail, GS_ACT_ARGS(T)) {
    static_assert(!PLAIN || LAYOUT != 2, "no SiLU kernel for interleaved gate and up");
    using A = typename Acc<T>::type;
    const ActParams<A> p = act_params<A>(kind, alpha, gate_limit, up_limit, up_offset, gate_cap,
                                         up_cap);
    const ExpertRows w = expert_rows<LAYOUT>(live, rows, ffn, zero_tail);
    for (long long r = w.first; r < w.end; r += w.step) {
        T* o = out + r * ffn;
        if (r >= w.live) {
            for (long long b = w.lane; b < w.blocks; b += 32) zero8<T, VEC>(o, b * GS_BLOCK, ffn);
            continue;
        }
        const T* g_row = pre + r * w.pre_stride;
        const T* b_row = !PLAIN && bias != nullptr            // PLAIN: no bias row, no search
                             ? bias + expert_of(ends, experts, r) * w.pre_stride : nullptr;
        const bool weighted = row_weight != nullptr;
        const A scale = weighted ? to_acc(row_weight[r]) : A(1);
        #pragma unroll 2
        for (long long b = w.lane; b < w.blocks; b += 32) {
            const long long j0 = b * GS_BLOCK;
            A g[GS_BLOCK], u[GS_BLOCK], a[GS_BLOCK];
            load_pre<T, LAYOUT, VEC>(g_row, b_row, j0, ffn, g, u);
            #pragma unroll
            for (int e = 0; e < GS_BLOCK; ++e) {
                A f, df;
                if (PLAIN) {                            // silu(g), silu(g) * u
                    silu_terms<A, false>(g[e], f, df);
                    if (LAYOUT != 0) f = acc_mul(f, u[e]);
                } else {
                    bool passes;
                    kind_terms<A, false>(clamp_gate(g[e], p, passes), p, f, df);
                    if (LAYOUT != 0) {
                        A du;
                        f = acc_mul(f, up_terms(u[e], p, du, passes));
                    }
                }
                a[e] = weighted ? acc_mul(f, scale) : f;
            }
            store8<T, VEC>(o, j0, ffn, a);
        }
    }
}

// ---------------------------------------------------------------------------------------
// gs_expert_act_bwd_<dtype>_g<LAYOUT>_v<W>: for r < live, from grad_out [rows, ffn]:
// grad_pre[r] (the gradient of pre + bias; gated: gate and up laid out as pre) and, when
// grad_row is not null, grad_row[r] = <grad_out[r], act(pre[r] + bias[e(r)])> (accumulator
// type; NOTE [row dot order]: each lane sums its blocks' rounded products in order, then a
// shuffle-down tree; lane 0 writes). Same mapping as the forward; rows in [live, rows) get
// zeros when zero_tail, else nothing. When act_out is not null it also gets the forward's
// output, recomputed: act_out[r] = act(pre[r] + bias[e(r)]) * w[r], rounded as the forward
// rounds it (gs_expert_act_fwd writes the same bits), so the second GEMM's weight gradient
// needs no separate recomputation pass. grad_pre may be pre itself and act_out may be
// grad_out itself (NOTE [expert backward temporaries] in graphstash/moe/mlp.py): the lane that
// writes an element of grad_pre (both halves when gated) or of act_out has read the elements
// of pre and grad_out it needs in the same step, and no lane reads an element another lane
// writes; those pointers are therefore not __restrict__.
// gs_expert_silu_bwd_<dtype>_g<LAYOUT>_v<W> (PLAIN, LAYOUT 0 and 1): the same with SiLU or
// SwiGLU and no clamp, softcap, offset or bias (NOTE [plain SiLU kernels]).
// ---------------------------------------------------------------------------------------
template <typename T, int LAYOUT, bool VEC, bool PLAIN>
__device__ void act_bwd_impl(T* grad_pre, typename Acc<T>::type* __restrict__ grad_row,
                             T* act_out, const T* grad_out, const T* pre,
                             const T* __restrict__ row_weight, const long long* __restrict__ live,
                             long long rows, long long ffn, int zero_tail, GS_ACT_ARGS(T)) {
    static_assert(!PLAIN || LAYOUT != 2, "no SiLU kernel for interleaved gate and up");
    using A = typename Acc<T>::type;
    const ActParams<A> p = act_params<A>(kind, alpha, gate_limit, up_limit, up_offset, gate_cap,
                                         up_cap);
    const ExpertRows w = expert_rows<LAYOUT>(live, rows, ffn, zero_tail);
    for (long long r = w.first; r < w.end; r += w.step) {
        T* gp = grad_pre + r * w.pre_stride;
        if (r >= w.live) {
            for (long long b = w.lane; b < w.blocks; b += 32) {
                zero_gate_up<T, LAYOUT, VEC>(gp, b * GS_BLOCK, ffn);
                if (act_out != nullptr) zero8<T, VEC>(act_out + r * ffn, b * GS_BLOCK, ffn);
            }
            if (grad_row != nullptr && w.lane == 0) grad_row[r] = A(0);
            continue;
        }
        const T* g_row = pre + r * w.pre_stride;
        const T* b_row = !PLAIN && bias != nullptr            // PLAIN: no bias row, no search
                             ? bias + expert_of(ends, experts, r) * w.pre_stride : nullptr;
        const T* go_row = grad_out + r * ffn;
        const bool weighted = row_weight != nullptr;
        const A scale = weighted ? to_acc(row_weight[r]) : A(1);
        T* act_row = act_out != nullptr ? act_out + r * ffn : nullptr;
        A dot = A(0);
        #pragma unroll 2
        for (long long b = w.lane; b < w.blocks; b += 32) {
            const long long j0 = b * GS_BLOCK;
            A g[GS_BLOCK], u[GS_BLOCK], ga[GS_BLOCK], dg[GS_BLOCK], a[GS_BLOCK];
            load_pre<T, LAYOUT, VEC>(g_row, b_row, j0, ffn, g, u);
            load8<T, VEC>(go_row, j0, ffn, ga);
            #pragma unroll
            for (int e = 0; e < GS_BLOCK; ++e) {
                bool g_passes = true, u_passes = true;
                A f, df, up = A(1), du = A(1);
                if (PLAIN) {                            // no clamp, softcap or offset
                    silu_terms<A, true>(g[e], f, df);
                    if (LAYOUT != 0) up = u[e];
                } else {
                    kind_terms<A, true>(clamp_gate(g[e], p, g_passes), p, f, df);
                    if (LAYOUT != 0) up = up_terms(u[e], p, du, u_passes);
                }
                a[e] = LAYOUT != 0 ? acc_mul(f, up) : f;        // the forward's activation
                if (grad_row != nullptr && j0 + e < ffn) dot = acc_add(dot, acc_mul(ga[e], a[e]));
                if (weighted) a[e] = acc_mul(a[e], scale);  // ... and its output
                const A gw = weighted ? acc_mul(ga[e], scale) : ga[e];
                if (LAYOUT != 0) {
                    dg[e] = acc_mul(acc_mul(gw, up), df);
                    A gu = acc_mul(gw, f);                  // the up projection's gradient
                    if (!PLAIN && p.up_cap != A(0)) gu = acc_mul(gu, du);
                    u[e] = u_passes ? gu : A(0);
                } else {
                    dg[e] = acc_mul(gw, df);
                }
                if (!g_passes) dg[e] = A(0);
            }
            store_gate_up<T, LAYOUT, VEC>(gp, j0, ffn, dg, u);
            if (act_row != nullptr) store8<T, VEC>(act_row, j0, ffn, a);
        }
        if (grad_row != nullptr) {
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot = acc_add(dot, __shfl_down_sync(0xffffffffu, dot, o));
            if (w.lane == 0) grad_row[r] = dot;
        }
    }
}

// gs_expert_<OP>_{fwd,bwd}_<NAME>_g<LAYOUT>_v<W>: OP act (any kind, PLAIN false) or silu
// (PLAIN true, NOTE [plain SiLU kernels]); both take the same arguments.
#define GS_EXPERT_KERNELS(OP, PLAIN, NAME, T, LAYOUT, VEC, W)                                  \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_expert_##OP##_fwd_##NAME##_g##LAYOUT##_v##W(                                        \
            T* out, const T* pre, const T* row_weight, const long long* live, long long rows,  \
            long long ffn, int zero_tail, GS_ACT_ARGS(T)) {                                    \
        act_fwd_impl<T, LAYOUT, VEC, PLAIN>(out, pre, row_weight, live, rows, ffn, zero_tail,  \
                                            GS_ACT_PASS);                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GS_THREADS)                                   \
        gs_expert_##OP##_bwd_##NAME##_g##LAYOUT##_v##W(                                        \
            T* grad_pre, Acc<T>::type* grad_row, T* act_out, const T* grad_out, const T* pre,  \
            const T* row_weight, const long long* live, long long rows, long long ffn,         \
            int zero_tail, GS_ACT_ARGS(T)) {                                                   \
        act_bwd_impl<T, LAYOUT, VEC, PLAIN>(grad_pre, grad_row, act_out, grad_out, pre,        \
                                            row_weight, live, rows, ffn, zero_tail,            \
                                            GS_ACT_PASS);                                      \
    }
// Per dtype (element size SIZE bytes, GS_BLOCK * SIZE = PACK): plain, gated and gated
// interleaved, element by element (W = SIZE) and in GS_BLOCK-element packs (W = PACK), any
// kind; plain and gated again for SiLU / SwiGLU alone (no interleaved one: the layout of
// GPT-OSS, whose activation is clamped).
#define GS_EXPERT_DTYPE(NAME, T, SIZE, PACK)                                                   \
    static_assert(sizeof(T) == SIZE && PACK == GS_BLOCK * SIZE, "W of the " #NAME " kernels"); \
    GS_EXPERT_KERNELS(act, false, NAME, T, 0, 0, SIZE)                                         \
    GS_EXPERT_KERNELS(act, false, NAME, T, 0, 1, PACK)                                         \
    GS_EXPERT_KERNELS(act, false, NAME, T, 1, 0, SIZE)                                         \
    GS_EXPERT_KERNELS(act, false, NAME, T, 1, 1, PACK)                                         \
    GS_EXPERT_KERNELS(act, false, NAME, T, 2, 0, SIZE)                                         \
    GS_EXPERT_KERNELS(act, false, NAME, T, 2, 1, PACK)                                         \
    GS_EXPERT_KERNELS(silu, true, NAME, T, 0, 0, SIZE)                                         \
    GS_EXPERT_KERNELS(silu, true, NAME, T, 0, 1, PACK)                                         \
    GS_EXPERT_KERNELS(silu, true, NAME, T, 1, 0, SIZE)                                         \
    GS_EXPERT_KERNELS(silu, true, NAME, T, 1, 1, PACK)

GS_EXPERT_DTYPE(bf16, Bf16, 2, 16)
GS_EXPERT_DTYPE(f16, F16, 2, 16)
GS_EXPERT_DTYPE(f32, float, 4, 32)
GS_EXPERT_DTYPE(f64, double, 8, 64)
