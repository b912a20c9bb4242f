"""CPU tests of bad expert counts and routing: refused with an error naming the argument,
never a result of the wrong size (NOTE [expert counts] in graphstash/moe/experts.py)."""
from __future__ import annotations

import pytest
import torch

from graphstash.moe import dispatch, expert_mlp, grouped_mm
from graphstash.moe.experts import grouped_mm_grads

from _moe_data import routing, tokens

R, H, N, E = 32, 16, 8, 3


def _weights(gen):
    return torch.rand(E, N, H, generator=gen) - 0.5


@pytest.mark.parametrize("impl", ["auto", "loop", "masked"])
@pytest.mark.parametrize("counts, match", [
    ([20, -8, 20], "expected counts >= 0"),                       # sums to 32: fits the rows
    ([12, 0, 21], r"expected counts summing to at most the 32 rows of x, got 33"),
    ([40, 0, 0], r"expected counts summing to at most the 32 rows of x, got 40"),
])
def test_grouped_mm_refuses_host_counts_out_of_range(gen, impl, counts, match):
    x, w = tokens(R, H, gen), _weights(gen)
    with pytest.raises(ValueError, match="tokens_per_expert: " + match):
        grouped_mm(x, w, torch.tensor(counts, dtype=torch.int32), impl=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int16])
def test_grouped_mm_refuses_counts_that_are_not_int32_or_int64(gen, dtype):
    x, w = tokens(R, H, gen), _weights(gen)
    with pytest.raises(TypeError, match="tokens_per_expert: expected an int32 or int64 tensor"):
        grouped_mm(x, w, torch.tensor([12, 0, 20]).to(dtype))


def test_grouped_mm_grads_refuse_host_counts_out_of_range(gen):
    x, w = tokens(R, H, gen), _weights(gen)
    g = torch.rand(R, N, generator=gen)
    with pytest.raises(ValueError, match="tokens_per_expert: expected counts >= 0"):
        grouped_mm_grads(g, x, w, torch.tensor([40, -8, 0], dtype=torch.int32), "loop")


def test_grouped_mm_counts_summing_exactly_to_the_rows_pass(gen):
    x, w = tokens(R, H, gen), _weights(gen)
    out = grouped_mm(x, w, torch.tensor([12, 0, 20], dtype=torch.int64))
    want = torch.cat([x[:12] @ w[0].t(), x[12:] @ w[2].t()])
    assert out.shape == (R, N)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("gated", [False, True])
def test_expert_mlp_refuses_bad_counts(gen, gated):
    x = tokens(R, H, gen)
    w1 = torch.rand(E, 2 * N if gated else N, H, generator=gen) - 0.5
    w2 = torch.rand(E, H, N, generator=gen) - 0.5
    with pytest.raises(ValueError, match="tokens_per_expert: expected counts >= 0"):
        expert_mlp(x, w1, w2, torch.tensor([30, -6, 8], dtype=torch.int32), gated=gated)
    with pytest.raises(ValueError, match="tokens_per_expert: expected counts summing"):
        expert_mlp(x, w1, w2, torch.tensor([30, 1, 8], dtype=torch.int32), gated=gated)
    with pytest.raises(TypeError, match="tokens_per_expert"):
        expert_mlp(x, w1, w2, torch.tensor([12.0, 0.0, 20.0]), gated=gated)


def test_dispatch_refuses_zero_topk_naming_it(gen):
    x = tokens(6, H, gen)
    idx, w = routing(6, 2, E, gen)
    with pytest.raises(ValueError, match=r"topk_idx: expected at least one expert per token"):
        dispatch(x, idx[:, :0], w[:, :0], E, budget=8)


@pytest.mark.parametrize("counts, flagged", [([40, -8, 0], True), ([12, 0, 21], True),
                                             ([12, 0, 20], False)])
def test_device_count_check_flags_and_empties_every_group(gen, counts, flagged):
    """The device-side mechanism of NOTE [expert counts], run on CPU tensors: two scalar
    reductions, a sticky OVERFLOW_COUNT flag, and offsets zeroed in place (no host read)."""
    from graphstash import _layout as L
    from graphstash.moe import experts

    x, w = tokens(R, H, gen), _weights(gen)
    c = torch.tensor(counts, dtype=torch.int32)
    bad = (c.min() < 0) | (c.sum() > R)               # what _bad_counts computes on a GPU
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32)
    status[L.SS_OVERFLOW] = 1                          # an earlier pool overflow stays set
    experts.flag_bad_counts(bad, x.device, status)
    assert int(status[L.SS_OVERFLOW]) == (1 | L.OVERFLOW_COUNT if flagged else 1)
    out = experts.grouped_product(x, w, c, "masked", bad)
    if flagged:
        assert experts._offsets(c, bad).tolist() == [0, 0, 0]
        assert torch.equal(out, torch.zeros(R, N))    # every group empty: nothing computed
    else:
        torch.testing.assert_close(out, torch.cat([x[:12] @ w[0].t(), x[12:] @ w[2].t()]))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_masked_fallback_ignores_garbage_past_the_counts(gen, poison):
    """Issue 27.3: rows past the counts are documented as not computed, but the masked
    fallback multiplied them by zero in its weight gradient (NaN * 0 = NaN: every weight
    gradient NaN). It now selects the rows of each expert (NOTE [rows past the counts]):
    its product and both gradients equal the loop's, whatever those rows hold, so the
    expert layer may stash with zero_tail=False under it too."""
    x = tokens(R, H, gen) / R
    w = _weights(gen)
    counts = torch.tensor([9, 0, 14], dtype=torch.int32)            # 23 of 32 rows live
    g = torch.rand(R, N, generator=gen) - 0.5
    x_poisoned = x.clone()
    x_poisoned[23:] = poison
    g_poisoned = g.clone()
    g_poisoned[23:] = poison
    got = grouped_mm_grads(g_poisoned, x_poisoned, w, counts, "masked")
    want = grouped_mm_grads(g, x, w, counts, "loop")
    assert torch.isfinite(got[1]).all()
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0][:23], want[0][:23], rtol=1e-5, atol=1e-6)
    assert want[1].abs().max() > 0.1                                # far from zero
    xp = x_poisoned.clone().requires_grad_()
    wp = w.clone().requires_grad_()
    out = grouped_mm(xp, wp, counts, impl="masked")
    torch.testing.assert_close(out[:23], grouped_mm(x, w, counts, impl="loop")[:23])
    (out[:23] * g[:23]).sum().backward()
    torch.testing.assert_close(wp.grad, want[1], rtol=1e-5, atol=1e-6)


def test_masked_fallback_inside_zero_tail_false_equals_loop(gen):
    """The expert MLP under the masked fallback inside stash_activations(zero_tail=False)
    (what the MoE layer uses) gives the loop's gradients: the rows a reload leaves
    unwritten never reach them."""
    from graphstash.stash import StashConfig, StashManager, stash_activations

    x = torch.randn(16, 8, generator=gen)
    w1, w2 = torch.randn(2, 12, 8, generator=gen), torch.randn(2, 8, 12, generator=gen)
    counts = torch.tensor([5, 7], dtype=torch.int32)
    proj = torch.randn(16, 8, generator=gen)
    grads = {}
    for impl in ("loop", "masked"):
        manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=64,
                                           policy="always"), device="cpu")
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        manager.begin_step()
        with manager:
            with stash_activations(torch.tensor([12], dtype=torch.int32), manager=manager,
                                   zero_tail=False, max_tokens=16):
                y = expert_mlp(x, a, b, counts, impl=impl)
            (y[:12] * proj[:12]).sum().backward()
        manager.end_step()
        grads[impl] = (a.grad, b.grad)
    for got, want in zip(grads["masked"], grads["loop"]):
        assert torch.isfinite(got).all() and want.abs().max() > 0.1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
