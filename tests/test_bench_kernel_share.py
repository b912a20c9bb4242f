"""``graphstash bench moe --profile``: kernels grouped by name into the exchange, grouped GEMMs,
other GEMMs, the optimizer and the rest (names as torch.profiler gives them on an H100/H200: CUTLASS's
grouped kernel of ``torch._grouped_mm``, cuBLAS's, the fused AdamW and foreach kernels)."""
from __future__ import annotations

import pytest

from graphstash.tools.bench.kernel_share import (EXCHANGE_KERNELS, GROUPS, exchange_kernel,
                                                 kernel_group, shares)

NAMES = {
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::"
    "kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, "
    "cutlass::gemm::collective::CollectiveMma<...> > > >(...)": "grouped GEMM",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<... "
    "KernelPtrArrayTmaWarpSpecializedCooperative ...> >(...)": "grouped GEMM",
    "grouped_rows": "grouped GEMM",
    "grouped_weight_grad": "grouped GEMM",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<c10::BFloat16, 4, (at::native::ADAM_MODE)1, false>, double*, double, "
    "double, double, double, double, bool, float*, float*>(...)": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::"
    "BinaryOpScalarFunctor<float, 1, 1, 0>, std::plus<float>, float>(...)": "optimizer",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<"
    "c10::BFloat16, c10::BFloat16, 2, 1, 1>, ...>(...)": "rest",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "other GEMM",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
    "segment_k_off_kernel__5x_cublas": "other GEMM",
    "triton_poi_fused__to_copy_mul_silu_0": "rest",
    "gs_moe_combine_v": "rest",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)": "rest",
    "Memcpy DtoD (Device -> Device)": "rest",
    # the live-row exchange's kernels (raw_kernels/moe_exchange.cu) and NCCL's
    "gs_xchg_barrier": "exchange",
    "gs_xchg_counts": "exchange",
    "gs_xchg_map": "exchange",
    "gs_xchg_push_v16": "exchange",
    "gs_xchg_flags": "exchange",
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "exchange",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "exchange",
}


def test_every_exchange_kernel_is_named_as_the_exchange():
    """Each entry point the exchange's source registers falls in the exchange group (names
    read from the launcher, so a new kernel there is checked too)."""
    from graphstash import _kernels

    _, kernels = _kernels.sources()["moe_exchange"]
    assert kernels and all(kernel_group(k) == "exchange" for k in kernels), kernels


@pytest.mark.parametrize("name", list(NAMES))
def test_kernel_names_fall_in_their_group(name):
    assert kernel_group(name) == NAMES[name]


def test_shares_of_the_summed_kernel_time():
    kernels = [(name, 100.0 * (k + 1)) for k, name in enumerate(NAMES)]
    got = shares(kernels, steps=2)
    total = sum(us for _, us in kernels)
    assert got["kernel_ms_per_step"] == pytest.approx(total / 1e3 / 2)
    assert got["kernels_per_step"] == len(NAMES) / 2
    assert set(got["shares"]) == set(GROUPS)
    assert sum(got["shares"].values()) == pytest.approx(1.0)
    for group in GROUPS:
        want = sum(us for name, us in kernels if NAMES[name] == group) / total
        assert got["shares"][group] == pytest.approx(want), group


def test_no_kernels_recorded_gives_no_shares():
    assert shares([], steps=3) == {"kernel_ms_per_step": 0.0, "kernels_per_step": 0.0,
                                   "shares": None, "exchange_ms": {}}


KINDS = {"gs_xchg_push_v16": "push", "gs_xchg_push_v2": "push", "gs_xchg_barrier": "barrier",
         "gs_xchg_counts": "counts", "gs_xchg_map": "map", "gs_xchg_flags": "flags",
         "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "nccl",
         "nvshmemi_transfer_kernel": "nvshmem", "gs_exchange_something_new": "other",
         "grouped_rows": None, "gs_moe_combine_v": None}


@pytest.mark.parametrize("name", list(KINDS))
def test_exchange_kernels_by_kind(name):
    assert exchange_kernel(name) == KINDS[name]


def test_exchange_ms_splits_the_exchange_by_kind():
    """``exchange_ms``: each kind's ms per step, in :data:`EXCHANGE_KERNELS` order, summing
    to the exchange group's time; kinds that did not run are left out."""
    kernels = [("gs_xchg_barrier", 300.0), ("gs_xchg_push_v16", 1200.0),
               ("gs_xchg_push_v8", 600.0), ("gs_xchg_counts", 90.0), ("grouped_rows", 5000.0),
               ("gs_xchg_barrier", 150.0)]
    got = shares(kernels, steps=3)
    assert got["exchange_ms"] == {"push": pytest.approx(0.6), "barrier": pytest.approx(0.15),
                                  "counts": pytest.approx(0.03)}
    assert list(got["exchange_ms"]) == [k for k in EXCHANGE_KERNELS if k in got["exchange_ms"]]
    summed = sum(got["exchange_ms"].values())
    assert summed == pytest.approx(got["shares"]["exchange"] * got["kernel_ms_per_step"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="steps: expected a positive int, got 0"):
        shares([], steps=0)
    with pytest.raises(TypeError, match="name: expected a kernel name"):
        kernel_group(None)
