"""Learning-rate schedules under graph_step without recapture (NOTE [scheduled hyperparameters]),
on the CPU: the bookkeeping a GPU run relies on. Which groups get a device lr tensor, the value
each holds at each call, that the user's param groups keep their floats and the schedulers
their trajectory, that nothing is invalidated for a scheduled lr, and that a baked value that
changes (beta1 cycled by OneCycleLR, the lr of a non-fused SGD) drops the graphs with one
warning. Losses equal an eager loop with the same scheduler bit for bit (the CPU runs the floats;
the GPU test in test_graph_gpu.py checks the replayed values). Data: seeded per test.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as sched

from graphstash.graph import GraphStep

STEPS, WARMUP = 30, 2


def _schedule(name: str, opt):
    if name == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=STEPS)
    if name == "warmup_then_decay":
        return sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.1, total_iters=5),
                                        sched.CosineAnnealingLR(opt, T_max=STEPS - 5)],
                                  milestones=[5])
    if name == "one_cycle":
        return sched.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS, cycle_momentum=False)
    if name == "one_cycle_momentum":
        return sched.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)     # cycles beta1
    if name == "lambda":
        return sched.LambdaLR(opt, lambda s: 0.9 ** s)
    raise AssertionError(name)


def _make_opt(kind: str, params):
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True, capturable=True)
    if kind == "sgd_fused":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise AssertionError(kind)


def _data(gen, steps=STEPS):
    return [(torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen))
            for _ in range(steps)]


def _train(gen, schedule: str, opt_kind: str, steps=STEPS):
    """Train under graph_step and eagerly with the same scheduler; return what was observed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    opt, ref_opt = _make_opt(opt_kind, model.parameters()), _make_opt(opt_kind, ref.parameters())
    scheduler, ref_scheduler = _schedule(schedule, opt), _schedule(schedule, ref_opt)
    proj = torch.randn(8, generator=gen)

    def loss_of(m, x, y):
        return ((m(x) - y) * proj).pow(2).mean()

    def step(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    train_step = GraphStep(step, optimizer=opt, device="cpu", warmup=WARMUP)
    seen = {"losses": [], "ref": [], "tensor_lr": [], "float_lr": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_data(gen, steps)):
            seen["losses"].append(train_step(x, y))
            seen["float_lr"].append(opt.param_groups[0]["lr"])
            seen["tensor_lr"].append({g: float(t) for g, t in train_step.scheduled_lr.items()})
            scheduler.step()
            ref_opt.zero_grad()
            loss = loss_of(ref, x, y)
            loss.backward()
            ref_opt.step()
            ref_scheduler.step()
            seen["ref"].append(loss.detach())
            assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"], f"step {i}"
    seen["warnings"] = [str(c.message) for c in caught
                        if "graph_step" in str(c.message) and "eagerly" not in str(c.message)]
    seen["stats"] = train_step.stats
    seen["opt"] = opt
    return seen


@pytest.mark.parametrize("opt_kind", ["adamw_fused", "sgd_fused"])
@pytest.mark.parametrize("schedule", ["cosine", "warmup_then_decay", "one_cycle", "lambda"])
def test_scheduled_lr_is_a_device_tensor_and_costs_no_capture(gen, schedule, opt_kind):
    seen = _train(gen, schedule, opt_kind)
    for i, (a, b) in enumerate(zip(seen["losses"], seen["ref"])):
        assert torch.equal(a, b), f"step {i}: {a} != {b}"
    st = seen["stats"]
    assert st.invalidations == 0 and st.steps == STEPS
    assert not seen["warnings"], seen["warnings"]
    assert all(isinstance(v, float) for v in seen["float_lr"])       # the user's groups keep floats
    assert all(isinstance(g["lr"], float) for g in seen["opt"].param_groups)
    lrs = sorted(set(seen["float_lr"]))
    assert len(lrs) > STEPS // 2                                       # the schedule moved
    for i in range(WARMUP, STEPS):                                     # from the would-capture call
        held = seen["tensor_lr"][i]
        assert set(held) == {0}
        assert held[0] == float(np.float32(seen["float_lr"][i])), f"step {i}"


def test_cycled_beta1_is_baked_and_said_once(gen):
    """OneCycleLR cycles Adam's beta1 by default: beta1 cannot be a device tensor, so every
    change drops the graphs (counted), with one warning saying how to keep one graph."""
    seen = _train(gen, "one_cycle_momentum", "adamw_fused")
    for a, b in zip(seen["losses"], seen["ref"]):
        assert torch.equal(a, b)
    assert seen["stats"].invalidations == STEPS - WARMUP - 1
    assert len(seen["warnings"]) == 1
    msg = seen["warnings"][0]
    assert "param group 0's betas changed" in msg and "cycle_momentum=False" in msg


def test_lr_of_a_non_fused_sgd_is_baked_and_said_once(gen):
    seen = _train(gen, "cosine", "sgd")
    for a, b in zip(seen["losses"], seen["ref"]):
        assert torch.equal(a, b)
    assert seen["stats"].invalidations == STEPS - WARMUP - 1
    assert seen["tensor_lr"][-1] == {}
    assert len(seen["warnings"]) == 1 and "SGD reads lr as a number" in seen["warnings"][0] \
        and "fused=True" in seen["warnings"][0]


def _manual(gen, change_at: int, steps: int = 10):
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
    train_step = GraphStep(lambda x: model(x).pow(2).mean().backward(), optimizer=opt,
                           device="cpu", warmup=WARMUP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            if i >= change_at:
                opt.param_groups[0]["lr"] = 1e-2 * 0.9 ** (i - change_at + 1)
            train_step(torch.randn(4, 8, generator=gen))
    msgs = [str(c.message) for c in caught if "lr changed" in str(c.message)]
    return train_step, msgs


def test_lr_changed_by_hand_after_the_capture_recaptures_once(gen):
    """Without a torch scheduler, the first change of the lr after the capture adopts it as a
    device tensor: one invalidation, said once; later changes cost none."""
    train_step, msgs = _manual(gen, change_at=5)
    assert train_step.stats.invalidations == 1
    assert len(msgs) == 1 and "from now on the lr reaches the graph as a float32 device" in msgs[0]
    assert set(train_step.scheduled_lr) == {0}


def test_lr_changed_during_the_warmup_costs_nothing(gen):
    train_step, msgs = _manual(gen, change_at=1)
    assert train_step.stats.invalidations == 0 and not msgs
    assert set(train_step.scheduled_lr) == {0}


def test_constant_lr_stays_baked(gen):
    """No scheduler and no change: the lr stays a baked number (bit for bit eager arithmetic)."""
    train_step, msgs = _manual(gen, change_at=99)
    assert train_step.stats.invalidations == 0 and train_step.scheduled_lr == {}
