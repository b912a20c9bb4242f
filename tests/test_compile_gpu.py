"""torch.compile sees graphstash on the GPU: the CuPy kernels behind the graphstash operators
pass opcheck and match the reference, and a budget-mode MoE block traces without graph
breaks (the operators in its graph) and compiles equal to eager."""
from __future__ import annotations

import pytest
import torch

from graphstash import _layout as L
from graphstash._kernels import moe as kernel_moe
from graphstash._kernels import paged_stash as kernel_paged

from _compile_data import (assert_close_norm, budget_model, compare_compiled, explain, opcheck,
                           opcheck_expert_operators, opcheck_moe_operators, pool_tensors,
                           reload_args, stash_args)
from _data import pattern
from _moe_data import tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_operators_pass_opcheck_on_gpu(gen, dtype):
    opcheck_moe_operators(gen, dtype, "cuda", M=97, N=61, H=64)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_operators_pass_opcheck_on_gpu(gen, dtype, gated):
    opcheck_expert_operators(gen, dtype, gated, "cuda", rows=37, ffn=64)


def test_routing_operator_passes_opcheck_on_gpu(gen):
    T, K, E, R = 40, 2, 4, 96
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to("cuda", torch.int32)

    def i32(*shape):
        return torch.full(shape, 7, dtype=torch.int32, device="cuda")

    outputs = dict(slot_of_pair=i32(T, K), pair_of_slot=i32(R), token_of_slot=i32(R),
                   tokens_per_expert=i32(E), live_rows=i32(1),
                   demand_rows=torch.full((1,), 7, dtype=torch.int64, device="cuda"),
                   over_budget=torch.ones(1, dtype=torch.bool, device="cuda"),
                   bad_index=torch.ones(1, dtype=torch.bool, device="cuda"))
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device="cuda")
    opcheck(kernel_moe.route_local, (idx, E, R, None, status), outputs)


def test_paged_operators_on_gpu_equal_their_cpu_kernels(gen):
    """The same stash and reload through the operators on CUDA (CuPy) and on the CPU (the
    reference): pool state, records, status and reloaded rows equal exactly."""
    S, cap, row_bytes, page_rows = 3, 40, 48, 8
    salt = int(torch.randint(0, 251, (), generator=gen))
    src = pattern((S, cap, row_bytes), torch.uint8, salt=salt)
    counts = cap - torch.randint(0, 12, (S,), generator=gen, dtype=torch.int32)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    pools = {}
    for device in ("cpu", "cuda"):
        pool = pool_tensors(torch.Generator().manual_seed(seed), num_dev=6, num_host=12,
                            page_rows=page_rows, row_bytes=row_bytes, device=device)
        kernel_paged.stash(*stash_args(pool, src.to(device), counts.to(device), page_rows, 0))
        dst = torch.full_like(src, 255).to(device)
        kernel_paged.reload(*reload_args(pool, dst, page_rows, 0, True))
        torch.cuda.synchronize()
        pools[device] = dict(pool, dst=dst)
    for name in ("state", "status", "table", "dev_ring", "host_ring", "dst"):
        assert torch.equal(pools["cuda"][name].cpu(), pools["cpu"][name]), name
    assert int(pools["cuda"]["status"][L.SS_HOST_SPILL]) == 1

    # opcheck runs the operator on copies of its arguments, and a copy of the pinned host tier
    # is pageable memory the kernels cannot address: check a pool without a host tier
    fresh = pool_tensors(gen, num_dev=18, num_host=0, page_rows=page_rows, row_bytes=row_bytes,
                         device="cuda")
    opcheck(kernel_paged.stash, stash_args(fresh, src.cuda(), counts.cuda(), page_rows, 0))
    kernel_paged.stash(*stash_args(fresh, src.cuda(), counts.cuda(), page_rows, 0))
    opcheck(kernel_paged.reload, reload_args(fresh, torch.full_like(src, 255).cuda(),
                                             page_rows, 0, False))


@pytest.mark.parametrize("gated", [False, True])
def test_explain_budget_moe_block_on_gpu_has_no_graph_breaks(gen, gated):
    model = budget_model(gated, hidden=64, ffn=128, device="cuda", dtype=torch.bfloat16)
    x = tokens(24, 64, gen, torch.bfloat16).cuda().requires_grad_()
    graphs, breaks, reasons, ops = explain(model.blocks[0], x, mode="budget")
    assert (graphs, breaks, reasons) == (1, 0, [])
    expected = {f"graphstash.{name}.default" for name in
                ("route_local", "gather_rows", "combine_rows", "act_forward", "act_backward")}
    assert expected <= ops


@pytest.mark.parametrize("gated", [False, True])
def test_compiled_budget_moe_on_gpu_equals_eager_float32(gen, gated):
    # float32: eager runs the per-expert loop, the trace the masked product (NOTE [grouped_mm
    # under torch.compile]); the data moves are the same kernels
    compare_compiled(gen, gated, "inductor", device="cuda", hidden=64, ffn=128,
                     tol=1e-4, grad_tol=1e-3)


# NOTE [bf16 router gradients under Inductor]: on an H200 the compiled bf16 block's input
# gradient differed from eager by 1.56-1.68 (norm-relative) while the outputs agreed to 2e-3.
# The same happens without graphstash: the plain-PyTorch peer (MoEModel(mode="plain"))
# compiled with Inductor in bf16 gives x.grad 1.47 off on the CPU, and a bare router (RMSNorm,
# linear, float softmax, top-k, renormalised weights cast to bf16) 0.69 off in its weight
# gradient, while aot_eager matches eager exactly. The renormalised top-k weights' backward
# cancels heavily, and Inductor keeps in float32 what eager rounds to bf16, so neither side
# is a reference for the other. float32 compiled equals eager (the test above).
@pytest.mark.xfail(strict=False, reason="NOTE [bf16 router gradients under Inductor]: Inductor "
                   "and eager round the router's ill-conditioned bf16 backward differently; the "
                   "plain-PyTorch peer shows the same difference")
@pytest.mark.parametrize("gated", [False, True])
def test_compiled_budget_moe_on_gpu_equals_eager_bfloat16(gen, gated):
    # bf16 on sm90/sm100: both run torch._grouped_mm; Inductor's fused norms and router
    # round differently by about one bf16 ulp, which a few gradient elements amplify (one
    # H200 run: 3.4 % of the largest w2 gradient), so the bf16 check is norm-relative at 1e-2
    compare_compiled(gen, gated, "inductor", device="cuda", dtype=torch.bfloat16, hidden=64,
                     ffn=128, tol=1e-2, grad_tol=1e-2, check=assert_close_norm)
