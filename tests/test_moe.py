"""MoE dispatch/combine on the reference backend (CPU), the experts and the reference model."""
from __future__ import annotations

import pytest
import torch

import graphstash
from graphstash import _layout as L
from graphstash.models import MoEConfig, MoEModel
from graphstash.moe import (budget_rows, combine, dispatch, expert_mlp,
                            grouped_mm)
from graphstash.moe.experts import grouped_mm_grads
from graphstash.reference.moe import dense_moe

from _moe_checks import budget_dropless_check, plain_peer_check, stash_budget_check
from _moe_data import expected_layout, routing, tokens


def _status():
    return torch.zeros(L.STATUS_SIZE, dtype=torch.int32)


@pytest.mark.parametrize("pad", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_layout_is_exact(gen, pad, dtype):
    T, H, E, K = 37, 24, 5, 2
    x = tokens(T, H, gen, dtype)
    idx, w = routing(T, K, E, gen, dtype, skew=2.0)
    budget = budget_rows(T, K, E, capacity_factor=2.0, pad_multiple=pad)
    status = _status()
    permuted, tpe, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=pad,
                                     status=status)
    rows, want_tpe = expected_layout(idx, E, budget, pad)
    want = torch.stack([x[t] if r is not None else torch.zeros(H, dtype=dtype)
                        for r, t in ((r, r[0] if r else 0) for r in rows)])
    assert permuted.shape == (budget, H) and permuted.dtype == dtype
    torch.testing.assert_close(permuted, want, atol=0, rtol=0)
    assert tpe.dtype == torch.int32 and tpe.tolist() == want_tpe
    assert int(handle.live_rows) == sum(want_tpe)
    assert int(status[L.SS_OVER_BUDGET]) == 0
    assert int(status[L.SS_TOKENS_PEAK]) == sum(want_tpe)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2),
                                       (torch.float64, 1e-12)])
def test_identity_experts_give_weighted_sum(gen, dtype, tol):
    T, H, E, K = 50, 16, 6, 3
    x = tokens(T, H, gen, dtype)
    idx, w = routing(T, K, E, gen, dtype)
    status = _status()
    budget = budget_rows(T, K, E, capacity_factor=1.0, pad_multiple=8)   # fits any routing
    permuted, _, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=8, status=status)
    out = combine(permuted, handle)
    assert int(status[L.SS_OVER_BUDGET]) == 0
    want = (x.double() * w.double().sum(1, keepdim=True))
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max())


def _experts_fn(w1):
    return lambda e, rows: rows @ w1[e].t()


def test_gradients_match_dense_gradcheck_fp64(gen):
    T, H, E, K = 9, 4, 3, 2
    x = tokens(T, H, gen, torch.float64).requires_grad_()
    idx, w = routing(T, K, E, gen, torch.float64)
    w = w.requires_grad_()
    w1 = (torch.rand(E, H, H, generator=gen, dtype=torch.float64) - 0.5).requires_grad_()

    def ours(x, w, w1):
        permuted, counts, handle = dispatch(x, idx, w, E, budget=T * K + 6, pad_multiple=2,
                                           status=_status())
        return combine(grouped_mm(permuted, w1, counts), handle)

    assert torch.autograd.gradcheck(ours, (x, w, w1))
    out = ours(x, w, w1)
    dense = dense_moe(x, idx, w, _experts_fn(w1))
    torch.testing.assert_close(out, dense)
    g = torch.rand(T, H, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (x, w, w1), g)
    want = torch.autograd.grad(dense, (x, w, w1), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_over_budget_drops_rows_and_raises_flag(gen):
    T, H, E, K = 40, 8, 4, 2
    x = tokens(T, H, gen)
    idx, w = routing(T, K, E, gen, skew=3.0)
    budget = 30                                   # 80 pairs do not fit
    status = _status()
    permuted, tpe, handle = dispatch(x, idx, w, E, budget=budget, status=status)
    rows, want_tpe = expected_layout(idx, E, budget, None)
    assert int(status[L.SS_OVER_BUDGET]) == 1 and bool(handle.over_budget)
    assert int(status[L.SS_TOKENS_PEAK]) == T * K
    assert tpe.tolist() == want_tpe and int(tpe.sum()) == budget
    for r, src in enumerate(rows):
        torch.testing.assert_close(permuted[r], x[src[0]], atol=0, rtol=0)
    out = combine(permuted, handle)
    kept = torch.zeros(T, K)
    for src in rows:
        kept[src] = 1
    want = x * (w * kept).sum(1, keepdim=True)
    torch.testing.assert_close(out, want)
    # sticky: a later dispatch that fits leaves the flag raised
    dispatch(x[:4], idx[:4], w[:4], E, budget=budget, status=status)
    assert int(status[L.SS_OVER_BUDGET]) == 1


@pytest.mark.parametrize("how", ["budget_none", "dropless_mode"])
def test_dropless_sizes_exactly_and_never_flags(gen, how):
    T, H, E, K = 33, 8, 4, 2
    x = tokens(T, H, gen)
    idx, w = routing(T, K, E, gen, skew=3.0)
    status = _status()
    if how == "budget_none":
        permuted, tpe, handle = dispatch(x, idx, w, E, budget=None, pad_multiple=4,
                                         status=status)
    else:
        with graphstash.dropless():
            permuted, tpe, handle = dispatch(x, idx, w, E, budget=5, pad_multiple=4,
                                             status=status)
    rows, want_tpe = expected_layout(idx, E, 10**6, 4)
    n = sum(want_tpe)
    assert permuted.shape == (n, H) and tpe.tolist() == want_tpe
    assert int(status[L.SS_OVER_BUDGET]) == 0
    torch.testing.assert_close(combine(permuted, handle), x * w.sum(1, keepdim=True))


def test_bad_input_names_the_argument(gen):
    T, H, E, K = 6, 4, 3, 2
    x = tokens(T, H, gen)
    idx, w = routing(T, K, E, gen)
    bad = idx.clone()
    bad[2, 1] = E
    with pytest.raises(ValueError, match="topk_idx.*\\[0, 3\\)"):
        dispatch(x, bad, w, E, budget=20)
    bad[2, 1] = -1
    with pytest.raises(ValueError, match="topk_idx"):
        dispatch(x, bad, w, E, budget=20)
    with pytest.raises(ValueError, match="topk_idx: expected shape"):
        dispatch(x, idx[:-1], w[:-1], E, budget=20)
    with pytest.raises(ValueError, match="topk_weight: expected shape"):
        dispatch(x, idx, w[:, :1], E, budget=20)
    with pytest.raises(TypeError, match="topk_idx: expected an int32 or int64"):
        dispatch(x, idx.float(), w, E, budget=20)
    with pytest.raises(TypeError, match="x: expected"):
        dispatch(x.int(), idx, w, E, budget=20)
    with pytest.raises(ValueError, match="x: expected a 2-D"):
        dispatch(x.unsqueeze(0), idx, w, E, budget=20)
    with pytest.raises(ValueError, match="budget: expected an int > 0"):
        dispatch(x, idx, w, E, budget=0)
    with pytest.raises(ValueError, match="num_experts"):
        dispatch(x, idx, w, 0, budget=20)
    with pytest.raises(ValueError, match="pad_multiple"):
        dispatch(x, idx, w, E, budget=20, pad_multiple=0)
    with pytest.raises(ValueError, match="status"):
        dispatch(x, idx, w, E, budget=20, status=torch.zeros(3, dtype=torch.int32))
    permuted, _, handle = dispatch(x, idx, w, E, budget=20, status=_status())
    with pytest.raises(ValueError, match="y: expected a 2-D tensor of 20 rows"):
        combine(permuted[:-1], handle)
    with pytest.raises(TypeError, match="y: expected dtype"):
        combine(permuted.double(), handle)
    with pytest.raises(TypeError, match="handle"):
        combine(permuted, "handle")


def test_grouped_mm_implementations_agree(gen):
    R, H, N, E = 40, 16, 8, 3
    x = tokens(R, H, gen)
    w = torch.rand(E, N, H, generator=gen) - 0.5
    counts = torch.tensor([12, 0, 20], dtype=torch.int32)
    want = torch.cat([x[:12] @ w[0].t(), x[12:32] @ w[2].t()])
    for impl in ("loop", "masked", "auto"):
        out = grouped_mm(x, w, counts, impl=impl)
        torch.testing.assert_close(out[:32], want, msg=impl)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        grouped_mm(x, w, counts[:2])


@pytest.mark.parametrize("impl", ["loop", "masked", "grouped"])
def test_grouped_mm_grads_match_autograd(gen, impl):
    """The explicit GEMM gradients expert_mlp uses equal autograd through grouped_mm (rows
    inside the counts; an empty expert and rows past the counts included)."""
    if impl == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    R, H, N, E = 40, 16, 8, 3
    dtype = torch.float32 if impl == "grouped" else torch.float64   # no float64 grouped GEMM
    counts = torch.tensor([12, 0, 20], dtype=torch.int32)
    x = tokens(R, H, gen, dtype).requires_grad_()
    w = (torch.rand(E, N, H, generator=gen, dtype=dtype) - 0.5).requires_grad_()
    g = torch.rand(R, N, generator=gen, dtype=dtype) - 0.5
    g[32:] = float("nan") if impl != "masked" else 0.0     # rows past the counts
    out = grouped_mm(x, w, counts, impl="loop")
    want_x, want_w = torch.autograd.grad(out[:32], (x, w), g[:32])
    got_x, got_w = grouped_mm_grads(g, x.detach(), w.detach(), counts, impl)
    torch.testing.assert_close(got_x[:32], want_x[:32])
    torch.testing.assert_close(got_w, want_w)
    with pytest.raises(ValueError, match="impl"):
        grouped_mm_grads(g, x.detach(), w.detach(), counts, "auto")
    # each half alone (x not needed for x's gradient) gives the same values
    half_x, none_w = grouped_mm_grads(g, None, w.detach(), counts, impl, need_weight=False)
    none_x, half_w = grouped_mm_grads(g, x.detach(), w.detach(), counts, impl, need_x=False)
    assert none_w is None and none_x is None
    torch.testing.assert_close(half_x[:32], got_x[:32], rtol=0, atol=0)
    torch.testing.assert_close(half_w, got_w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="x: the weight gradient"):
        grouped_mm_grads(g, None, w.detach(), counts, impl)


def _mlp_reference(x, w1, w2, counts, row_weight, gated=False):
    h = grouped_mm(x, w1, counts, impl="loop")
    if gated:
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
    else:
        a = torch.nn.functional.silu(h)
    if row_weight is not None:
        a = a * row_weight.unsqueeze(1)
    return grouped_mm(a, w2, counts, impl="loop")


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("impl", ["loop", "masked"])
@pytest.mark.parametrize("weighted", [False, True])
def test_expert_mlp_gradcheck_fp64(gen, impl, weighted, gated):
    R, H, F, E = 14, 5, 7, 3
    counts = torch.tensor([4, 0, 8], dtype=torch.int32)          # 2 rows past the counts
    x = (tokens(R, H, gen, torch.float64) / R).requires_grad_()
    w1 = (torch.rand(E, 2 * F if gated else F, H, generator=gen, dtype=torch.float64)
          - 0.5).requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen, dtype=torch.float64) - 0.5).requires_grad_()
    rw = (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    rw = rw if weighted else None
    inputs = (x, w1, w2) + ((rw,) if weighted else ())

    def ours(x, w1, w2, rw=None):
        return expert_mlp(x, w1, w2, counts, rw, gated=gated, impl=impl)[:12]

    assert torch.autograd.gradcheck(ours, inputs)
    g = torch.rand(12, H, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(ours(*inputs), inputs, g)
    want = torch.autograd.grad(_mlp_reference(x, w1, w2, counts, rw, gated)[:12], inputs, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("gated", [False, True])
def test_activation_gradient_written_over_the_pre_activation(gen, gated):
    """NOTE [expert backward temporaries]: a backward that keeps the graph leaves the saved
    pre-activation as it was; one that frees it writes the activation's gradient over it and
    bumps its version. Both give the same gradients, bit for bit."""
    R, H, F, E = 16, 8, 12, 2
    counts = torch.tensor([6, 8], dtype=torch.int32)          # 2 rows past the counts
    width = 2 * F if gated else F
    x = tokens(R, H, gen).requires_grad_()
    w1 = (torch.rand(E, width, H, generator=gen) - 0.5).requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen) - 0.5).requires_grad_()
    rw = (torch.rand(R, generator=gen) + 0.1).requires_grad_()
    inputs = (x, w1, w2, rw)
    saved = []

    def pack(t):
        if tuple(t.shape) == (R, width):
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = expert_mlp(x, w1, w2, counts, rw, gated=gated, impl="loop")
    (pre,) = saved
    before, version = pre.clone(), pre._version
    g = torch.rand(R, H, generator=gen)
    kept = torch.autograd.grad(y, inputs, g, retain_graph=True)
    assert pre._version == version and torch.equal(pre, before)
    freed = torch.autograd.grad(y, inputs, g)
    assert pre._version > version and not torch.equal(pre[:14], before[:14])
    for a, b in zip(kept, freed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_activation_backward_writes_the_forward_output_over_its_gradient(gen, dtype, gated,
                                                                         zero_tail):
    """NOTE [expert backward temporaries]: with write_act the activation's backward gives the
    same gradients, and grad_out then holds what act_forward writes, bit for bit (rows past the
    live count untouched, or zeros with zero_tail); the pre-activation may be grad_pre."""
    from graphstash.reference.experts import act_backward, act_forward

    R, F, live_rows = 13, 20, 9
    width = 2 * F if gated else F
    pre = (torch.randn(R, width, generator=gen) * 3).to(dtype)
    w = (torch.rand(R, generator=gen) + 0.1).to(dtype)
    grad_out = torch.randn(R, F, generator=gen).to(dtype)
    live = torch.tensor([live_rows])
    want_act = torch.full((R, F), float("nan"), dtype=dtype)
    act_forward(want_act, pre, w, live, gated=gated, zero_tail=zero_tail)
    want_grad = torch.full((R, width), float("nan"), dtype=dtype)
    want_row = torch.full((R,), float("nan"))
    act_backward(want_grad, want_row, grad_out, pre, w, live, gated=gated, zero_tail=zero_tail)
    assert want_grad[:live_rows].abs().max() > 0.1
    over, in_place = grad_out.clone(), pre.clone()
    over[live_rows:] = float("nan")
    row = torch.full((R,), float("nan"))
    act_backward(in_place, row, over, in_place, w, live, gated=gated, zero_tail=zero_tail,
                 write_act=True)
    torch.testing.assert_close(row, want_row, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(in_place[:live_rows], want_grad[:live_rows], rtol=0, atol=0)
    torch.testing.assert_close(over, want_act, rtol=0, atol=0, equal_nan=True)


def test_gather_rows_refuses_an_inverse_map_of_another_shape():
    """The map gather_rows may take (NOTE [spread rows]) is checked on every backend: the
    reference (the CPU kernel) refuses what the CUDA launcher refuses, naming the argument."""
    from graphstash.reference.moe import gather_rows

    src, out = torch.zeros(5, 4), torch.zeros(6, 4)
    index = torch.tensor([0, 1, -1, 2, 3, 4], dtype=torch.int32)
    good = torch.tensor([[0], [1], [3], [4], [5]], dtype=torch.int32)
    gather_rows(out, src, index, inverse=good)
    for bad in (good[:4], good.long(), good.view(-1), torch.cat([good, good], 1)[:, :1]):
        with pytest.raises(ValueError, match=r"inverse: expected a contiguous int32 \[5, K\]"):
            gather_rows(out, src, index, inverse=bad)


def test_place_rows_writes_the_sourced_rows_and_keeps_the_others():
    """place_rows (the reference, and the operator whose CPU kernel it is) copies each row
    with a source bitwise and leaves every other row as it was, where gather_rows zeroes it;
    an index past the source rows is no source."""
    from graphstash._kernels import moe as ops
    from graphstash.reference.moe import gather_rows, place_rows

    src = torch.arange(1.0, 13.0).view(4, 3)
    index = torch.tensor([2, -1, 0, 4, 3], dtype=torch.int32)
    held = torch.full((5, 3), -7.0)
    want = torch.stack([src[2], held[1], src[0], held[3], src[3]])
    for place in (place_rows, ops.place_rows):
        out = held.clone()
        place(out, src, index)
        assert torch.equal(out, want)
    zeroed = held.clone()
    gather_rows(zeroed, src, index)
    assert torch.equal(zeroed[1], torch.zeros(3)) and torch.equal(zeroed[3], torch.zeros(3))


def test_row_dot_follows_the_kernel_order(gen):
    """NOTE [row dot order]: 8-element blocks dealt to 32 lanes, then a halving tree; the
    result is the exact float64 dot within float32 rounding, for widths below, at and past
    one warp's span."""
    from graphstash.reference.experts import row_dot

    for n in (5, 256, 300, 768):
        a = torch.randn(3, n, generator=gen)
        b = torch.randn(3, n, generator=gen)
        got = row_dot(a, b)
        want = (a.double() * b.double()).sum(1)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the order is fixed: one block's products are added sequentially by one lane
    a = torch.zeros(1, 256)
    a[0, 0], a[0, 1], a[0, 8] = 1e8, 1.0, -1e8
    assert row_dot(a, torch.ones(1, 256)).item() == 0.0     # (1e8 + 1) - 1e8 in float32


def test_expert_mlp_keeps_input_and_pre_activation_only(gen):
    """NOTE [expert MLP saved tensors]: two [rows, *] tensors (x and the pre-activation) and
    the [rows] weights are kept; the activation is not."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm (the loop keeps per-expert slices)")
    R, H, F, E = 16, 8, 12, 2
    counts = torch.tensor([6, 10], dtype=torch.int32)
    x = tokens(R, H, gen).requires_grad_()
    w1 = (torch.rand(E, F, H, generator=gen) - 0.5).requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen) - 0.5).requires_grad_()
    rw = torch.rand(R, generator=gen).requires_grad_()
    kept = []

    def pack(t):
        if t.dim() >= 1 and t.shape[0] == R:
            kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        expert_mlp(x, w1, w2, counts, rw, impl="grouped")
    assert sorted(kept) == sorted([(R, H), (R, F), (R,)])


def test_regathered_input_is_not_kept(gen):
    """NOTE [regathered input]: given the dispatch handle, the [budget, hidden] permuted input
    is not among the saved tensors (the [T, hidden] tokens are), and the gradients match."""
    T, H, F, E, K = 24, 8, 12, 3, 2
    x = tokens(T, H, gen).requires_grad_()
    idx, w = routing(T, K, E, gen)
    w1 = (torch.rand(E, 2 * F, H, generator=gen) - 0.5).requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen) - 0.5).requires_grad_()
    budget = budget_rows(T, K, E, capacity_factor=2.0)
    grads, kept = [], []
    for regather in (False, True):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, status=_status())
            y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), gated=True,
                           impl="loop", handle=handle if regather else None)
            out = combine(y, handle, weighted=False)
        grads.append(torch.autograd.grad(out.pow(2).sum(), (x, w1, w2)))
        kept.append(shapes)
    assert (budget, H) in kept[0] and (budget, H) not in kept[1] and (T, H) in kept[1]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, status=_status())
    with pytest.raises(ValueError, match="handle"):
        expert_mlp(permuted[:-1], w1, w2, counts, gated=True, handle=handle)


def test_expert_mlp_bad_input_names_the_argument(gen):
    x = tokens(8, 4, gen)
    w1, w2 = torch.rand(2, 6, 4), torch.rand(2, 4, 6)
    counts = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="w2"):
        expert_mlp(x, w1, torch.rand(2, 4, 5), counts)
    with pytest.raises(ValueError, match="row_weight"):
        expert_mlp(x, w1, w2, counts, torch.rand(7))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        expert_mlp(x, w1, w2, counts[:1])
    with pytest.raises(ValueError, match="impl"):
        expert_mlp(x, w1, w2, counts, impl="fast")
    with pytest.raises(ValueError, match="activation"):
        expert_mlp(x, w1, w2, counts, activation="tanh")
    with pytest.raises(TypeError, match="gated"):
        expert_mlp(x, w1, w2, counts, gated=1)
    with pytest.raises(ValueError, match="w1"):
        expert_mlp(x, torch.rand(2, 5, 4), w2, counts, gated=True)
    with pytest.raises(ValueError, match="w2"):               # gated: ffn is half of w1's rows
        expert_mlp(x, w1, w2, counts, gated=True)


@pytest.mark.parametrize("pad", [None, 2])
def test_scaled_rows_and_unweighted_combine_match_dense_fp64(gen, pad):
    """dispatch -> expert_mlp(permuted_weights) -> combine(weighted=False) is the dense MoE
    out[t] = sum_k w[t, k] * mlp_k(x[t]); gradcheck in x, the router weights and both
    expert weights; padding rows get weight 0."""
    T, H, F, E, K = 9, 4, 6, 3, 2
    x = (tokens(T, H, gen, torch.float64) / T).requires_grad_()
    idx, w = routing(T, K, E, gen, torch.float64)
    w = w.requires_grad_()
    w1 = (torch.rand(E, F, H, generator=gen, dtype=torch.float64) - 0.5).requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen, dtype=torch.float64) - 0.5).requires_grad_()
    budget = budget_rows(T, K, E, capacity_factor=1.0, pad_multiple=pad)

    def ours(x, w, w1, w2, regather=False):
        permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=pad,
                                           status=_status())
        y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), impl="loop",
                       handle=handle if regather else None)
        return combine(y, handle, weighted=False)

    assert torch.autograd.gradcheck(ours, (x, w, w1, w2))
    # NOTE [regathered input]: the same function and gradients with the permuted input
    # gathered again in backward instead of kept
    assert torch.autograd.gradcheck(lambda *a: ours(*a, regather=True), (x, w, w1, w2))

    def mlp(e, rows):
        return torch.nn.functional.silu(rows @ w1[e].t()) @ w2[e].t()

    torch.testing.assert_close(ours(x, w, w1, w2), dense_moe(x, idx, w, mlp))
    _, _, handle = dispatch(x, idx, w, E, budget=budget + 5, pad_multiple=pad, status=_status())
    rows = handle.permuted_weights()
    assert rows.shape == (budget + 5,) and rows.dtype == w.dtype
    pair = handle.plan.pair_of_slot.long()
    want = torch.where(pair >= 0, w.detach().reshape(-1)[pair.clamp(min=0)], 0.0)
    torch.testing.assert_close(rows.detach(), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="weighted"):
        combine(torch.zeros(budget + 5, H, dtype=torch.float64), handle, weighted=1)


def test_grouped_mm_probe_ignores_enclosing_grad_mode_and_hooks(monkeypatch):
    from graphstash.moe import experts, prepare_experts

    monkeypatch.setattr(experts, "_eager_ok", {})
    monkeypatch.setattr(experts, "_capture_ok", {})

    def refuse(t):
        raise AssertionError("the probe's saved tensors reached an enclosing hook")

    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(refuse, refuse):
        eager, capture = prepare_experts("cpu", torch.float32)
    assert (eager, capture) == (hasattr(torch, "_grouped_mm"), False)   # no capture on a CPU
    assert prepare_experts("cpu", torch.float32) == (eager, capture)    # cached


def _model_config(**kw):
    base = dict(hidden=32, ffn=48, num_experts=4, topk=2, layers=2, num_tokens=64,
                capacity_factor=4.0, pad_multiple=4)
    base.update(kw)
    return MoEConfig(**base)


@pytest.mark.parametrize("attention", [False, True])
def test_model_budget_matches_dropless(gen, attention):
    budget_dropless_check(gen, attention)


def test_model_tight_budget_raises_flag(gen):
    config = _model_config(capacity_factor=0.3)
    x = tokens(config.num_tokens, config.hidden, gen) / config.num_tokens
    status = _status()
    MoEModel(config, mode="budget", status=status)(x)
    assert int(status[L.SS_OVER_BUDGET]) == 1
    with pytest.raises(ValueError, match="mode"):
        MoEModel(config, mode="graph")


def test_model_stash_mode_matches_budget(gen):
    pytest.importorskip("graphstash.stash", reason="graphstash.stash is not available")
    stash_budget_check(gen)


@pytest.mark.parametrize("mode", ["dropless", "budget"])
@pytest.mark.parametrize("gated", [False, True])
def test_plain_peer_matches_dropless(gen, gated, mode):
    """The peer (plain PyTorch: sort, histc, grouped GEMM over T*K rows, index_add_) computes
    the same layer as graphstash's dispatch, dropless and with a budget: outputs and every
    gradient, under a loss that reaches every parameter."""
    plain_peer_check(gen, gated, mode)