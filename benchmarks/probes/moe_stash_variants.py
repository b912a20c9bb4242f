"""Step time and peak memory of the MoE benchmark's graph + stash mode under stash variants.

Runs a configuration of ``graphstash.tools.bench.moe`` (one GPU) in modes "eager dropless" and
"graph + budget" once, then "graph + budget + stash" with each combination of
``StashConfig.copy_blocks``, ``StashConfig.device_factor`` and ``StashConfig.prefetch`` given,
all in one process, and prints one line per run with its ratios to the two baselines. Sizes
of the configuration can be overridden.

Usage: ``python benchmarks/probes/moe_stash_variants.py --copy-blocks 0 66 --device-factor 1.1
1.05 --prefetch at_last_unpack after_release --tokens 32768 --layers 24``
(``--copy-blocks -1``: the bench's own choice, half the multiprocessors.)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from graphstash.tools import training
from graphstash.tools.bench import moe as bench
from graphstash.stash.config import PREFETCH_POINTS


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-blocks", type=int, nargs="+", default=[-1])
    parser.add_argument("--device-factor", type=float, nargs="+", default=[1.05])
    parser.add_argument("--prefetch", nargs="+", default=["at_last_unpack"],
                        choices=PREFETCH_POINTS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="memory-bound", choices=sorted(bench.CONFIGS))
    for size in ("tokens", "layers", "hidden", "ffn", "experts"):
        parser.add_argument(f"--{size}", type=int, default=None)
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = {field: getattr(args, size) for size, field in
             (("tokens", "num_tokens"), ("layers", "layers"), ("hidden", "hidden"),
              ("ffn", "ffn"), ("experts", "num_experts")) if getattr(args, size) is not None}
    config = dataclasses.replace(bench.CONFIGS[args.config], **sizes)
    batches = training.batches(config, 4, seed=1234, device=device, dtype=torch.bfloat16)
    print(f"{args.config} on {torch.cuda.get_device_name(device)}: {config}", flush=True)
    eager = None
    if not args.skip_eager:
        eager = bench.run_mode("eager dropless", config, None, device, batches, 5)
        print(f"eager dropless: {eager['step_ms']:.2f} ms, {eager['peak_mib']:.0f} MiB, "
              f"activations {eager['activation_peak_mib']:.0f} MiB", flush=True)
    base = bench.run_mode("graph + budget", config, None, device, batches, args.steps)
    print(f"graph + budget: {base['step_ms']:.2f} ms, {base['peak_mib']:.0f} MiB, "
          f"activations {base['activation_peak_mib']:.0f} MiB", flush=True)
    default = bench.stash_config(device)
    for blocks, factor, prefetch in itertools.product(args.copy_blocks, args.device_factor,
                                                      args.prefetch):
        changes = {"device_factor": factor, "prefetch": prefetch}
        if blocks >= 0:
            changes["copy_blocks"] = blocks
        r = bench.run_mode("graph + budget + stash", config, None, device, batches, args.steps,
                           stash=dataclasses.replace(default, **changes))
        vs_eager = f", {r['peak_mib'] / eager['peak_mib']:.3f}x eager" if eager else ""
        print(f"stash copy_blocks={blocks:<4} device_factor={factor:.2f} prefetch="
              f"{prefetch:<15}: {r['step_ms']:.2f} ms ({r['step_ms'] / base['step_ms']:.3f}x)"
              f", {r['peak_mib']:.0f} MiB ({r['peak_mib'] / base['peak_mib']:.3f}x graph"
              f"{vs_eager}), activations {r['activation_peak_mib']:.0f} MiB, overflow="
              f"{r['overflow']}, reruns={r['reruns']}", flush=True)

if __name__ == "__main__":
    main()
