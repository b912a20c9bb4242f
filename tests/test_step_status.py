"""The running graph_step's status reaches MoE dispatch without ``status=`` (NOTE [current
step]): an over-budget dispatch inside the step makes it rerun dropless and update once."""
from __future__ import annotations

import warnings

import pytest
import torch

import graphstash
from graphstash import _layout as L
from graphstash._mode import current_step_status, step_status
from graphstash.models import MoEConfig, MoEModel
from graphstash.moe import default_status, dispatch

from _grad_checks import projected_loss, projection
from _moe_data import routing, tokens


def _models(capacity_factor: float, seed: int):
    config = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=2, num_tokens=40,
                       capacity_factor=capacity_factor, gated=True)
    budget = MoEModel(config, mode="budget", seed=seed)          # no status= passed
    control = MoEModel(config, mode="dropless", seed=seed)
    control.load_state_dict(budget.state_dict())
    return config, budget, control


def _projection(config, gen, device="cpu"):
    """The loss's fixed random projection of the output: it reaches every parameter (the mean
    square of the final RMSNorm's output would be constant)."""
    return projection((config.num_tokens, config.hidden), gen, device) / config.num_tokens


def _train(model, x, proj, steps_of=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x):
        loss = projected_loss(model(x), proj)
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)    # "runs eagerly without a CUDA graph"
        train_step = graphstash.graph_step(step, optimizer=opt, warmup=1)
        losses = [train_step(xi) for xi in x]
    return train_step, losses


def _eager_control(model, x, proj):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for xi in x:
        opt.zero_grad(set_to_none=True)
        loss = projected_loss(model(xi), proj)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("capacity_factor,flagged", [(0.4, True), (2.0, False)])
def test_moe_model_over_budget_reaches_step_without_wiring(gen, capacity_factor, flagged):
    """capacity 0.4 x T*K rows: every step drops rows, is flagged through the step's status,
    reruns dropless and updates once, exactly as eager dropless training; capacity 2: never
    flagged, and the budget forward is the dropless one."""
    config, model, control = _models(capacity_factor, seed=int(torch.randint(100, (1,),
                                                                               generator=gen)))
    x = [tokens(config.num_tokens, config.hidden, gen, offset=40 * i) / config.num_tokens
         for i in range(3)]
    proj = _projection(config, gen)
    module_status = default_status("cpu")
    module_status.zero_()
    train_step, losses = _train(model, x, proj)
    want = _eager_control(control, x, proj)
    stats = train_step.stats
    assert stats.steps == 3
    assert stats.over_budget == (3 if flagged else 0)
    assert stats.eager_reruns == (3 if flagged else 0)
    assert int(module_status[L.SS_OVER_BUDGET]) == 0     # the flag went to the step's status
    for got, ref in zip(losses, want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    for (name, a), b in zip(model.named_parameters(), control.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_default_status_is_the_running_steps(gen):
    x = tokens(12, 8, gen)
    idx, w = routing(12, 2, 4, gen)
    mine = torch.zeros(L.STATUS_SIZE, dtype=torch.int32)
    assert current_step_status() is None
    with step_status(mine):
        assert default_status("cpu") is mine
        assert current_step_status(torch.device("cpu")) is mine
        assert current_step_status(torch.device("meta")) is None   # another device: not it
        dispatch(x, idx, w, 4, budget=5)                 # 24 rows asked, 5 kept
    assert default_status("cpu") is not mine
    assert int(mine[L.SS_OVER_BUDGET]) == 1 and int(mine[L.SS_TOKENS_PEAK]) == 24


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor,flagged", [(0.4, True), (2.0, False)])
def test_moe_model_captured_over_budget_reruns_without_wiring(gen, capacity_factor, flagged):
    """The same on a GPU with the step captured: every replay of the 0.4 budget is flagged
    through the step's status, skipped on the device and rerun dropless; losses and weights
    follow eager dropless training (fp32)."""
    config, model, control = _models(capacity_factor, seed=int(torch.randint(100, (1,),
                                                                               generator=gen)))
    model, control = model.cuda(), control.cuda()
    x = [(tokens(config.num_tokens, config.hidden, gen, offset=40 * i) / config.num_tokens).cuda()
         for i in range(5)]
    proj = _projection(config, gen, "cuda")
    train_step, losses = _train(model, x, proj)
    want = _eager_control(control, x, proj)
    stats = train_step.stats
    assert stats.captures == 1 and stats.replays == 4, stats
    assert stats.over_budget == (5 if flagged else 0), stats
    assert stats.eager_reruns == (5 if flagged else 0), stats
    for got, ref in zip(losses, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(model.named_parameters(), control.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
