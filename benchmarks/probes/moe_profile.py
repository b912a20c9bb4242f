"""Kernel-time profile of one MoE training step, graphstash's budget path beside the peer.

Runs :class:`graphstash.models.MoEModel` eagerly (the kernels a captured step replays are the
same) in the modes given, profiles one step after two warmup steps with torch.profiler, and
prints the CUDA time per kernel name (top ``--top``) and the total per mode.

    python benchmarks/probes/moe_profile.py --preset qwen3-30b-a3b --layers 2
"""
from __future__ import annotations

import argparse
import collections
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from graphstash.models import PRESETS, MoEModel, preset


def profile_mode(config, mode: str, top: int) -> float:
    device = torch.device("cuda")
    model = MoEModel(config, mode=mode, seed=0, device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(config.num_tokens, config.hidden, device=device, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    times, launches = collections.Counter(), 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.name[:90]] += evt.device_time
            launches += 1
    total = sum(times.values()) / 1e3
    print(f"\n== {mode}: {total:.2f} ms of kernel time in one step, {launches} kernels "
          f"({launches / config.layers:.0f} per layer)")
    for name, us in times.most_common(top):
        print(f"{us / 1e3:9.3f} ms  {name}")
    return total                    # the model is freed here; the caller empties the cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--modes", default="plain,budget")
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    if args.preset in PRESETS:
        config = preset(args.preset, layers=args.layers, num_tokens=args.tokens)
    else:
        from graphstash.tools.bench.moe import CONFIGS

        config = dataclasses.replace(CONFIGS[args.preset], layers=args.layers,
                                     num_tokens=args.tokens)
    for mode in args.modes.split(","):
        profile_mode(config, mode, args.top)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
