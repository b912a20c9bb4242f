"""NOTE [stash plan]: the manager stashes only where its warmup measurement says that lowers
the peak, shows the decision, and can be forced either way."""
from __future__ import annotations

import pytest
import torch

from graphstash.models import MoEConfig, MoEModel
from graphstash.stash import StashConfig, StashManager

from _grad_checks import assert_far_from_zero, named_grads, projected_loss, projection
from _moe_data import tokens


def _pair(config: MoEConfig, policy: str = "auto"):
    """A CPU stash manager, a stash-mode model on it and the budget-mode model it must equal."""
    manager = StashManager(StashConfig(min_tensor_bytes=0, policy=policy), device="cpu")
    return (manager, MoEModel(config, mode="stash", stash_manager=manager, seed=5),
            MoEModel(config, mode="budget", seed=5))


def _step_both(manager, model, ref, config: MoEConfig, gen) -> None:
    """One step of both models on one batch; their gradients equal bitwise, and far from 0."""
    x = tokens(config.num_tokens, config.hidden, gen) / config.num_tokens
    proj = projection((config.num_tokens, config.hidden), gen)   # reaches every parameter
    manager.begin_step()
    with manager:
        projected_loss(model(x), proj).backward()
    manager.end_step()
    projected_loss(ref(x), proj).backward()
    assert_far_from_zero(named_grads(ref))
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def _train(config: MoEConfig, policy: str, gen, steps: int = 2):
    manager, model, ref = _pair(config, policy)
    for _ in range(steps):
        _step_both(manager, model, ref, config, gen)
    return manager


def _config(capacity_factor: float, layers: int = 4) -> MoEConfig:
    return MoEConfig(hidden=32, ffn=48, num_experts=4, topk=2, layers=layers, num_tokens=64,
                     capacity_factor=capacity_factor)


def test_no_dead_rows_steps_aside(gen):
    """Budget = the dropless rows (one GPU, factor 1): the pool would cost more than it frees,
    so nothing is stashed and no buffer is created; gradients equal the budget model's."""
    manager = _train(_config(1.0), "auto", gen)
    plan = manager.plan()
    assert [r["group"] for r in plan] == [0, 1, 2, 3]
    assert not any(r["stashed"] for r in plan)
    assert all(r["budget_bytes"] > 0 and r["live_bytes"] >= r["budget_bytes"] for r in plan)
    assert manager.buffers == {}
    assert "costs" in plan[0]["why"] and "last group" in plan[-1]["why"]
    lines = manager.plan_table().splitlines()
    assert lines[0].split() == ["group", "name", "budget", "MiB", "live", "MiB", "stashed", "why"]
    assert lines[2].split()[:5] == ["0", "moe.experts", f"{plan[0]['budget_bytes'] / 2**20:.1f}",
                                    f"{plan[0]['live_bytes'] / 2**20:.1f}", "no"]


def test_dead_rows_are_stashed(gen):
    """Budget = 3x the live rows over 4 layers: the saving beats one reload, so the first
    three groups are stashed (the last is kept) and the buffers exist."""
    manager = _train(_config(3.0), "auto", gen)
    assert [r["stashed"] for r in manager.plan()] == [True, True, True, False]
    assert manager.buffers
    assert manager.read_status()["buffers"]


@pytest.mark.parametrize("policy, stashed", [("always", True), ("never", False)])
def test_policy_forces_the_choice(gen, policy, stashed):
    manager = _train(_config(1.0 if stashed else 3.0), policy, gen)
    assert [r["stashed"] for r in manager.plan()][:3] == [stashed] * 3
    assert bool(manager.buffers) == stashed
    assert f"policy={policy!r}" in manager.plan()[0]["why"]


def test_bad_policy_names_the_field():
    with pytest.raises(ValueError, match="policy"):
        StashManager(StashConfig(policy="sometimes"), device="cpu")


# ---- the plan from measured levels (NOTE [stash plan]) --------------------------------------
GIB = 2 ** 30


def _timeline(layers: int, saved: float, grads: float, base: float = 10.0) -> list:
    """The levels of an unstashed step of ``layers`` alike groups (GiB): each forward adds its
    ``saved`` bytes, each backward frees them and adds its ``grads``."""
    out, level = [], base
    for g in range(layers):
        level += saved
        out.append(("F", g, level * GIB))
    for g in reversed(range(layers)):
        out.append(("B", g, level * GIB))
        level += grads - saved
    out.append(("E", -1, level * GIB))
    return out


def _events(layers: int) -> list:
    return ([("F", g, "moe") for g in range(layers)]
            + [("B", g, "moe") for g in reversed(range(layers))])


class _Measured:
    def __init__(self, gid: int, budget: float, live: float):
        self.gid, self.name = gid, "moe"
        self.plan_bytes = {"k": (int(budget * GIB), int(live * GIB))}
        self.rows_peak = int(live * 1000)        # live rows, as a stash's warmup counts them


def _plan(layers, budget, live, grads, policy="auto", pool="shared", prefetch="at_last_unpack"):
    from graphstash.stash.plan import StashPlan

    plan = StashPlan(policy)
    groups = [_Measured(g, budget, live) for g in range(layers)]
    plan.make(_events(layers), groups,
              StashConfig(policy=policy, pool=pool, prefetch=prefetch),
              timeline=_timeline(layers, budget, grads))
    return plan


def test_predicted_peak_replays_the_levels():
    """Nothing stashed: the measured peak. One group stashed: its budget bytes leave from the
    event after its forward until its backward, the pool stays throughout, one reload's
    working set at every backward start."""
    from graphstash.stash.plan import predicted_peak

    tl = _timeline(3, saved=1.0, grads=0.25)          # peak 13 GiB at the first backward
    budget, live = {g: GIB for g in range(3)}, {g: GIB // 4 for g in range(3)}
    assert predicted_peak(tl, set(), budget, live, 1.0) == 13 * GIB
    # group 0 away from F1 to B0: at B2 13 - 1 + 0.25 (pool) + 1 (reload) = 13.25
    assert predicted_peak(tl, {0}, budget, live, 1.0) == 13.25 * GIB
    # the first group's backward start: 11.5 + the pool (2 x 0.5) + a reload (1.0)
    assert predicted_peak(tl, {0, 1}, budget, live, 2.0) == pytest.approx(13.5 * GIB)


def test_per_group_pages_leave_before_the_gradients_arrive():
    """NOTE [pages per group]: a group's pages exist from its forward end until its backward
    start, so they are not beside the gradients at the end of backward as a shared pool is."""
    from graphstash.stash.plan import predicted_peak

    tl = _timeline(3, saved=1.0, grads=2.0)           # levels F 11 12 13, B 13 14 15, E 16
    budget, live = {g: GIB for g in range(3)}, {g: GIB // 4 for g in range(3)}
    # shared: the pool (2 x 2 x 0.25) beside every gradient at the end: 16 + 1 = 17
    assert predicted_peak(tl, {0, 1}, budget, live, 2.0) == pytest.approx(17 * GIB)
    # per group: at B0 15 + group 0's pages (0.5) + a reload (1); at the end 16
    assert predicted_peak(tl, {0, 1}, budget, live, 2.0, per_group=True) == \
        pytest.approx(16.5 * GIB)


def test_on_demand_reloads_take_no_working_set_beside_the_group_before():
    """``prefetch="on_demand"``: a group's reload replaces the group, nothing is brought in
    beside the backward before it, so the prediction drops the reload term (the same levels
    as above: at B0 15 + group 0's pages, 0.5; at the end 16)."""
    from graphstash.stash.plan import predicted_peak

    tl = _timeline(3, saved=1.0, grads=2.0)
    budget, live = {g: GIB for g in range(3)}, {g: GIB // 4 for g in range(3)}
    ahead = predicted_peak(tl, {0, 1}, budget, live, 2.0, per_group=True)
    on_demand = predicted_peak(tl, {0, 1}, budget, live, 2.0, per_group=True, prefetch=False)
    assert ahead == pytest.approx(16.5 * GIB) and on_demand == pytest.approx(16 * GIB)


def test_the_plan_reads_the_prefetch_point():
    """The same measured step: a plan for ``prefetch="on_demand"`` never predicts a higher
    peak than one that prefetches, and stashes at least as many groups."""
    shape = dict(layers=8, budget=0.9, live=0.45, grads=0.58, pool="per_group")
    ahead, lazy = _plan(**shape), _plan(**shape, prefetch="on_demand")
    assert lazy.predicted[1] < ahead.predicted[1]
    assert sum(r["stashed"] for r in lazy.rows) >= sum(r["stashed"] for r in ahead.rows)


def test_on_demand_plans_take_the_most_groups_among_equal_peaks():
    """NOTE [on-demand plan]: where the end of backward sets the predicted peak, stashing 3 or
    7 groups predicts the same; a plan for ``prefetch="on_demand"`` takes 7 (the start of
    backward it lowers is what the levels miss), one that prefetches the fewest; and none
    where no stashing lowers the peak at all."""
    shape = dict(layers=8, budget=0.9, live=0.45, grads=0.7, pool="per_group")
    ahead, lazy = _plan(**shape, prefetch="after_release"), _plan(**shape, prefetch="on_demand")
    assert sum(r["stashed"] for r in lazy.rows) == 7, lazy.rows
    assert sum(r["stashed"] for r in ahead.rows) < 7, ahead.rows
    heavy = _plan(8, budget=0.56, live=0.45, grads=1.0, pool="per_group", prefetch="on_demand")
    assert not any(r["stashed"] for r in heavy.rows)


def test_rows_kept_are_what_the_pages_hold_for_stashed_groups_and_the_last():
    """NOTE [rows the stash keeps]: a stashed group, and the last group while others are
    stashed, compute on ``factor`` x their measured live rows in whole pages; groups the plan
    keeps by choice, and every group of a plan that stashes none, on their whole budget."""
    lazy = _plan(8, budget=0.9, live=0.45, grads=0.7, pool="per_group", prefetch="on_demand")
    assert [r["stashed"] for r in lazy.rows] == [True] * 7 + [False]
    assert all(lazy.rows_kept(g, 1.1, 64) == 64 * -(-495 // 64) for g in range(8))   # 1.1 x 450
    assert lazy.rows_kept(8, 1.1, 64) is None             # a group the measured step lacked
    ahead = _plan(8, budget=0.9, live=0.45, grads=0.7, pool="per_group", prefetch="after_release")
    kept_by_choice = [r["group"] for r in ahead.rows[:-1] if not r["stashed"]]
    assert kept_by_choice and all(ahead.rows_kept(g, 1.1, 64) is None for g in kept_by_choice)
    assert ahead.rows_kept(7, 1.1, 64) == 512
    none = _plan(8, budget=0.56, live=0.45, grads=1.0)
    assert none.keep_all and all(none.rows_kept(g, 1.1, 64) is None for g in range(8))


def test_gradients_that_outgrow_the_saved_rows_keep_every_group():
    """As measured at expert parallelism: each layer's gradients (1.0) outweigh its budget
    rows (0.56, live 0.45): the pool would sit beside every gradient at the end of backward,
    so the plan stashes nothing, and says why."""
    plan = _plan(8, budget=0.56, live=0.45, grads=1.0)
    assert not any(r["stashed"] for r in plan.rows) and plan.keep_all
    assert "would not lower the measured step's peak" in plan.rows[0]["why"]
    assert "last group" in plan.rows[-1]["why"]
    before, after = plan.predicted
    assert after == before


def test_dead_rows_with_growing_gradients_stash_the_first_groups():
    """Budget rows twice the live ones and gradients half the budget rows: stashing every
    group would put the pool beside the gradients at the end of backward, stashing none keeps
    the start of backward at its top; the plan takes the first k in between, and its
    predicted peak is below both ends."""
    from graphstash.stash.plan import predicted_peak

    layers, budget, live, grads = 8, 1.0, 0.5, 0.6
    plan = _plan(layers, budget, live, grads)
    stashed = [r["stashed"] for r in plan.rows]
    k = sum(stashed)
    assert 0 < k < layers - 1 and stashed == [True] * k + [False] * (layers - k)
    assert "first" in plan.rows[0]["why"] and "kept" in plan.rows[k]["why"]
    tl = _timeline(layers, budget, grads)
    b = {g: int(budget * GIB) for g in range(layers)}
    v = {g: int(live * GIB) for g in range(layers)}
    every = predicted_peak(tl, range(layers - 1), b, v, StashConfig().device_factor)
    before, after = plan.predicted
    assert after < before and after < every


def test_no_gradients_to_speak_of_stash_every_group():
    """Small gradients: the start of backward sets the peak, every group but the last is
    stashed (what the plan did by the start of backward alone)."""
    plan = _plan(4, budget=1.0, live=0.3, grads=0.01)
    assert [r["stashed"] for r in plan.rows] == [True, True, True, False]


@pytest.mark.parametrize("policy, stashed", [("always", True), ("never", False)])
def test_policy_overrides_the_levels(policy, stashed):
    plan = _plan(4, budget=0.56, live=0.45, grads=1.0, policy=policy)
    assert [r["stashed"] for r in plan.rows][:3] == [stashed] * 3


def test_a_new_plan_is_measured_after_replan(gen):
    """replan(): the buffers go, the next step keeps every tensor and measures again, and the
    plan and the buffers come back from it; the gradients stay equal to the budget model's
    through all of it (the stashed, measuring and re-stashed steps)."""
    config = _config(3.0)
    manager, model, ref = _pair(config)
    seen = []
    for i in range(5):
        if i == 2:
            manager.replan()
            assert manager.plan() == [] and manager.buffers == {}
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        _step_both(manager, model, ref, config, gen)
        seen.append((bool(manager.buffers), [r["stashed"] for r in manager.plan()]))
    stashed = [True, True, True, False]
    assert seen == [(False, stashed), (True, stashed), (False, stashed), (True, stashed),
                    (True, stashed)], seen



def test_a_group_the_measured_step_lacked():
    """Without levels the plan is all or nothing, and a group the measured step did not have
    follows it; a plan by levels stashes a prefix, and a later group is kept."""
    from graphstash.stash.plan import StashPlan

    groups = [_Measured(g, 1.0, 0.3) for g in range(4)]
    by_start = StashPlan("auto")
    by_start.make(_events(4), groups, StashConfig())              # no levels (the CPU)
    assert [by_start.stashes(g) for g in range(6)] == [True] * 3 + [False, True, True]
    by_levels = _plan(8, budget=1.0, live=0.5, grads=0.6)          # the first 3 stashed
    assert by_levels.stashes(0) and not by_levels.stashes(8) and not by_levels.stashes(9)
    assert _plan(4, 1.0, 0.3, 0.01, policy="always").stashes(7)


def test_the_levels_are_read_at_every_group_and_at_the_end_of_backward(gen):
    """The scheduler reads its meter at each group's forward end and backward start and, from
    a callback autograd runs when the backward pass ends, once more: the plan is then made by
    levels (on the CPU there is no meter unless one is given; here a flat one), and the
    meter is not read again once the plan is made."""
    config = _config(3.0)
    manager, model, ref = _pair(config)
    kinds = []

    def meter():
        kinds.append(len(kinds))
        return 0

    manager.scheduler.memory_meter = meter
    _step_both(manager, model, ref, config, gen)
    plan = manager.scheduler.plan
    assert len(kinds) == 2 * config.layers + 1, kinds      # F x 4, B x 4, E
    assert plan.predicted is not None                       # made by levels
    assert "measured step's peak" in plan.rows[0]["why"]
    assert plan.predicted[1] <= plan.predicted[0]
    _step_both(manager, model, ref, config, gen)           # stashes by that plan, exactly
    assert len(kinds) == 2 * config.layers + 1             # read while measuring only
