"""Step time and peak memory of the MoE benchmark's graph + stash mode under stash variants.

Runs a configuration of ``graphstash.bench.moe`` (one GPU) in modes "eager dropless" and
"graph + budget" once, then "graph + budget + stash" with each combination of
``StashConfig.copy_blocks`` and ``StashConfig.device_factor`` given, all in one process, and prints one line per run with its ratios to the two baselines. Sizes of the
configuration can be overridden.

Usage: ``python benchmarks/probes/moe_stash_variants.py --copy-blocks 0 66 --device-factor 1.1 1.05
--tokens 32768 --layers 24``
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

import graphstash.stash as stash_pkg
from graphstash.bench import moe as bench


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-blocks", type=int, nargs="+", default=[0])
    parser.add_argument("--device-factor", type=float, nargs="+", default=[1.10])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="memory-bound", choices=sorted(bench.CONFIGS))
    for size in ("tokens", "layers", "hidden", "ffn", "experts"):
        parser.add_argument(f"--{size}", type=int, default=None)
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    config = dataclasses.replace(bench.CONFIGS[args.config])
    for size, field in (("tokens", "num_tokens"), ("layers", "layers"), ("hidden", "hidden"),
                        ("ffn", "ffn"), ("experts", "num_experts")):
        if getattr(args, size) is not None:
            setattr(config, field, getattr(args, size))
    gen = torch.Generator().manual_seed(1234)
    batches = [torch.randn(config.num_tokens, config.hidden, generator=gen)
               .to(device=device, dtype=torch.bfloat16) for _ in range(4)]
    print(f"{args.config} on {torch.cuda.get_device_name(device)}: {config}")
    eager = None
    if not args.skip_eager:
        eager = bench._run_mode("eager dropless", config, None, device, batches, 5)
        print(f"eager dropless: {eager['step_ms']:.2f} ms, {eager['peak_mib']:.0f} MiB")
    base = bench._run_mode("graph + budget", config, None, device, batches, args.steps)
    print(f"graph + budget: {base['step_ms']:.2f} ms, {base['peak_mib']:.0f} MiB")
    original_manager = bench._stash_manager
    try:
        for blocks, factor in itertools.product(args.copy_blocks, args.device_factor):
            def manager(mode, dev, status, blocks=blocks, factor=factor):
                return stash_pkg.StashManager(
                    stash_pkg.StashConfig(host_tier=False, copy_blocks=blocks,
                                          device_factor=factor),
                    device=dev, status=status)
            bench._stash_manager = manager
            r = bench._run_mode("graph + budget + stash", config, None, device, batches,
                                args.steps)
            vs_eager = f", {r['peak_mib'] / eager['peak_mib']:.3f}x eager" if eager else ""
            print(f"stash copy_blocks={blocks:<4} device_factor={factor:.2f}: "
                  f"{r['step_ms']:.2f} ms ({r['step_ms'] / base['step_ms']:.3f}x), "
                  f"{r['peak_mib']:.0f} MiB ({r['peak_mib'] / base['peak_mib']:.3f}x graph"
                  f"{vs_eager}), overflow={r['overflow']}")
    finally:
        bench._stash_manager = original_manager


if __name__ == "__main__":
    main()
