"""The experts of a stashed group compute on the rows its pages hold (NOTE [rows the stash
keeps] in graphstash/stash/plan.py), over two gloo ranks: ``dispatch(keep_rows=)`` gives the
same outputs and gradients as the whole budget while the live rows fit and raises the pool's
overflow flag when they do not; ``MoEModel(config, group=g)`` in stash mode under
``graph_step`` computes its stashed groups on those rows and trains as a dropless model does,
through steps whose routing overflows them; rows that creep up grow the stash before they
overflow it (NOTE [stash growth ahead] in graphstash/graph/_step.py)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from graphstash import _layout as L

from _ranks import run_ranks


def test_keep_rows_is_refused_by_name():
    """Out of range, or through an exchange whose plans cannot leave rows out (one device)."""
    from graphstash.moe import dispatch

    from _exchange_cases import rank_data

    x, idx, w, _ = rank_data(1, 0, 8, 4, torch.device("cpu"))
    for keep, why in ((0, "keep_rows"), (True, "keep_rows"), (33, "at most the budget"),
                      (8, "only a live-row exchange")):
        with pytest.raises((TypeError, ValueError), match=why):
            dispatch(x, idx, w, 4, budget=32, keep_rows=keep)


def _layer(transport, seed: int, keep_rows, budget: int):
    """One MoE layer (gated experts, router weights on the activations) through the
    exchange with ``keep_rows``; ``(output, grads, permuted rows, counts sum, status)``."""
    from graphstash.moe import combine, dispatch, expert_mlp

    from _exchange_cases import expert_weights, rank_data

    rank, world = transport.rank, transport.world_size
    E = 4
    El = E // world
    x, idx, w, proj = rank_data(seed, rank, 24, E, torch.device("cpu"))
    x.requires_grad_(), w.requires_grad_()
    w1, w2 = (t[rank * El:(rank + 1) * El].clone().requires_grad_()
              for t in expert_weights(seed, E, torch.device("cpu")))
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32)
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=4,
                                        exchange=transport, status=status, keep_rows=keep_rows)
    y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), gated=True,
                   handle=handle)
    out = combine(y, handle, weighted=False)
    (out.double() * proj.double()).sum().backward()
    return (out.detach(), (x.grad, w.grad, w1.grad, w2.grad), permuted.shape[0],
            int(counts.sum()), status)


def _keep_rows_ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    from graphstash.moe.exchange import build_gloo_transport

    from _exchange_cases import H, fitting_budget

    budget = fitting_budget(24, world, 4, 4)
    transport = build_gloo_transport(capacity_rows=budget, row_bytes=H * 4, max_experts=4)
    full = _layer(transport, 3, None, budget)
    assert full[2] == budget and int(full[4][L.SS_OVERFLOW]) == 0
    live = full[3]
    for g in full[1]:
        assert g.abs().max() > 1e-3, "reference gradients must be far from zero"
    # the live rows fit: every output and gradient is the whole budget's, bit for bit
    fit = -(-live // 4) * 4
    kept = _layer(transport, 3, fit, budget)
    assert kept[2] == fit < budget and kept[3] == live
    assert int(kept[4][L.SS_OVERFLOW]) == 0
    assert torch.equal(kept[0], full[0])
    for name, a, b in zip(("x", "topk_weight", "w1", "w2"), kept[1], full[1]):
        assert torch.equal(a, b), f"rank {rank}: the gradient of {name} changed"
    # rank 0 keeps half its live rows: it flags the pool's overflow, and the rows it left
    # out reach no token (some output differs somewhere)
    half = (live // 2) // 4 * 4 if rank == 0 else None
    cut = _layer(transport, 3, half, budget)
    if rank == 0:
        assert cut[2] == half and cut[3] == half
        assert int(cut[4][L.SS_OVERFLOW]) & L.OVERFLOW_POOL
    else:
        assert int(cut[4][L.SS_OVERFLOW]) == 0
    differs = torch.tensor([int(not torch.equal(cut[0], full[0]))])
    dist.all_reduce(differs)
    assert int(differs) >= 1
    transport.close()


def test_keep_rows_equals_the_whole_budget_while_the_rows_fit_and_flags_when_not():
    run_ranks(_keep_rows_ranks, 2)


def _train_against_dropless(rank: int, world: int, *, routing: str, tokens: int, seed: int,
                            steps: int, route, probe=None, resend_rows: bool = False,
                            overlap_sms: int | None = None, topk: int = 2):
    """README's ``MoEModel(config, group=g)`` in stash mode (every group stashed) under
    graph_step, its experts trained on this rank's tokens, against the dropless model trained
    on every rank's; ``route(i, model, ref)`` sets both routings before step ``i``; ``probe()``,
    if given, runs inside the step function, after the backward; ``resend_rows`` and
    ``overlap_sms``: the config's (NOTE [resent rows], NOTE [exchange beside the experts]; on
    the CPU 1 pushes the input gradients home from the experts' backward, in line); ``topk``
    above the ranks: README's default moves the gathered tokens (NOTE [auto exchange]).
    Checks the experts end equal and returns the decorated step (``.stats``,
    ``.stash_manager``)."""
    import torch.distributed as dist

    import graphstash
    from graphstash.models import MoEConfig, MoEModel
    from graphstash.stash import StashConfig

    from _exchange_cases import assert_trained_close, train_experts_only

    E = 4
    config = MoEConfig(hidden=16, ffn=16, num_experts=E, topk=topk, layers=3, num_tokens=tokens,
                       capacity_factor=float(world), pad_multiple=4, gated=True,
                       routing=routing)
    model = MoEModel(dataclasses.replace(config, resend_rows=resend_rows,
                                         overlap_sms=overlap_sms), mode="stash",
                     group=dist.group.WORLD, seed=5)
    ref = MoEModel(config, mode="dropless", seed=5)
    experts, ref_experts = train_experts_only(model), train_experts_only(ref)
    opt = torch.optim.AdamW(experts, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_experts, lr=1e-2)

    @graphstash.graph_step(optimizer=opt, stash=StashConfig(policy="always", page_size=4,
                                                             min_tensor_bytes=0))
    def train_step(x, proj):
        loss = (model(x).float() * proj).sum()
        loss.backward()
        if probe is not None:
            probe()
        return loss.detach()

    El = E // world
    gen = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "graphstash.graph_step", RuntimeWarning)
        for i in range(steps):
            xs = [torch.randn(tokens, 16, generator=gen) for _ in range(world)]
            projs = [torch.randn(tokens, 16, generator=gen) for _ in range(world)]
            with torch.no_grad():
                route(i, model, ref)
            train_step(xs[rank], projs[rank])
            ref_opt.zero_grad()
            (ref(torch.cat(xs)).float() * torch.cat(projs)).sum().backward()
            # after every call p.grad is that step's gradient, reruns that grew the stash
            # included (NOTE [gradients])
            for j, (p, q) in enumerate(zip(experts, ref_experts)):
                assert p.grad is not None, f"step {i}: expert weight {j} has no gradient"
                assert_trained_close(p.grad, q.grad[rank * El:(rank + 1) * El],
                                     f"step {i}: rank {rank} gradient of expert weight {j}")
            ref_opt.step()
    stats = train_step.stats
    assert stats.steps == steps, stats
    assert model.exchange_kind.endswith(", resent") == resend_rows, model.exchange_kind
    want = "gathered tokens" if topk > world and overlap_sms is None else "live rows over"
    assert model.exchange_kind.startswith(want), model.exchange_kind
    for i, (p, q) in enumerate(zip(experts, ref_experts)):
        assert q.grad.abs().max() > 1e-4, f"reference gradient {i} is ~0"
        assert_trained_close(p, q[rank * El:(rank + 1) * El], f"rank {rank} expert weight {i}")
    return train_step


def _drift(i: int, model, ref) -> None:
    model.set_routing_step(i)
    for a, b in zip(model.blocks, ref.blocks):
        b.routing_bias.copy_(a.routing_bias)


def _model_ranks(rank: int, world: int, resend_rows: bool = False,
                 overlap_sms: int | None = None) -> dict:
    """Routing that drifts between the ranks' experts, so some steps fill more rows than the
    first step measured; every dispatch's kept rows recorded; ``resend_rows``: the rows
    pushed again in backward, not kept (NOTE [resent rows])."""
    import torch.distributed as dist

    from graphstash.moe.exchange import ExchangePlan

    kept_rows = []
    real_keep = ExchangePlan.keep_rows

    def spy(plan, rows):
        kept_rows.append((rows, plan.budget_rows))
        return real_keep(plan, rows)

    ExchangePlan.keep_rows = spy
    try:
        stats = _train_against_dropless(rank, world, routing="drift:0.7:2", tokens=32, seed=11,
                                        steps=8, route=_drift, resend_rows=resend_rows,
                                        overlap_sms=overlap_sms).stats
    finally:
        ExchangePlan.keep_rows = real_keep
    assert kept_rows and all(rows < budget for rows, budget in kept_rows), kept_rows
    # the budget holds any routing: every rerun (with a grown stash, NOTE [rerun by capture],
    # or dropless) was an overflow of the rows kept, and grew it
    assert stats.stash_growths == stats.reruns, stats
    overflowed = torch.tensor([stats.reruns])
    dist.all_reduce(overflowed, op=dist.ReduceOp.MIN)
    return {"kept": len(kept_rows), "reruns": stats.reruns,
            "every_rank_reran": int(overflowed)}


@pytest.mark.parametrize("resend_rows,overlap_sms", [(False, None), (True, None), (False, 1),
                                                    (True, 1)],
                         ids=["kept", "resent", "kept-sent-home-early", "resent-sent-home-early"])
def test_moe_model_stash_computes_on_the_kept_rows_and_trains_as_dropless(resend_rows,
                                                                          overlap_sms):
    results = run_ranks(_model_ranks, 2, resend_rows, overlap_sms)
    for text in results:
        report = eval(text)
        # the three layers of at least the first step after the plan computed on fewer rows
        # than their budget, and the drifting routing overflowed what the first step
        # measured at least once (every rank reran: the flags are summed over the ranks)
        assert report["kept"] >= 3, report
        assert report["every_rank_reran"] >= 1, report


def _gathered_ranks(rank: int, world: int, resend_rows: bool) -> dict:
    """Top-3 of 4 experts over two ranks, drifting: README's default gathers the tokens
    (NOTE [auto exchange]); stashed, rerun where a step overflows (the drift overflows the
    stash's pool once, and it grows), equal to dropless."""
    stats = _train_against_dropless(rank, world, routing="drift:0.7:2", tokens=32, seed=13,
                                    steps=8, route=_drift, resend_rows=resend_rows,
                                    topk=3).stats
    return {"steps": stats.steps, "reran": stats.reruns >= 1}


@pytest.mark.parametrize("resend_rows", [False, True], ids=["kept", "resent"])
def test_moe_model_stash_with_the_gathered_tokens_trains_as_dropless(resend_rows):
    assert run_ranks(_gathered_ranks, 2, resend_rows) == [str({"steps": 8, "reran": True})] * 2


def _creep(i: int, model, ref) -> None:
    """Rank 0's experts (the first two of four) gain 0.08 of router bias a step, as a
    training router's preference moves."""
    for m in (model, ref):
        for block in m.blocks:
            block.routing_bias.zero_()
            block.routing_bias[:2] = 0.08 * i


def _gradual_ranks(rank: int, world: int, grow_ahead: float) -> dict:
    """Rows that creep up step by step; ``grow_ahead`` is the fill that grows the stash
    (above 1: never ahead)."""
    import graphstash.stash.manager as stash_manager

    stash_manager.GROW_AHEAD = grow_ahead
    stats = _train_against_dropless(rank, world, routing="skew:0.0", tokens=256, seed=12,
                                    steps=10, route=_creep).stats
    assert stats.stash_growths == stats.reruns, stats
    return {"reruns": stats.reruns, "ahead": stats.stash_grown_ahead}


@pytest.mark.parametrize("grow_ahead", [0.97, 2.0], ids=["ahead", "never-ahead"])
def test_rows_that_creep_up_grow_the_stash_before_it_overflows(grow_ahead):
    """NOTE [stash growth ahead]: the stash grows once a step fills 0.97 of what a group keeps,
    so rows that creep up step by step never overflow it; without growing ahead the same steps
    overflow and rerun. Both train as the dropless model does."""
    reports = [eval(text) for text in run_ranks(_gradual_ranks, 2, grow_ahead)]
    for report in reports:
        if grow_ahead < 1:
            assert report["reruns"] == 0 and report["ahead"] >= 1, reports
        else:
            assert report["reruns"] >= 1 and report["ahead"] == 0, reports


def _jump(i: int, model, ref) -> None:
    """Rank 1's experts (the last two of four) favoured by 1.0 of router bias for three steps,
    then rank 0's: the rows of rank 0 jump to about 2.5 times what its plan measured (its
    ``device_factor`` goes from 1.1 to 2.8), as under ``drift`` when the favoured rank
    moves."""
    for m in (model, ref):
        for block in m.blocks:
            block.routing_bias.zero_()
            block.routing_bias[2:] = 1.0 if i < 3 else 0.0
            block.routing_bias[:2] = 0.0 if i < 3 else 1.0


def _jump_ranks(rank: int, world: int) -> dict:
    """Rows that jump once: the reruns, what the plan stashes and the pages it holds, and
    whether the stash held its pages while each run of the step function ran."""
    import graphstash
    from graphstash.stash import current_manager

    runs = []
    step = _train_against_dropless(
        rank, world, routing="skew:0.0", tokens=256, seed=13, steps=9, route=_jump,
        probe=lambda: runs.append((graphstash.is_dropless(), current_manager().released)))
    stats, manager = step.stats, step.stash_manager
    assert stats.stash_growths == stats.reruns, stats
    # the pages are released while a dropless rerun runs, and only then (NOTE [rerun memory])
    assert [dropless for dropless, _ in runs].count(True) == stats.eager_reruns, runs
    assert all(released == dropless for dropless, released in runs), runs
    stashed = [row for row in manager.plan() if row["stashed"]]
    pool = sum(b.num_device_pages * b.page_bytes for b in manager.buffers.values())
    return {"reruns": stats.reruns, "dropless": stats.eager_reruns,
            "stashed": len(stashed), "pool": pool,
            "freed": sum(row["budget_bytes"] for row in stashed),
            "why": sorted({row["why"][:12] for row in manager.plan()})}


def test_rows_that_jump_grow_the_stash_to_the_need_or_it_steps_aside():
    """NOTE [growth to the need]: when rank 0's rows jump to about 2.5 times what its plan
    measured, one rerun grows its stash to the rows asked for (growing by ``budget_growth``
    1.5 alone took two, and overshot: both ranks stepped aside); rank 1, whose plan measured
    the favoured rows, would then hold more pages than the budget rows its stash frees and
    steps aside. The rerun runs the step with the grown stash, not dropless (NOTE [rerun by
    capture]): it fits. Rank 0's pages stay below the budget rows they replace, and both
    train as the dropless model does."""
    reports = [eval(text) for text in run_ranks(_jump_ranks, 2)]
    rank0, rank1 = reports
    assert rank0["reruns"] == 1 and rank0["dropless"] == 0, reports
    assert rank0["stashed"] >= 1 and 0 < rank0["pool"] < rank0["freed"], reports
    assert rank1["stashed"] == 0 and rank1["pool"] == 0, reports
    assert "steps aside:" in rank1["why"], reports
