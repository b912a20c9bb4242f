"""The cases of the live-row exchange tests, run by every rank of a group (gloo on the CPU,
CUDA IPC on one GPU) against the one-device reference.

Every rank builds the data of every rank from one seed: rank ``r``'s tokens hold ``1000 * r``
plus their index (``_moe_data.tokens``), so a row in the wrong place is a readable diff. The
one-device reference dispatches the tokens of all ranks with every expert (``dispatch(group=
None)``, dropless), runs the same experts and combines; a rank compares its own outputs and the
gradients of its tokens, router weights and local experts with the reference's. The loss is a
fixed random projection of the output (it reaches every parameter), and the reference
gradients are checked to be far from zero.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from graphstash import _layout as L
from graphstash.moe import budget_rows, combine, dispatch, expert_mlp

from _moe_data import routing, tokens

H, F, K = 16, 16, 2


def rank_data(seed: int, rank: int, T: int, E: int, device, dtype=torch.float32, skew=None):
    """Rank ``rank``'s tokens ``[T, H]``, routing ``[T, K]`` and output projection."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = tokens(T, H, gen, torch.float64, offset=1000 * rank) / (1000 * (rank + 1))
    idx, w = routing(T, K, E, gen, torch.float64, skew=skew)
    proj = torch.randn(T, H, generator=gen, dtype=torch.float64)
    return x.to(device, dtype), idx.to(device), w.to(device, dtype), proj.to(device, dtype)


def expert_weights(seed: int, E: int, device, dtype=torch.float32, gated=True):
    """Full gated expert weights (HF layout): w1 ``[E, 2F, H]``, w2 ``[E, H, F]``."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, (2 if gated else 1) * F, H, generator=gen, dtype=torch.float64) / math.sqrt(H)
    w2 = torch.randn(E, H, F, generator=gen, dtype=torch.float64) / math.sqrt(F)
    return w1.to(device, dtype), w2.to(device, dtype)


def moe_layer(x, idx, w, w1, w2, E, *, budget, pad, exchange=None, status=None,
              weighted=False, stash=None):
    """dispatch -> gated expert MLP -> combine; the router weights scale the activations
    (``permuted_weights``) or, ``weighted``, the combine."""
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=pad,
                                        exchange=exchange, status=status)
    row_weight = None if weighted else handle.permuted_weights()

    def experts():
        return expert_mlp(permuted, w1, w2, counts, row_weight, gated=True, handle=handle)

    if stash is not None:
        with stash(handle):
            y = experts()
    else:
        y = experts()
    return combine(y, handle, weighted=weighted), handle


def reference(seed: int, world: int, T: int, E: int, device, *, weighted=False, skew=None,
              layers=1, dtype=torch.float32, seed_weights=None):
    """One device, all ranks' tokens, every expert, dropless: per rank the output, the
    gradients of its tokens and router weights; the gradients of every expert's weights
    (drawn from ``seed_weights``, default ``seed``)."""
    data = [rank_data(seed, r, T, E, device, dtype, skew=skew) for r in range(world)]
    x = torch.cat([d[0] for d in data]).requires_grad_()
    idx = torch.cat([d[1] for d in data])
    w = torch.cat([d[2] for d in data]).requires_grad_()
    proj = torch.cat([d[3] for d in data])
    w1, w2 = (t.requires_grad_() for t in expert_weights(
        seed if seed_weights is None else seed_weights, E, device, dtype))
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    h = x
    for _ in range(layers):
        out, _ = moe_layer(h, idx, w, w1, w2, E, budget=None, pad=None, status=status,
                           weighted=weighted)
        h = h + out
    (h.float() * proj.float()).sum().backward()
    grads = (x.grad, w.grad, w1.grad, w2.grad)
    for g in grads:
        assert g.abs().max() > 1e-3, "reference gradients must be far from zero"
    return [t.chunk(world) if t is not None else None for t in (h.detach(), x.grad, w.grad)], \
        (w1.grad, w2.grad)


def run_rank(transport, seed: int, T: int, E: int, device, *, budget, pad, weighted=False,
             skew=None, layers=1, stash=None, status=None):
    """This rank's forward and backward through ``transport``; returns its output and
    gradients ``(out, gx, gw, g_w1, g_w2)`` (expert gradients of its local experts)."""
    rank, world = transport.rank, transport.world_size
    x, idx, w, proj = rank_data(seed, rank, T, E, device, skew=skew)
    x.requires_grad_(), w.requires_grad_()
    El = E // world
    w1, w2 = (t[rank * El:(rank + 1) * El].clone().requires_grad_()
              for t in expert_weights(seed, E, device))
    if status is None:
        status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    h = x
    for _ in range(layers):
        out, _ = moe_layer(h, idx, w, w1, w2, E, budget=budget, pad=pad, exchange=transport,
                           status=status, weighted=weighted, stash=stash)
        h = h + out
    (h.float() * proj.float()).sum().backward()
    return h.detach(), x.grad, w.grad, w1.grad, w2.grad, status


def compare(mine, ref, rank: int, world: int, E: int, *, rtol=1e-5, atol=1e-6,
            exact: bool = False, experts_reached: bool = True) -> None:
    """Assert this rank's results equal the reference's (``exact``: bitwise); the reference
    gradients this rank compares far from zero: its tokens' and router weights', and its
    experts' unless ``experts_reached`` is False (a skewed routing that may send no row to
    this rank's experts)."""
    from _grad_checks import assert_far_from_zero

    (outs, gxs, gws), (gw1, gw2) = ref
    out, gx, gw, g1, g2 = mine[:5]
    El = E // world
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=rtol, atol=atol)
    pairs = [("output", out, outs[rank]), ("x.grad", gx, gxs[rank]),
             ("topk_weight.grad", gw, gws[rank]),
             ("w1.grad", g1, gw1[rank * El:(rank + 1) * El]),
             ("w2.grad", g2, gw2[rank * El:(rank + 1) * El])]
    checked = pairs[1:] if experts_reached else pairs[1:3]
    assert_far_from_zero({f"rank {rank} {name}": want for name, _, want in checked})
    for name, got, want in pairs:
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"rank {rank} {n}: {m}")


def assert_trained_close(mine: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Parameters after AdamW steps: ``||mine - want|| <= 1e-4 ||want||``. Adam divides each
    gradient by its running magnitude, so rounding differences between GEMM implementations
    (a captured Triton grouped GEMM against the eager reference's) grow where a gradient is
    near zero; a row in the wrong place moves the norm by far more."""
    diff = float((mine.detach().double() - want.detach().double()).norm())
    scale = float(want.detach().double().norm())
    assert diff <= 1e-4 * scale, f"{what}: ||diff|| = {diff:.3e}, ||reference|| = {scale:.3e}"


def fitting_budget(T: int, world: int, E: int, pad) -> int:
    """A budget no routing exceeds: every pair of every rank."""
    return budget_rows(T * world, K, E, capacity_factor=float(world), pad_multiple=pad,
                       world_size=world)


def graph_step_case(transport, E: int, T: int, steps: int, device, *, stash: bool = False) -> dict:
    """graph_step with AdamW over the local experts, ``steps`` calls with changing routing
    (experts 0 and 1 take every token in every fifth step, 4x their share: over the budget);
    the flags travel through the transport, so every rank reruns the same steps dropless and
    applies exactly one update per call. The experts end equal to the one-device model
    trained dropless on every rank's tokens. On the CPU graph_step runs every call eagerly."""
    import graphstash
    from graphstash.moe import budget_rows
    from graphstash.stash import StashConfig, stash_activations

    rank, world = transport.rank, transport.world_size
    El = E // world
    w1f, w2f = expert_weights(30, E, device)
    w1 = torch.nn.Parameter(w1f[rank * El:(rank + 1) * El].clone())
    w2 = torch.nn.Parameter(w2f[rank * El:(rank + 1) * El].clone())
    opt = torch.optim.AdamW([w1, w2], lr=1e-2, capturable=device.type == "cuda")
    budget = budget_rows(T * world, K, E, capacity_factor=1.25, pad_multiple=4, world_size=world)
    config = StashConfig(policy="always", min_tensor_bytes=0, page_size=16) if stash else None

    def stashing(handle):
        return stash_activations(handle.live_rows, max_tokens=handle.budget_rows)

    @graphstash.graph_step(optimizer=opt, distributed=False, stash=config)
    def train_step(x, idx, w, proj):
        out, _ = moe_layer(x, idx, w, w1, w2, E, budget=budget, pad=4, exchange=transport,
                           stash=stashing if stash else None)
        loss = (out * proj).sum()
        loss.backward()
        transport.all_reduce_flags_(train_step.status[L.SS_OVERFLOW:L.SS_OVER_BUDGET + 1])
        return loss.detach()

    def batch(i):
        x, idx, w, proj = rank_data(200 + i, rank, T, E, device)
        if i % 5 == 4:                       # experts 0 and 1 (on rank 0) take every token
            idx[:, 0], idx[:, 1] = 0, 1
        return x, idx, w, proj

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "graphstash.graph_step", RuntimeWarning)   # CPU: eager
        for i in range(steps):
            train_step(*batch(i))
    transport.check()
    stats = train_step.stats
    assert stats.steps == steps, stats
    if device.type == "cuda":
        assert stats.replays >= steps - 3 - stats.eager_reruns, stats
    assert stats.eager_reruns >= steps // 5, stats     # every skewed step went over the budget

    # the one-device model, dropless, trained on every rank's tokens
    r1, r2 = (torch.nn.Parameter(t.clone()) for t in (w1f, w2f))
    ropt = torch.optim.AdamW([r1, r2], lr=1e-2)
    for i in range(steps):
        data = []
        for r in range(world):
            x, idx, w, proj = rank_data(200 + i, r, T, E, device)
            if i % 5 == 4:
                idx[:, 0], idx[:, 1] = 0, 1
            data.append((x, idx, w, proj))
        x, idx, w, proj = (torch.cat(t) for t in zip(*data))
        ropt.zero_grad()
        out, _ = moe_layer(x, idx, w, r1, r2, E, budget=None, pad=None)
        (out * proj).sum().backward()
        ropt.step()
    for name, mine, full in (("w1", w1, r1), ("w2", w2, r2)):
        assert_trained_close(mine, full[rank * El:(rank + 1) * El], f"rank {rank} {name}")
    return {"steps": stats.steps, "replays": stats.replays, "reruns": stats.eager_reruns,
            "captures": stats.captures}


def train_experts_only(model) -> list:
    """Freeze every parameter of ``model`` but the experts' (``w1``, ``w2``); returns those."""
    experts = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("w1", "w2")))
        if p.requires_grad:
            experts.append(p)
    return experts


def moe_model_case(transport, T: int, E: int, device, *, stash_steps: int = 6) -> dict:
    """``MoEModel`` with the live-row exchange (gated experts, two layers, experts padded to
    4): in budget mode, eager, its output and every gradient equal the one-device model's
    (the replicated router and norm gradients summed over the ranks, on the host); in stash
    mode under graph_step (experts trained, the rest frozen), and in budget mode with the rows
    resent (NOTE [resent rows]), the experts end equal to the one-device model trained
    dropless on every rank's tokens."""
    import torch.distributed as dist

    from graphstash.models import MoEConfig, MoEModel
    from graphstash.stash import StashConfig

    rank, world = transport.rank, transport.world_size
    El = E // world
    config = MoEConfig(hidden=H, ffn=F, num_experts=E, topk=K, layers=2, num_tokens=T,
                       capacity_factor=float(world), pad_multiple=4, gated=True)
    group = dist.group.WORLD
    xs = [rank_data(60, r, T, E, device)[0] for r in range(world)]
    projs = [rank_data(61, r, T, E, device)[3] for r in range(world)]

    model = MoEModel(config, mode="budget", group=group, exchange=transport, seed=5, device=device)
    assert model.exchange_kind == f"live rows over {transport.kind}"
    ref = MoEModel(config, mode="dropless", seed=5, device=device)
    out = model(xs[rank])
    (out.float() * projs[rank]).sum().backward()
    ref_out = ref(torch.cat(xs))
    (ref_out.float() * torch.cat(projs)).sum().backward()
    torch.testing.assert_close(out.detach(), ref_out.detach().chunk(world)[rank], rtol=1e-5,
                               atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert q.grad.abs().max() > 1e-4, f"reference gradient of {name} is ~0"
        if name.endswith(("w1", "w2")):
            want = q.grad[rank * El:(rank + 1) * El]
            got = p.grad
        else:                                   # replicated: this rank's share of the sum
            got = p.grad.detach().cpu()
            dist.all_reduce(got)
            want = q.grad.cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"rank {rank} {n}: {m}")

    # inside graph_step, experts trained: stash mode, then budget mode with the rows resent
    # (NOTE [resent rows])
    report = {}
    for mode, resend_rows in (("stash", False), ("budget", True)):
        model = MoEModel(dataclasses.replace(config, resend_rows=resend_rows), mode=mode,
                         group=group, exchange=transport, seed=5, device=device)
        assert model.exchange_kind.endswith(", resent") == resend_rows, model.exchange_kind
        ref = MoEModel(config, mode="dropless", seed=5, device=device)
        experts, ref_experts = train_experts_only(model), train_experts_only(ref)
        opt = torch.optim.AdamW(experts, lr=1e-2, capturable=device.type == "cuda")
        ref_opt = torch.optim.AdamW(ref_experts, lr=1e-2)
        stash = StashConfig(policy="always", min_tensor_bytes=0, page_size=16) \
            if mode == "stash" else None
        train_step = _trained_step(model, opt, transport, stash)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "graphstash.graph_step", RuntimeWarning)
            for i in range(stash_steps):
                train_step(rank_data(70 + i, rank, T, E, device)[0], projs[rank])
                ref_opt.zero_grad()
                x = torch.cat([rank_data(70 + i, r, T, E, device)[0] for r in range(world)])
                (ref(x).float() * torch.cat(projs)).sum().backward()
                # each call's gradients too: AdamW's step does not see a gradient's scale
                for j, (p, q) in enumerate(zip(experts, ref_experts)):
                    assert_trained_close(p.grad, q.grad[rank * El:(rank + 1) * El],
                                         f"step {i}: rank {rank} {mode} gradient {j}")
                ref_opt.step()
        stats = train_step.stats
        assert stats.steps == stash_steps, stats    # a stash overflow reruns, updating once
        for i, (p, q) in enumerate(zip(experts, ref_experts)):
            assert_trained_close(p, q[rank * El:(rank + 1) * El],
                                 f"rank {rank} {mode} expert weight {i}")
        if mode == "stash":
            report.update({"stash_steps": stats.steps, "replays": stats.replays,
                           "reruns": stats.reruns, "stash_pages_peak": stats.stash_pages_peak})
        else:
            report["resent_replays"] = stats.replays
            if device.type == "cuda":               # the resend captured and replayed
                assert stats.replays >= 1, stats
    return report


def _trained_step(model, opt, transport, stash):
    """``graph_step`` over a projection loss of ``model``, the step's flags summed through
    ``transport``."""
    import graphstash

    @graphstash.graph_step(optimizer=opt, distributed=False, stash=stash)
    def train_step(x, proj):
        loss = (model(x).float() * proj).sum()
        loss.backward()
        transport.all_reduce_flags_(train_step.status[L.SS_OVERFLOW:L.SS_OVER_BUDGET + 1])
        return loss.detach()

    return train_step
