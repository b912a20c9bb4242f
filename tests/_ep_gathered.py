"""Gathered tokens (NOTE [gathered tokens] in graphstash/moe/exchange/gathered.py), called as a
user would: ``MoEModel(MoEConfig(..., exchange_kind="gathered tokens"), group=g)`` built then
moved, and ``dispatch(..., exchange=GatheredTokens(group))`` with a weighted combine, against
the one-device reference in outputs and every gradient. One function per case, run by each
rank (gloo ranks on the CPU in test_moe_ep_gathered.py, one rank per GPU in
test_moe_ep_default_gpu.py)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from _ep_default import (GRAD_TOLERANCE, TOLERANCE, T, check_grads, config_for,
                         forward_backward, gathered_grads, rank_inputs, saved_row_counts)
from graphstash.models import MoEModel


def model_case(rank: int, world: int, device: torch.device, dtypes, auto: bool = False,
               **over) -> dict:
    """For each dtype (the models are moved to each in turn): outputs and every gradient of
    the gathered-token model, kept and regathered (``resend_rows``), equal the one-device
    reference's. What each keeps beside the tokens: the regathered model nothing; the kept
    one, per layer, the ``[W * T, hidden]`` gathered tokens where they are fewer than its
    budget rows (every layer at ``capacity_factor=world``), else the rows (dropless, each
    rank's own demand). ``over``: config fields (routing, budget). ``auto``: the config names
    no exchange (README's default, NOTE [auto exchange]) and routes each token to ``world +
    1`` experts, so the default picks the gathered tokens."""
    if auto:
        config = config_for(world, **{"topk": world + 1, **over})
        assert config.exchange_kind == "auto"
    else:
        config = dataclasses.replace(config_for(world, **over), exchange_kind="gathered tokens")
    group = dist.group.WORLD
    configs = {"gathered": config,
               "gathered, resent": dataclasses.replace(config, resend_rows=True)}
    models = {what: MoEModel(c, group=group, seed=3) for what, c in configs.items()}
    kinds = []
    for dtype in dtypes:
        models = {what: m.to(device, dtype) for what, m in models.items()}  # build, then move
        ref = MoEModel(config, mode="dropless", seed=3).to(device, dtype)
        xs, projs = rank_inputs(rank, world, device, dtype)
        for m in (*models.values(), ref):
            m.zero_grad(set_to_none=True)
        outs = {what: forward_backward(m, xs[rank], projs[rank]) for what, m in models.items()}
        out_ref = forward_backward(ref, torch.cat(xs), torch.cat(projs)).chunk(world)[rank]
        for what, out in outs.items():
            torch.testing.assert_close(out, out_ref, **TOLERANCE[dtype],
                                       msg=lambda m: f"{what} output vs reference: {m}")
        check_grads(ref, {what: gathered_grads(m, rank, world) for what, m in models.items()},
                     rank, dtype)
        kinds.append([m.exchange_kind for m in models.values()])
    from graphstash import is_dropless

    kept = [n for n in saved_row_counts(models["gathered"], xs[rank]) if n != T]
    assert len(kept) == config.layers and max(kept) <= world * T, kept
    if not is_dropless():     # the budget is at least twice the gathered tokens
        assert config.capacity_factor * config.topk >= 2 * world
        assert kept == [world * T] * config.layers, kept
    assert set(saved_row_counts(models["gathered, resent"], xs[rank])) == {T}
    return {"kinds": kinds}


def weighted_case(rank: int, world: int, device: torch.device, dtype) -> list[str]:
    """``dispatch`` / ``expert_mlp(handle=)`` / ``combine(weighted=True)`` through
    ``GatheredTokens(group)``: the output and the gradients of the tokens, the router
    weights and the experts equal one device's over all the ranks' tokens, at top-3 (the
    budget is more rows than the gathered tokens: the experts keep those and take their rows
    from them again) and top-1 (the budget is the gathered tokens' rows: the rows are kept).
    Returns what each kept."""
    return [_weighted(rank, world, device, dtype, K) for K in (3, 1)]


def _weighted(rank: int, world: int, device: torch.device, dtype, K: int) -> str:
    from graphstash.moe import budget_rows, combine, dispatch, expert_mlp
    from graphstash.moe.exchange import GatheredTokens

    H, F, E = 16, 24, 8
    El = E // world
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(world * T, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(world * T)])
    ws = torch.rand(world * T, K, generator=g, dtype=torch.float64) + 0.5
    w1 = torch.randn(E, 2 * F, H, generator=g, dtype=torch.float64) * 0.3
    w2 = torch.randn(E, H, F, generator=g, dtype=torch.float64) * 0.3
    proj = torch.randn(world * T, H, generator=g, dtype=torch.float64)

    kept = []

    def run(x, i, w, a, b, exchange):       # a budget that holds every routing
        budget = budget_rows(world * T, K, E, capacity_factor=float(world),
                             world_size=world if exchange is not None else 1)
        permuted, counts, handle = dispatch(x, i, w, E, budget=budget, exchange=exchange)
        if exchange is not None:
            kept.append("tokens" if handle.regathers else "rows")
            assert handle.regathers == (world * T < budget), (world * T, budget)
            assert handle.source.shape[0] == (world * T if handle.regathers else T)
        y = expert_mlp(permuted, a, b, counts, gated=True, handle=handle)
        return combine(y, handle, weighted=True)

    def leaves(*ts):
        return [t.detach().to(device, dtype).requires_grad_() for t in ts]

    mine = slice(rank * T, (rank + 1) * T)
    x, w, a, b = leaves(xs[mine], ws[mine], w1[rank * El:(rank + 1) * El],
                        w2[rank * El:(rank + 1) * El])
    out = run(x, idx[mine].to(device), w, a, b, GatheredTokens(dist.group.WORLD))
    (out * proj[mine].to(device, dtype)).sum().backward()
    rx, rw, ra, rb = leaves(xs, ws, w1, w2)
    ref = run(rx, idx.to(device), rw, ra, rb, None)
    (ref * proj.to(device, dtype)).sum().backward()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref[mine], **tol)
    for name, got, want in (("x", x.grad, rx.grad[mine]), ("weights", w.grad, rw.grad[mine]),
                            ("w1", a.grad, ra.grad[rank * El:(rank + 1) * El]),
                            ("w2", b.grad, rb.grad[rank * El:(rank + 1) * El])):
        scale = want.abs().max().item()
        assert scale > 1e-3, f"reference gradient of {name} is ~0"
        err = (got - want).abs().max().item()
        assert err <= GRAD_TOLERANCE[dtype] * scale, f"{name}: {err:.3g} of {scale:.3g}"
    return kept[0]
