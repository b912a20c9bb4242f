"""The MoE kernels that move and transform permuted rows, at real widths, against what bounds them.

Per preset (Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B widths; 8192 tokens, bf16, the routing of
random top-k scores sorted by expert, as a dispatch lays it out), on one CUDA GPU:

- the row copy from tokens to their K rows (dispatch, regathered input, combine's backward):
  graphstash's gather (``gather_rows`` without the inverse map), its spread (with the map,
  NOTE [spread rows] in ``raw_kernels/moe_dispatch.cu``), ``torch.index_select`` of the same
  rows, and ``torch.zero_`` of the same bytes (what writing them alone costs);
- the gated expert activation: forward (``act_forward``) and backward with the recomputed
  activation written back (``act_backward(write_act=True)``), with the bytes they move.

Times are CUDA-event averages over ``--reps`` launches after a warmup. Prints a table.

    python benchmarks/probes/spread_rows.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from graphstash.moe.backend import OPERATORS  # noqa: E402

PRESETS = [  # name, tokens, experts, top-k, hidden, expert ffn
    ("qwen3-30b-a3b", 8192, 128, 8, 2048, 768),
    ("olmoe-1b-7b", 8192, 64, 8, 2048, 1024),
    ("mixtral-8x7b", 8192, 8, 2, 4096, 14336),
]


def chosen_presets(parser, presets: str, repeats: int) -> list[tuple]:
    """The :data:`PRESETS` entries named in the comma-separated ``presets`` (a probe's
    ``--presets``), after checking them and its ``--repeats``; a bad value is a usage error."""
    known = {p[0]: p for p in PRESETS}
    names = [n for n in presets.split(",") if n]
    for n in names:
        if n not in known:
            parser.error(f"--presets: unknown preset {n!r}; expected one of {sorted(known)}")
    if repeats < 1:
        parser.error(f"--repeats: expected a positive int, got {repeats}")
    return [known[n] for n in names]


def time_us(fn, reps: int) -> float:
    """Average microseconds of ``fn`` over ``reps`` calls (CUDA events, after 5 warmup calls)."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def routing_maps(tokens: int, experts: int, topk: int, gen: torch.Generator):
    """``(index, inverse)``: int32 ``[tokens * topk]`` token of each expert-sorted row and int32
    ``[tokens, topk]`` row of each (token, slot), from random top-k scores."""
    dev = gen.device
    ids = torch.rand(tokens, experts, generator=gen, device=dev).topk(topk, dim=1).indices
    order = torch.sort(ids.flatten(), stable=True).indices         # pair feeding each row
    index = (order // topk).to(torch.int32)
    inverse = torch.empty(tokens * topk, dtype=torch.int32, device=dev)
    inverse[order] = torch.arange(tokens * topk, dtype=torch.int32, device=dev)
    return index, inverse.view(tokens, topk)


def measure(name, tokens, experts, topk, hidden, ffn, gen, reps):
    """Print one preset's row of the table."""
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    index, inverse = routing_maps(tokens, experts, topk, gen)
    rows = index.numel()
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    out = torch.empty(rows, hidden, device=dev, dtype=bf16)
    t_gather = time_us(lambda: OPERATORS.gather_rows(out, x, index), reps)
    want = out.clone()
    t_spread = time_us(lambda: OPERATORS.gather_rows(out, x, index, inverse=inverse),
                       reps)
    if not torch.equal(out, want):
        sys.exit(f"{name}: the spread differs from the gather")
    long_index = index.long()
    t_select = time_us(lambda: torch.index_select(x, 0, long_index, out=out), reps)
    t_zero = time_us(out.zero_, reps)
    live = torch.tensor([rows], dtype=torch.int64, device=dev)
    pre = torch.randn(rows, 2 * ffn, device=dev, dtype=bf16)
    weight = torch.rand(rows, device=dev, dtype=bf16)
    act = torch.empty(rows, ffn, device=dev, dtype=bf16)
    t_fwd = time_us(lambda: OPERATORS.act_forward(act, pre, weight, live, gated=True),
                    reps)
    grad_out = torch.randn(rows, ffn, device=dev, dtype=bf16)
    grad_pre = torch.empty_like(pre)
    grad_row = torch.empty(rows, device=dev, dtype=torch.float32)
    t_bwd = time_us(lambda: OPERATORS.act_backward(grad_pre, grad_row, grad_out, pre, weight,
                                                   live, gated=True, write_act=True),
                    reps)
    fwd_bytes = rows * 3 * ffn * 2              # read [rows, 2 ffn], write [rows, ffn]
    bwd_bytes = rows * 6 * ffn * 2              # read pre and grad_out, write both back
    print(f"| {name} | {rows} x {hidden * 2} | {t_gather:.1f} | {t_spread:.1f} | "
          f"{t_select:.1f} | {t_zero:.1f} | {t_fwd:.1f} ({fwd_bytes / t_fwd / 1e6:.2f}) | "
          f"{t_bwd:.1f} ({bwd_bytes / t_bwd / 1e6:.2f}) |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50, help="timed launches per figure")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: expected a positive int, got {args.reps}")
    if not torch.cuda.is_available():
        sys.exit("spread_rows.py: needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, bf16, 8192 tokens, {args.reps} launches per figure")
    print("| widths | rows x row bytes | gather us | spread us | index_select us | zero_ us "
          "| act fwd us (TB/s) | act bwd + act us (TB/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tokens, experts, topk, hidden, ffn in PRESETS:
        measure(name, tokens, experts, topk, hidden, ffn, gen, args.reps)
        torch.cuda.empty_cache()        # the preset's buffers are freed on return


if __name__ == "__main__":
    main()
