"""Step time and peak memory of the MoE benchmark's graph + stash mode under stash variants.

Runs ``graphstash.bench.moe``'s memory-bound configuration (one GPU) in mode "graph + budget"
once, then "graph + budget + stash" with each ``StashConfig.copy_blocks`` and ``zero_tail``
given, all in one process, and prints one line per run.

Usage: ``python tools/moe_stash_variants.py --copy-blocks 0 32 --zero-tail 1 0``
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch

import graphstash.stash as stash_pkg
from graphstash.bench import moe as bench


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-blocks", type=int, nargs="+", default=[0])
    parser.add_argument("--zero-tail", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="memory-bound", choices=sorted(bench.CONFIGS))
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    config = dataclasses.replace(bench.CONFIGS[args.config])
    gen = torch.Generator().manual_seed(1234)
    batches = [torch.randn(config.num_tokens, config.hidden, generator=gen)
               .to(device=device, dtype=torch.bfloat16) for _ in range(4)]
    base = bench._run_mode("graph + budget", config, None, device, batches, args.steps)
    print(f"{args.config} on {torch.cuda.get_device_name(device)}")
    print(f"graph + budget: {base['step_ms']:.2f} ms, {base['peak_mib']:.0f} MiB")
    original_manager, original_context = bench._stash_manager, stash_pkg.stash_activations
    try:
        for blocks, zero_tail in itertools.product(args.copy_blocks, args.zero_tail):
            def manager(mode, dev, status, blocks=blocks):
                return stash_pkg.StashManager(
                    stash_pkg.StashConfig(host_tier=False, copy_blocks=blocks),
                    device=dev, status=status)
            bench._stash_manager = manager
            stash_pkg.stash_activations = functools.partial(original_context,
                                                            zero_tail=bool(zero_tail))
            r = bench._run_mode("graph + budget + stash", config, None, device, batches,
                                args.steps)
            print(f"stash copy_blocks={blocks:<4} zero_tail={zero_tail}: {r['step_ms']:.2f} ms "
                  f"({r['step_ms'] / base['step_ms']:.3f}x), {r['peak_mib']:.0f} MiB "
                  f"({r['peak_mib'] / base['peak_mib']:.3f}x), overflow={r['overflow']}")
    finally:
        bench._stash_manager, stash_pkg.stash_activations = original_manager, original_context


if __name__ == "__main__":
    main()
