"""NOTE [stash plan] on a GPU: the plan reads the bytes in use along its warmup step and
stashes only the groups that lower the step's peak, so a stash step is never above the same
step without the stash. Two shapes under ``graph_step``: one where each layer's gradients
outweigh its budget rows (as at expert parallelism: the pool would sit beside every gradient
at the end of backward) and one with few gradients and many dead rows."""
from __future__ import annotations

import pytest
import torch

import graphstash
from graphstash.models import MoEConfig, MoEModel
from graphstash.stash import StashConfig

pytestmark = pytest.mark.gpu
MiB = 2 ** 20


def _peak(config: MoEConfig, mode: str, pool: str = "per_group"):
    """Peak bytes over the capture and three replays of bf16 AdamW training of ``config``
    in ``mode``, above what was allocated before the model; and the stash plan."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = MoEModel(config, mode=mode, device="cuda", dtype=torch.bfloat16, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(config.num_tokens, config.hidden, device="cuda", generator=gen,
                    dtype=torch.bfloat16)
    proj = torch.randn(x.shape, device="cuda", generator=gen)      # a loss that reaches them

    @graphstash.graph_step(optimizer=opt, warmup=2,
                           stash=StashConfig(pool=pool) if mode == "stash" else None)
    def step(x):
        loss = (model(x).float() * proj).sum()
        loss.backward()
        return loss.detach()

    for _ in range(2):
        step(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(4):
        step(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    plan = step.stash_manager.plan() if mode == "stash" else []
    assert step.stats.captures == 1 and step.stats.eager_reruns == 0
    step.release()
    return peak, plan


# heavy gradients: 64 experts of 3 x 768 x 2048 per layer against 1024 x 8 routed rows
HEAVY = MoEConfig(hidden=2048, ffn=768, num_experts=64, topk=8, layers=6, num_tokens=1024,
                  capacity_factor=2.0, gated=True)
# light gradients, dead rows: 8 small experts against 8192 x 2 rows, a budget of 4x those
LIGHT = MoEConfig(hidden=1024, ffn=512, num_experts=8, topk=2, layers=6, num_tokens=8192,
                  capacity_factor=4.0, gated=True)


@pytest.mark.parametrize("pool", ["shared", "per_group"])
def test_heavy_gradients_stash_step_is_not_above_the_plain_step(pool):
    budget, _ = _peak(HEAVY, "budget")
    stash, plan = _peak(HEAVY, "stash", pool)
    stashed = sum(r["stashed"] for r in plan)
    if pool == "shared":                           # not every group: the pool would set the peak
        assert stashed < len(plan) - 1, plan
    assert stash <= budget + 16 * MiB, (stash / MiB, budget / MiB, plan)


def test_dead_rows_are_stashed_and_lower_the_peak():
    budget, _ = _peak(LIGHT, "budget")
    stash, plan = _peak(LIGHT, "stash")
    assert sum(r["stashed"] for r in plan) > 0, plan
    assert stash < 0.9 * budget, (stash / MiB, budget / MiB, plan)
