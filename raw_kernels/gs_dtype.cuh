// Storage types, accumulators and exactly rounded arithmetic shared by the MoE kernels.
//
// NOTE [exact arithmetic]: the kernels that must agree bit for bit with graphstash/reference
// compute in the accumulator type (float for 16-bit and float data, double for double) with
// explicitly rounded operations (__fmul_rn, __fadd_rn, ...: no FMA contraction), in the order
// the reference's torch operations use, and round once to the storage type with
// round-to-nearest-even.
#pragma once

struct Bf16 { unsigned short bits; };
struct F16 { unsigned short bits; };

__device__ __forceinline__ float to_acc(Bf16 v) {
    return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}
__device__ __forceinline__ float to_acc(F16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v);
template <> __device__ __forceinline__ Bf16 from_acc<Bf16>(float f) {
    unsigned int u = __float_as_uint(f);
    Bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.bits = 0x7fc0; return r; }   // NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                       // round to nearest even
    r.bits = static_cast<unsigned short>(u >> 16);
    return r;
}
template <> __device__ __forceinline__ F16 from_acc<F16>(float f) {
    F16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
    return r;
}
template <> __device__ __forceinline__ float from_acc<float>(float f) { return f; }
template <> __device__ __forceinline__ double from_acc<double>(double f) { return f; }

__device__ __forceinline__ float acc_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float acc_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double acc_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double acc_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float acc_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double acc_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float acc_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double acc_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float acc_exp(float a) { return expf(a); }
__device__ __forceinline__ double acc_exp(double a) { return exp(a); }
__device__ __forceinline__ float acc_tanh(float a) { return tanhf(a); }
__device__ __forceinline__ double acc_tanh(double a) { return tanh(a); }
__device__ __forceinline__ float acc_erf(float a) { return erff(a); }
__device__ __forceinline__ double acc_erf(double a) { return erf(a); }

// N elements loaded and stored together (16 bytes when the row and pointers allow it).
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// N accumulator values rounded into a pack, each as from_acc rounds it.
//
// NOTE [paired rounding]: on sm_80 and later two floats become two bfloat16 in one
// instruction (cvt.rn.bf16x2.f32, round to nearest even): the same bits as from_acc<Bf16> for
// every value but NaN, which stays a NaN (with another payload). The expert backward rounds
// three packs per block of 8 elements; one instruction per pair instead of five per element
// took it from 205 to 159 us at Qwen3-30B-A3B widths on an H200 (docs/moe-performance.md,
// change 10).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> to_pack(const typename Acc<T>::type (&v)[N]) {
    Pack<T, N> p;
    #pragma unroll
    for (int e = 0; e < N; ++e) p.v[e] = from_acc<T>(v[e]);
    return p;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <>
__device__ __forceinline__ Pack<Bf16, 8> to_pack<Bf16, 8>(const float (&v)[8]) {
    Pack<Bf16, 8> p;
    unsigned int* w = reinterpret_cast<unsigned int*>(&p);
    #pragma unroll
    for (int e = 0; e < 4; ++e)     // high half from the second operand's element
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[e]) : "f"(v[2 * e + 1]), "f"(v[2 * e]));
    return p;
}
#endif

