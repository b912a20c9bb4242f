"""NOTE [stash plan]: the manager stashes only where its warmup measurement says that lowers
the peak, shows the decision, and can be forced either way."""
from __future__ import annotations

import pytest
import torch

from graphstash.models import MoEConfig, MoEModel
from graphstash.stash import StashConfig, StashManager

from _grad_checks import assert_far_from_zero, named_grads, projected_loss, projection
from _moe_data import tokens


def _train(config: MoEConfig, policy: str, gen, steps: int = 2):
    manager = StashManager(StashConfig(min_tensor_bytes=0, policy=policy), device="cpu")
    model = MoEModel(config, mode="stash", stash_manager=manager, seed=5)
    ref = MoEModel(config, mode="budget", seed=5)
    for _ in range(steps):
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
