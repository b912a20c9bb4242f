"""MoE dispatch/combine kernels on the GPU against the reference backend, and CUDA graphs.

Data movement (gather, dispatch, combine, their input gradients) is compared exactly
(NOTE [exact arithmetic] in raw_kernels/gs_dtype.cuh); the router-weight gradient, a dot
product summed in a different order, within float tolerance.
"""
from __future__ import annotations

import pytest
import torch

from graphstash import _layout as L
from _capture import capture_with_output
from graphstash.models import MoEConfig, MoEModel
from graphstash.moe import (budget_rows, combine, dispatch, expert_mlp,
                            grouped_mm)

from _faults import kernel_fault
from _grad_checks import (assert_far_from_zero, assert_grads_close, named_grads, projected_loss,
                          projection)
from _moe_data import routing, tokens

pytestmark = pytest.mark.gpu
EXACT = dict(atol=0, rtol=0)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _status(device):
    return torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)


def _ops():
    from graphstash._kernels import moe as cupy_ops
    from graphstash.reference import moe as ref_ops

    return cupy_ops, ref_ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 64, 1000])
def test_kernels_match_reference_exactly(gen, dtype, hidden):
    cupy_ops, ref_ops = _ops()
    M, N, K = 97, 61, 3
    src = tokens(M, hidden, gen, dtype).cuda()
    index = torch.randint(-1, M, (N,), generator=gen, dtype=torch.int32).cuda()
    outs = [torch.full((N, hidden), 7, dtype=dtype, device="cuda") for _ in range(2)]
    cupy_ops.gather_rows(outs[0], src, index)
    ref_ops.gather_rows(outs[1], src, index)
    torch.testing.assert_close(outs[0], outs[1], **EXACT)
    # place: the rows without a source keep what they held (here distinct, nonzero values)
    held = tokens(N, hidden, gen, dtype).cuda()
    unsourced = torch.arange(N, device="cuda") % 3 == 0
    index = torch.where(unsourced, -1, index.clamp(min=0))
    outs = [held.clone() for _ in range(2)]
    cupy_ops.place_rows(outs[0], src, index)
    ref_ops.place_rows(outs[1], src, index)
    torch.testing.assert_close(outs[0], outs[1], **EXACT)
    torch.testing.assert_close(outs[0][unsourced], held[unsourced], **EXACT)

    index2 = torch.randint(-1, M, (N, K), generator=gen, dtype=torch.int32).cuda()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    weight = torch.rand(N, K, generator=gen, dtype=torch.float64).to("cuda", acc)
    for w in (weight, None):
        outs = [torch.full((N, hidden), 7, dtype=dtype, device="cuda") for _ in range(2)]
        cupy_ops.combine_rows(outs[0], src, index2, w)
        ref_ops.combine_rows(outs[1], src, index2, w)
        torch.testing.assert_close(outs[0], outs[1], **EXACT)

    grad = tokens(N, hidden, gen, dtype).cuda()
    outs = [torch.zeros(N * K, dtype=acc, device="cuda") for _ in range(2)]
    cupy_ops.weight_grad(outs[0], grad, src, index2)
    ref_ops.weight_grad(outs[1], grad, src, index2)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5 * outs[1].abs().max())


def _spread_maps(gen, M, N, K):
    """A consistent index / inverse pair: N destination rows, some fed by one (source, slot)
    of M sources x K slots each, some fed by none; some slots feed nothing (dropped)."""
    pairs = torch.randperm(M * K, generator=gen)[:min(N, M * K) * 3 // 4]
    rows = torch.randperm(N, generator=gen)[:pairs.numel()]
    index = torch.full((N,), -1, dtype=torch.int32)
    index[rows] = (pairs // K).to(torch.int32)
    inverse = torch.full((M * K,), -1, dtype=torch.int32)
    inverse[pairs] = rows.to(torch.int32)
    return index.cuda(), inverse.view(M, K).cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 64, 1000, 2048])
@pytest.mark.parametrize("K", [1, 3, 8, 32, 33])
def test_spread_equals_the_gather_exactly(gen, dtype, hidden, K):
    """NOTE [spread rows]: the gather given the inverse map (the spread kernel; K = 33 falls
    back to the gather) writes what the reference gather writes, every destination row
    (rows without a source get zeros over poison)."""
    cupy_ops, ref_ops = _ops()
    M, N = 97, 211
    src = tokens(M, hidden, gen, dtype).cuda()
    index, inverse = _spread_maps(gen, M, N, K)
    outs = [torch.full((N, hidden), float("nan"), dtype=dtype, device="cuda") for _ in range(2)]
    cupy_ops.gather_rows(outs[0], src, index, inverse=inverse)
    ref_ops.gather_rows(outs[1], src, index)
    torch.testing.assert_close(outs[0], outs[1], **EXACT)
    assert (outs[0][index < 0] == 0).all() and (index < 0).any() and (index >= 0).any()
    with pytest.raises(ValueError, match=r"inverse: expected a contiguous int32 \[97, K\]"):
        cupy_ops.gather_rows(outs[0], src, index, inverse=inverse[:-1])


def test_unaligned_views_use_scalar_path(gen):
    cupy_ops, ref_ops = _ops()
    base = tokens(65, 9, gen, torch.bfloat16).cuda()
    src = base[1:]                                          # 18-byte rows, odd offset
    index = torch.randint(-1, 64, (40,), generator=gen, dtype=torch.int32).cuda()
    outs = [torch.zeros(40, 9, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    cupy_ops.gather_rows(outs[0], src, index)
    ref_ops.gather_rows(outs[1], src, index)
    torch.testing.assert_close(outs[0], outs[1], **EXACT)


def _run(x, idx, w, E, budget, pad, backend, grad, status):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    permuted, tpe, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=pad,
                                     status=status, backend=backend)
    y = permuted * 2 + 1                      # an elementwise "expert": row order matters
    out = combine(y, handle)
    (out * grad).sum().backward()
    return permuted.detach(), tpe, out.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pad,factor", [(None, 1.5), (8, 1.5), (None, 0.5)])
def test_dispatch_combine_gpu_equals_reference(gen, dtype, pad, factor):
    T, H, E, K = 301, 72, 8, 2
    x = tokens(T, H, gen, dtype).cuda()
    idx, w = routing(T, K, E, gen, dtype, skew=2.0)
    idx, w = idx.cuda(), w.cuda()
    grad = tokens(T, H, gen, dtype).cuda() / T
    budget = budget_rows(T, K, E, capacity_factor=factor, pad_multiple=pad)
    st = [_status("cuda"), _status("cuda")]
    got = _run(x, idx, w, E, budget, pad, "cupy", grad, st[0])
    want = _run(x, idx, w, E, budget, pad, "reference", grad, st[1])
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, b, **EXACT)
    tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    torch.testing.assert_close(got[4], want[4], rtol=tol, atol=tol)
    torch.testing.assert_close(st[0], st[1], **EXACT)
    assert int(st[0][L.SS_OVER_BUDGET]) == (1 if factor < 1 else 0)


def test_gradcheck_fp64_on_gpu(gen):
    T, H, E, K = 10, 4, 3, 2
    x = tokens(T, H, gen, torch.float64).cuda().requires_grad_()
    idx, w = routing(T, K, E, gen, torch.float64)
    idx, w = idx.cuda(), w.cuda().requires_grad_()
    w1 = (torch.rand(E, H, H, generator=gen, dtype=torch.float64) - 0.5).cuda().requires_grad_()

    def f(x, w, w1):
        permuted, counts, handle = dispatch(x, idx, w, E, budget=T * K + 6, pad_multiple=2,
                                            status=_status("cuda"))
        return combine(grouped_mm(permuted, w1, counts), handle)

    assert torch.autograd.gradcheck(f, (x, w, w1))


def test_scaled_rows_gradcheck_fp64_on_gpu(gen):
    """dispatch -> expert_mlp(permuted_weights) -> combine(weighted=False) on the CuPy
    kernels (the row-weight gradient runs the weight-gradient kernel with one row per pair)."""
    T, H, F, E, K = 10, 4, 6, 3, 2
    x = (tokens(T, H, gen, torch.float64) / T).cuda().requires_grad_()
    idx, w = routing(T, K, E, gen, torch.float64)
    idx, w = idx.cuda(), w.cuda().requires_grad_()
    w1 = (torch.rand(E, F, H, generator=gen, dtype=torch.float64) - 0.5).cuda().requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen, dtype=torch.float64) - 0.5).cuda().requires_grad_()

    def f(x, w, w1, w2):
        permuted, counts, handle = dispatch(x, idx, w, E, budget=T * K + 6, pad_multiple=2,
                                            status=_status("cuda"))
        y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights())
        return combine(y, handle, weighted=False)

    assert torch.autograd.gradcheck(f, (x, w, w1, w2))


@pytest.mark.parametrize("gated", [False, True])
def test_expert_mlp_captured_matches_eager_loop(gen, gated):
    """bf16 expert_mlp (SiLU or SwiGLU) with router-weighted rows, captured (native grouped
    GEMM, explicit GEMM gradients, fused count-aware kernels) and replayed with changing
    counts, against the eager per-expert loop."""
    R, H, F, E = 96, 64, 128, 4
    static_x = tokens(R, H, gen, torch.bfloat16).cuda().div_(R).requires_grad_()
    static_w1 = (torch.rand(E, 2 * F if gated else F, H, generator=gen)
                 - 0.5).to("cuda", torch.bfloat16).requires_grad_()
    static_w2 = (torch.rand(E, H, F, generator=gen) - 0.5).to("cuda", torch.bfloat16).requires_grad_()
    static_rw = torch.rand(R, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    static_counts = torch.tensor([20, 0, 40, 30], dtype=torch.int32, device="cuda")
    static_g = tokens(R, H, gen, torch.bfloat16).cuda() / R
    params = (static_x, static_w1, static_w2, static_rw)

    def step():
        for p in params:
            p.grad = None
        y = expert_mlp(static_x, static_w1, static_w2, static_counts, static_rw, gated=gated)
        (y * static_g).sum().backward()
        return y.detach()

    graph, static_y = capture_with_output(step)
    tol = dict(rtol=3e-2, atol=3e-2)
    for counts in ([24, 8, 0, 56], [0, 0, 96, 0], [10, 30, 20, 5]):
        counts_t = torch.tensor(counts, dtype=torch.int32, device="cuda")
        with torch.no_grad():
            static_counts.copy_(counts_t)
            static_x.copy_(tokens(R, H, gen, torch.bfloat16).cuda() / R)
        graph.replay()
        ref = [p.detach().clone().requires_grad_() for p in params]
        yr = expert_mlp(*ref[:3], counts_t, ref[3], gated=gated, impl="loop")
        (yr * static_g).sum().backward()
        n = sum(counts)
        torch.testing.assert_close(static_y[:n], yr[:n], **tol)
        torch.testing.assert_close(static_x.grad[:n], ref[0].grad[:n], **tol)
        torch.testing.assert_close(static_w1.grad, ref[1].grad, **tol)
        torch.testing.assert_close(static_w2.grad, ref[2].grad, **tol)
        torch.testing.assert_close(static_rw.grad[:n], ref[3].grad[:n], **tol)


def test_out_of_range_index_flags_overflow_on_gpu(gen):
    T, H, E, K = 16, 8, 4, 2
    x = tokens(T, H, gen).cuda()
    idx, w = routing(T, K, E, gen)
    idx[3, 0] = E + 5
    status = _status("cuda")
    permuted, tpe, handle = dispatch(x, idx.cuda(), w.cuda(), E, budget=64, status=status)
    assert int(status[L.SS_OVERFLOW]) & L.OVERFLOW_COUNT
    assert int(tpe.sum()) == T * K - 1
    import graphstash

    with graphstash.dropless(), pytest.raises(ValueError, match="topk_idx"):
        dispatch(x, idx.cuda(), w.cuda(), E, budget=64, status=status)


def test_capture_and_replay_with_changing_routing(gen):
    T, H, E, K = 256, 64, 8, 2
    dtype = torch.bfloat16
    budget = budget_rows(T, K, E, capacity_factor=1.3, pad_multiple=8)
    static_x = tokens(T, H, gen, dtype).cuda().requires_grad_()
    idx, w = routing(T, K, E, gen, dtype)
    static_idx, static_w = idx.cuda(), w.cuda().requires_grad_()
    static_g = tokens(T, H, gen, dtype).cuda() / T
    status = _status("cuda")

    def step():
        static_x.grad = static_w.grad = None
        permuted, tpe, handle = dispatch(static_x, static_idx, static_w, E, budget=budget,
                                         pad_multiple=8, status=status)
        out = combine(permuted * 2 + 1, handle)
        (out * static_g).sum().backward()
        return permuted.detach(), tpe, out.detach()

    graph, static = capture_with_output(step)
    for skew in (None, 1.0, 6.0):              # the last one overflows the budget
        x = tokens(T, H, gen, dtype).cuda()
        idx, w = routing(T, K, E, gen, dtype, skew=skew)
        g = tokens(T, H, gen, dtype).cuda() / T
        with torch.no_grad():
            static_x.copy_(x), static_idx.copy_(idx), static_w.copy_(w), static_g.copy_(g)
        status.zero_()
        graph.replay()
        ref_status = _status("cuda")
        want = _run(x, idx.cuda(), w.cuda(), E, budget, 8, "reference", g, ref_status)
        got = (*static, static_x.grad, static_w.grad)
        for a, b in zip(got[:4], want[:4]):
            torch.testing.assert_close(a, b, **EXACT)
        torch.testing.assert_close(got[4], want[4], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(status, ref_status, **EXACT)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mm_captured_matches_loop(gen, dtype):
    """bf16 on sm90/sm100: torch._grouped_mm inside the graph; float32: the Triton grouped GEMM
    where Triton is installed, else the masked fallback (torch._grouped_mm's float32 path reads
    the offsets back and cannot be captured)."""
    from graphstash.moe import prepare_experts

    R, H, N, E = 96, 64, 48, 4
    eager_ok, capture_ok = prepare_experts(torch.device("cuda"), dtype)
    major = torch.cuda.get_device_capability()[0]
    assert capture_ok == (eager_ok and dtype == torch.bfloat16 and major in (9, 10))
    static_x = tokens(R, H, gen, dtype).cuda().requires_grad_()
    static_w = (torch.rand(E, N, H, generator=gen) - 0.5).to("cuda", dtype).requires_grad_()
    static_counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    static_g = tokens(R, N, gen, dtype).cuda() / R

    def step():
        static_x.grad = static_w.grad = None
        y = grouped_mm(static_x, static_w, static_counts)
        (y * static_g).sum().backward()
        return y.detach()

    static_counts.copy_(torch.tensor([20, 0, 40, 30], dtype=torch.int32))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for counts in ([24, 8, 0, 56], [0, 0, 96, 0], [10, 30, 20, 5]):
        counts_t = torch.tensor(counts, dtype=torch.int32)
        x = tokens(R, H, gen, dtype).cuda()
        g = tokens(R, N, gen, dtype).cuda() / R
        with torch.no_grad():
            static_x.copy_(x), static_counts.copy_(counts_t), static_g.copy_(g)
        graph.replay()
        xr = x.clone().requires_grad_()
        wr = static_w.detach().clone().requires_grad_()
        yr = grouped_mm(xr, wr, counts_t.cuda(), impl="loop")
        (yr * g).sum().backward()
        n = sum(counts)
        torch.testing.assert_close(static_y[:n], yr[:n], **tol)
        torch.testing.assert_close(static_x.grad[:n], xr.grad[:n], **tol)
        torch.testing.assert_close(static_w.grad, wr.grad, **tol)


def _graph_vs_eager(gen, dtype, fault=None) -> None:
    """A captured budget step (forward, backward, SGD) against an eager dropless control from
    the same state, over four replays with new inputs: the loss, every parameter's gradient
    (within 2e-2 of its largest magnitude in bf16, 1e-4 in float32; the eager ones far from
    zero) and the parameters after the update. The loss is a fixed random projection of the
    output (it reaches every parameter). ``fault``: armed during the warmup and the capture
    only (the graph side)."""
    config = MoEConfig(hidden=128, ffn=256, num_experts=8, topk=2, layers=3, num_tokens=512,
                       capacity_factor=2.0, pad_multiple=8)
    status = _status("cuda")
    graphed = MoEModel(config, mode="budget", status=status, seed=1).to("cuda", dtype)
    eager = MoEModel(config, mode="dropless", seed=1).to("cuda", dtype)
    eager.load_state_dict(graphed.state_dict())
    opt_g = torch.optim.SGD(graphed.parameters(), lr=1e-3)
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-3)
    static_x = torch.zeros(config.num_tokens, config.hidden, device="cuda", dtype=dtype)
    proj = projection((config.num_tokens, config.hidden), gen, "cuda")
    # bf16: the same kernels on the same groups, but an update that rounds a gradient
    # differently moves a parameter by one bf16 ulp (2**-8 relative).
    tol = dict(rtol=2e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    rel = 2e-2 if dtype == torch.bfloat16 else 1e-4

    def step():
        opt_g.zero_grad(set_to_none=True)
        loss = projected_loss(graphed(static_x), proj)
        loss.backward()
        grads = [p.grad for p in graphed.parameters()]
        opt_g.step()
        return loss.detach(), grads

    static_x.copy_(tokens(config.num_tokens, config.hidden, gen).cuda() / config.num_tokens)

    def before_capture():
        eager.load_state_dict(graphed.state_dict())
        opt_g.zero_grad(set_to_none=True)

    if fault is not None:
        fault.armed = True
    graph, (static_loss, static_grads) = capture_with_output(step, before_capture=before_capture)
    if fault is not None:
        fault.armed = False
    eager.load_state_dict(graphed.state_dict())   # the capture ran no update
    names = [name for name, _ in graphed.named_parameters()]
    for i in range(4):
        x = (torch.rand(config.num_tokens, config.hidden, generator=gen) + i).to("cuda", dtype)
        static_x.copy_(x)
        graph.replay()
        opt_e.zero_grad(set_to_none=True)
        loss = projected_loss(eager(x), proj)
        loss.backward()
        want = named_grads(eager)
        opt_e.step()
        torch.testing.assert_close(static_loss, loss.detach(), rtol=rel, atol=rel)
        assert_grads_close(dict(zip(names, static_grads)), want, rel=rel)
        for a, b in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(a, b, **tol)
    assert int(status[L.SS_OVER_BUDGET]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_graph_step_matches_eager(gen, dtype):
    """bf16 (what the benchmark and the demo measure) and float32 (grouped_mm's Triton kernel
    or, without Triton, its masked fallback): a captured budget step against an eager dropless
    control."""
    _graph_vs_eager(gen, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_vs_eager_check_fails_on_a_wrong_captured_backward(gen, dtype):
    """The check above fails when the captured step's expert backward is wrong (a test-only
    fault, armed during the capture only: the graph replays it, the eager control does not)."""
    with kernel_fault("act_backward", scale=1.25) as fault:
        fault.armed = False
        with pytest.raises(AssertionError):
            _graph_vs_eager(gen, dtype, fault=fault)
    assert fault.hits > 0


def _poison_free_memory(mib: int = 256):
    """Leave ``mib`` MiB of NaN as the allocator's only free large segment, so the large
    tensors allocated next (every budget-sized one here is over 1 MiB) start out NaN: a
    reload that leaves rows past the count alone and a backward that read them would show."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blob = torch.full((mib << 18,), float("nan"), dtype=torch.float32, device="cuda")
    del blob


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_stash_mode_gradients_equal_budget_mode(gen, dtype):
    """Stash mode against budget mode, bitwise: eagerly and replayed from a CUDA graph. The
    reloads skip the zero fill (zero_tail=False, NOTE [moe layer]): bf16 runs the native
    grouped GEMM under capture, float32 the Triton grouped GEMM or, without Triton, the
    masked fallback, none of which lets the rows past the counts reach a result (NOTE [rows
    past the counts] in moe/experts.py). Free memory is poisoned with NaN before every step."""
    from graphstash.stash import StashConfig, StashManager

    config = MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=4, num_tokens=2048,
                       capacity_factor=2.0, pad_multiple=8)
    status = _status("cuda")
    # Default min_tensor_bytes: the float32 capture's masked fallback (without Triton) saves
    # [rows, 1] masks that the eager warmup (per-expert loop) never made; too small to stash.
    # policy="always": the gradients through stashed rows are what is checked, whatever the
    # measured plan would choose at this size
    manager = StashManager(StashConfig(copy_blocks=3, policy="always"), device="cuda",
                           status=status)
    models = {"budget": MoEModel(config, mode="budget", status=status, seed=3),
              "stash": MoEModel(config, mode="stash", stash_manager=manager, status=status,
                                seed=3)}
    for m in models.values():
        m.to("cuda", dtype)
    static_x = torch.empty(config.num_tokens, config.hidden, device="cuda", dtype=dtype)
    proj = projection((config.num_tokens, config.hidden), gen, "cuda")

    def step(mode):
        model = models[mode]
        model.zero_grad(set_to_none=False)
        if mode == "stash":
            manager.begin_step()
        loss = projected_loss(model(static_x), proj)
        loss.backward()
        if mode == "stash":
            manager.end_step()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    def check(got, want):
        assert_far_from_zero({f"grad {i}": g for i, g in enumerate(want[1:])})
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"output {i}: max difference {(a - b).abs().max()}"

    for i in range(3):          # eager; the first stash step measures demand and sizes the pool
        static_x.copy_(tokens(config.num_tokens, config.hidden, gen).cuda() / (i + 1))
        _poison_free_memory()
        want = [t.clone() for t in step("budget")]
        _poison_free_memory()
        check(step("stash"), want)
    assert manager.buffers, "the stash pool was never created"
    graphs = {mode: capture_with_output(lambda mode=mode: step(mode), warmup=2)
              for mode in models}
    for i in range(3):
        static_x.copy_(tokens(config.num_tokens, config.hidden, gen).cuda() * (i + 2))
        graphs["budget"][0].replay()
        want = [t.clone() for t in graphs["budget"][1]]
        _poison_free_memory()
        graphs["stash"][0].replay()
        check(graphs["stash"][1], want)
    status_now = manager.read_status()
    assert not status_now["overflow"] and not status_now["over_budget"]
