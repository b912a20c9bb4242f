"""torch.compile sees graphstash on the GPU: the CuPy kernels behind the graphstash operators
pass opcheck and match the reference, and a budget-mode MoE block traces without graph
breaks (the operators in its graph), and the MoE model in every mode compiles equal to
eager."""
from __future__ import annotations

import pytest
import torch

from graphstash import _layout as L
from graphstash._kernels import moe as kernel_moe
from graphstash._kernels import paged_stash as kernel_paged

from _compile_data import (MODES, budget_model, compare_compiled, explain, opcheck,
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


# Compiled equals eager on the GPU (NOTE [what compiles in each mode], NOTE [compiled-vs-eager
# tolerances] in tests/_compile_data.py): every mode, gated and plain, capacity factors 1.0 /
# 1.25 / 2.0, 1024 tokens over 8 experts (2 empty, 2 popular), Inductor. float32: within 1e-4
# of each gradient's largest magnitude, and a 1.01x w1 gradient fault must show. bf16: no
# worse than the plain-PyTorch peer's own compiled-vs-eager difference on the same routing
# (Inductor keeps in float32 what eager rounds to bf16 in the router, for both), and a 1.25x
# fault must show.
@pytest.mark.parametrize("capacity_factor", [1.0, 1.25, 2.0])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_moe_on_gpu_equals_eager_float32(gen, mode, gated, capacity_factor):
    compare_compiled(gen, mode, gated, capacity_factor, "inductor", device="cuda",
                     hidden=64, ffn=128, fault_check=True)


@pytest.mark.parametrize("capacity_factor", [1.0, 1.25, 2.0])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_moe_on_gpu_bf16_no_worse_than_the_peer(gen, mode, gated, capacity_factor):
    compare_compiled(gen, mode, gated, capacity_factor, "inductor", device="cuda",
                     dtype=torch.bfloat16, hidden=64, ffn=128, fault_check=True)
