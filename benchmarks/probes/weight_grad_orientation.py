"""The experts' weight gradient as torch's CUTLASS grouped GEMM runs it, in both orientations.

For a weight ``w [E, out, in]`` used as ``y[rows of e] = x[rows of e] @ w[e].T``, the gradient
``grad_w[e] = g[rows of e].T @ x[rows of e]`` can be asked of ``torch._grouped_mm`` two ways:

- ``g.T @ x``, which writes ``[E, out, in]``, the weight's own layout (what graphstash runs,
  NOTE [weight gradient layout] in ``graphstash/moe/experts.py``);
- ``x.T @ g``, which writes ``[E, in, out]`` (what autograd's formula for ``_grouped_mm`` runs
  for the peers), then the copy into the weight's layout that AccumulateGrad makes of it.

Per preset width (8192 tokens, bf16, rows per expert from random top-k scores) and per expert
GEMM, prints the milliseconds of each (CUDA events, medians of interleaved samples) and the
forward and input-gradient products beside them, as one Markdown table.

    python benchmarks/probes/weight_grad_orientation.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from graphstash.tools.bench.timing import time_calls_interleaved  # noqa: E402
from spread_rows import chosen_presets  # noqa: E402


def measure(name, tokens, experts, topk, hidden, ffn, gen, repeats) -> None:
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    ids = torch.rand(tokens, experts, generator=gen, device=dev).topk(topk, dim=1).indices
    offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=experts), 0).to(torch.int32)
    rows = tokens * topk
    for gemm, n_in, n_out in (("w1", hidden, 2 * ffn), ("w2", ffn, hidden)):
        x = torch.randn(rows, n_in, device=dev, dtype=bf16)
        w = torch.randn(experts, n_out, n_in, device=dev, dtype=bf16)
        g = torch.randn(rows, n_out, device=dev, dtype=bf16)
        out = torch.empty_like(w)
        calls = {
            "forward": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "grad x": lambda: torch._grouped_mm(g, w, offs=offs),
            "g.T @ x": lambda: torch._grouped_mm(g.transpose(0, 1), x, offs=offs),
            "x.T @ g": lambda: torch._grouped_mm(x.transpose(0, 1), g, offs=offs),
            "x.T @ g, copied": lambda: out.copy_(
                torch._grouped_mm(x.transpose(0, 1), g, offs=offs).transpose(-2, -1)),
        }
        want = calls["g.T @ x"]()
        other = calls["x.T @ g"]().transpose(-2, -1)
        diff = float((want.float() - other.float()).abs().max() / want.float().abs().max())
        ms = time_calls_interleaved(calls, repeats=repeats, inner=5)
        print(f"| {name} | {gemm} | {rows}x{n_in} -> {experts}x{n_out}x{n_in} | "
              + " | ".join(f"{ms[k]:.3f}" for k in calls) + f" | {diff:.1e} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,olmoe-1b-7b,mixtral-8x7b")
    parser.add_argument("--repeats", type=int, default=20, help="timed samples per figure")
    args = parser.parse_args(argv)
    presets = chosen_presets(parser, args.presets, args.repeats)
    if not torch.cuda.is_available():
        sys.exit("weight_grad_orientation.py: needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, 8192 tokens")
    print("| widths | GEMM | shape | forward ms | grad x ms | g.T @ x ms | x.T @ g ms "
          "| x.T @ g + copy ms | max rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in presets:
        measure(*p, gen, args.repeats)


if __name__ == "__main__":
    main()
