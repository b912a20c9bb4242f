"""torch.compile sees graphstash: the kernel operators (``torch.ops.graphstash.*``), a
budget-mode MoE block traced without graph breaks, and the MoE model in every mode compiled
equal to eager under a loss that reaches every parameter.

On the CPU the operators run their CPU kernels (the reference backend), so their schemas,
fake implementations and functionalization are checked here; the GPU twin of this file
checks the CuPy kernels behind them.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from graphstash import _layout as L
from graphstash._kernels import moe as kernel_moe
from graphstash._kernels import paged_stash as kernel_paged
from graphstash.moe import check_routing
from graphstash.reference import moe as ref_moe

from _compile_data import (MODES, budget_model, compare_compiled, explain, opcheck,
                           opcheck_expert_operators, opcheck_moe_operators, pool_tensors,
                           reload_args, stash_args)
from _data import pattern
from _moe_data import routing, tokens

# the module behind graphstash.moe.dispatch()
from graphstash.moe import backend as moe_backend


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- the operators ----------------------------------------------------------------------
def test_importing_graphstash_imports_no_cupy():
    code = ("import sys, torch\n"
            "import graphstash, graphstash.models, graphstash.moe, graphstash.paging\n"
            "import graphstash._kernels.moe, graphstash._kernels.paged_stash\n"
            "import graphstash._kernels.experts\n"
            "assert 'cupy' not in sys.modules, 'cupy was imported'\n"
            "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
            "print(sorted(n for n in dir(torch.ops.graphstash) if not n.startswith('_')))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    names = set(eval(run.stdout.strip().splitlines()[-1]))
    assert {"gather_rows", "combine_rows", "weight_grad", "route_local", "act_forward",
            "act_backward", "paged_stash", "paged_reload"} <= names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_moe_operators_pass_opcheck(gen, dtype):
    opcheck_moe_operators(gen, dtype)


@pytest.mark.parametrize("gated", [False, True])
def test_expert_operators_pass_opcheck(gen, gated):
    opcheck_expert_operators(gen, torch.float32, gated)


def test_moe_operators_write_what_the_reference_writes(gen):
    M, N, K, H = 29, 13, 2, 8
    src = tokens(M, H, gen)
    index = torch.randint(-1, M, (N, K), generator=gen, dtype=torch.int32)
    weight = torch.rand(N, K, generator=gen)
    pairs = [(kernel_moe.gather_rows, ref_moe.gather_rows, (src, index[:, 0].contiguous())),
             (kernel_moe.combine_rows, ref_moe.combine_rows, (src, index, weight))]
    for op, ref, args in pairs:
        got, want = torch.full((N, H), 7.0), torch.full((N, H), 7.0)
        op(got, *args)
        ref(want, *args)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_paged_operators_round_trip_and_pass_opcheck(gen):
    S, cap, row_bytes, page_rows = 3, 10, 24, 4
    salt = int(torch.randint(0, 251, (), generator=gen))
    src = pattern((S, cap, row_bytes), torch.uint8, salt=salt)
    # 8 to 10 rows a segment: 2 or 3 pages each, more than the 4 device pages, so the rest
    # spills to the host tier
    counts = cap - torch.randint(0, 3, (S,), generator=gen, dtype=torch.int32)
    pool = pool_tensors(gen, num_dev=4, num_host=8, page_rows=page_rows, row_bytes=row_bytes)
    kernel_paged.stash(*stash_args(pool, src, counts, page_rows, 0))
    assert int(pool["status"][L.SS_OVERFLOW]) == 0
    assert int(pool["status"][L.SS_HOST_SPILL]) == 1
    dst = torch.full_like(src, 255)
    kernel_paged.reload(*reload_args(pool, dst, page_rows, 0, True))
    for s in range(S):
        n = int(counts[s])
        assert torch.equal(dst[s, :n], src[s, :n])
        assert torch.equal(dst[s, n:], torch.zeros_like(dst[s, n:]))
    state = pool["state"]                         # every page back on its ring
    assert state[L.ST_DEV_TAIL] - state[L.ST_DEV_HEAD] == 4
    assert state[L.ST_HOST_TAIL] - state[L.ST_HOST_HEAD] == 8

    fresh = pool_tensors(gen, num_dev=4, num_host=8, page_rows=page_rows, row_bytes=row_bytes)
    opcheck(kernel_paged.stash, stash_args(fresh, src, counts, page_rows, 0))
    kernel_paged.stash(*stash_args(fresh, src, counts, page_rows, 0))
    opcheck(kernel_paged.reload, reload_args(fresh, torch.full_like(src, 255), page_rows,
                                             0, False))


def test_operators_compile_with_their_writes(gen):
    """A compiled function that allocates outputs and lets the operators fill them gives
    what the eager calls give (the writes survive functionalization)."""
    M, N, K, H = 31, 19, 2, 16
    src = tokens(M, H, gen)
    index = torch.randint(-1, M, (N, K), generator=gen, dtype=torch.int32)
    weight = torch.rand(N, K, generator=gen)

    def f(src, index, weight):
        rows = src.new_empty(N, H)
        kernel_moe.gather_rows(rows, src, index[:, 0].contiguous())
        out = src.new_empty(N, H)
        kernel_moe.combine_rows(out, rows * 2, index.clamp(max=N - 1), weight)
        dots = torch.empty(N * K)
        kernel_moe.weight_grad(dots, out, rows, index.clamp(max=N - 1))
        return rows, out, dots

    want = f(src, index, weight)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(src, index, weight)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


# ---- a budget-mode MoE block --------------------------------------------------------------
@pytest.fixture(params=["reference", "operators"])
def moe_ops(request, monkeypatch):
    """Which kernels dispatch, combine and the expert activation call on the CPU when they
    run eagerly: the reference backend (what runs on a CPU), or the graphstash operators with
    their CPU kernels (the structure the GPU runs: autograd Functions around mutating
    operators). Traced, both take the operators (NOTE [reference kernels under
    torch.compile] in graphstash/moe/backend.py)."""
    if request.param == "operators":
        monkeypatch.setattr(moe_backend, "REFERENCE", moe_backend.OPERATORS)
    return request.param


@pytest.mark.parametrize("gated", [False, True])
def test_explain_budget_moe_block_has_no_graph_breaks(gen, gated, moe_ops):
    model = budget_model(gated)
    x = tokens(24, 32, gen).requires_grad_()
    graphs, breaks, reasons, ops = explain(model.blocks[0], x, mode="budget")
    assert (graphs, breaks, reasons) == (1, 0, [])
    expected = {f"graphstash.{name}.default" for name in
                ("gather_rows", "combine_rows", "act_forward", "act_backward")}
    assert ops == expected


# Compiled equals eager (NOTE [what compiles in each mode], NOTE [compiled-vs-eager
# tolerances] in tests/_compile_data.py): 1024 tokens over 8 experts, 2 of them empty and 2
# popular, a loss that reaches every parameter. CPU compiles take tens of seconds on two
# cores: the default suite runs one budget and one stash case with aot_eager; the matrix
# (every mode, gated and plain, capacity 1.0 / 1.25 / 2.0, Inductor in float32 and bf16)
# is slow.
def test_compiled_budget_moe_equals_eager_and_a_wrong_gradient_shows(gen, moe_ops):
    compare_compiled(gen, "budget", True, 1.0, "aot_eager", fault_check=True)


def test_compiled_stash_moe_equals_eager(gen):
    compare_compiled(gen, "stash", False, 2.0, "aot_eager")


CAPACITY_FACTORS = (1.0, 1.25, 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor", CAPACITY_FACTORS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_inductor_moe_equals_eager_float32(gen, mode, gated, capacity_factor):
    compare_compiled(gen, mode, gated, capacity_factor, "inductor", fault_check=True)


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor", CAPACITY_FACTORS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_aot_eager_moe_equals_eager_float32(gen, mode, gated, capacity_factor):
    compare_compiled(gen, mode, gated, capacity_factor, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_inductor_moe_bf16_no_worse_than_the_peer(gen, mode, gated):
    compare_compiled(gen, mode, gated, 1.25, "inductor", dtype=torch.bfloat16, fault_check=True)


def test_compiled_routing_check_raises_on_bad_expert(gen):
    idx, _ = routing(8, 2, 4, gen)

    def f(idx):
        check_routing(idx, 4)
        return idx + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(idx), idx + 1)
    bad = idx.clone()
    bad[5, 1] = 4
    with pytest.raises(RuntimeError, match=r"topk_idx: expected expert indices in \[0, 4\)"):
        compiled(bad)


def test_compiled_grouped_mm_flags_bad_host_counts(gen):
    """Traced, host counts are graph values: bad ones flag the status and empty every group
    (NOTE [expert counts]) instead of a host read."""
    from graphstash.moe import grouped_mm

    x = tokens(20, 16, gen)
    w = torch.randn(3, 8, 16, generator=gen)

    def f(x, w, counts, status):
        return grouped_mm(x, w, counts, status=status)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    good = torch.tensor([7, 0, 9])
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32)
    got = compiled(x, w, good, status)
    want = f(x, w, good, torch.zeros(L.STATUS_SIZE, dtype=torch.int32))
    torch.testing.assert_close(got[:16], want[:16], atol=1e-5, rtol=1e-5)
    assert int(status[L.SS_OVERFLOW]) == 0
    for bad in (torch.tensor([7, -1, 9]), torch.tensor([7, 10, 9])):
        status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32)
        compiled(x, w, bad, status)
        assert int(status[L.SS_OVERFLOW]) & L.OVERFLOW_COUNT
