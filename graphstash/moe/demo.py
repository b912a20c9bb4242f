"""A short MoE training run of :class:`MoEModel` in each mode (for ``graphstash demo``).

On a GPU it runs eager dropless, static budget and, when :mod:`graphstash.stash` is
available, static budget + stash; on the CPU eager dropless and static budget (reference
backend). It prints the loss per mode and whether a budget dropped rows.
"""
from __future__ import annotations

import time

import torch

from .. import _layout as L
from .model import MoEConfig, MoEModel


def run(device: str = "auto", steps: int = 5, seed: int = 0) -> dict:
    """Train ``steps`` steps per mode from the same initialisation; returns the losses."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    on_gpu = dev.type == "cuda"
    config = MoEConfig(hidden=256 if on_gpu else 64, ffn=512 if on_gpu else 128,
                       num_experts=8, topk=2, layers=4 if on_gpu else 2,
                       num_tokens=2048 if on_gpu else 256, capacity_factor=1.5,
                       pad_multiple=8)
    modes = ["dropless", "budget"]
    if on_gpu:
        try:
            from .. import stash  # noqa: F401
            modes.append("stash")
        except ImportError:
            pass
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(config.num_tokens, config.hidden, generator=gen).to(dev)
               for _ in range(steps)]
    results = {}
    for mode in modes:
        status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=dev)
        model = MoEModel(config, mode=mode, status=status, seed=seed).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        t0 = time.perf_counter()
        for x in batches:
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        elapsed = (time.perf_counter() - t0) / steps
        results[mode] = {"losses": losses, "step_ms": elapsed * 1e3,
                         "over_budget": int(status[L.SS_OVER_BUDGET])}
        print(f"moe {mode:<9} loss {losses[0]:.4f} -> {losses[-1]:.4f}  "
              f"{elapsed * 1e3:7.1f} ms/step  over_budget={results[mode]['over_budget']}")
    return results
