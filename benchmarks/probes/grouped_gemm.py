"""The Triton grouped GEMM against eager ``torch._grouped_mm`` of the same dtype.

For each dtype and each expert GEMM of a preset (the gated first GEMM ``[rows, hidden] x
[E, 2 * ffn, hidden]`` and the second ``[rows, ffn] x [E, hidden, ffn]``, rows = tokens x
top-k, routed with random skew), times the forward and both backward products of
``torch._grouped_mm`` (eager: outside bf16 on sm90/sm100 it reads the offsets back, which is
why it cannot be captured) and of the Triton kernels (NOTE [triton grouped GEMM] in
graphstash/moe/_triton_grouped.py), launched eagerly and replayed from a CUDA graph, and
prints one table: milliseconds, TFLOP/s over the live rows, Triton / native, and the largest
difference between the two relative to the largest native value.

    python benchmarks/probes/grouped_gemm.py
    python benchmarks/probes/grouped_gemm.py --presets qwen3-30b-a3b --dtypes float32 --tf32

Call :func:`time_grouped_gemm` from Python to get the rows instead.
"""
from __future__ import annotations

import argparse

import torch

from graphstash.tools.bench.timing import capture, time_calls, time_replays
from graphstash.models import preset
from graphstash.moe import _triton_grouped as tg


def _counts(rows: int, experts: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert summing to ``rows``: a random share per expert, tilted by ``skew``."""
    share = torch.rand(experts, generator=gen, dtype=torch.float64)
    share = share + skew * torch.linspace(1, 0, experts, dtype=torch.float64)
    counts = (share / share.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    return counts


def _gemms(name: str, tokens: int):
    c = preset(name, num_tokens=tokens)
    rows = tokens * c.topk
    first = 2 * c.ffn if c.gated else c.ffn
    return [(f"{name} w1", rows, c.hidden, first, c.num_experts),
            (f"{name} w2", rows, c.ffn, c.hidden, c.num_experts)]


def _products(x, w, g, counts):
    """``{op: (native, triton)}`` callables for the forward and the two backward products."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return {
        "forward": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                    lambda: tg.forward(x, w, counts)),
        "grad x": (lambda: torch._grouped_mm(g, w, offs=offs),
                   lambda: tg.grads(g, x, w, counts, need_weight=False)[0]),
        "grad w": (lambda: torch._grouped_mm(g.transpose(0, 1), x, offs=offs),
                   lambda: tg.grads(g, x, w, counts, need_x=False)[1]),
    }


def _difference(got: torch.Tensor, want: torch.Tensor, live: int) -> float:
    if got.dim() == 2:
        got, want = got[:live], want[:live]
    scale = want.abs().max().clamp(min=1e-30)
    return float((got.double() - want.double()).abs().max() / scale)


def time_grouped_gemm(presets=("mixtral-8x7b", "qwen3-30b-a3b"),
                      dtypes=(torch.float16, torch.float32, torch.bfloat16), tokens: int = 8192,
                      skew: float = 1.0, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Time the three products of each preset GEMM and dtype (see the module docstring).

    Returns one dict per (GEMM, dtype, product) with ``ms_native``, ``ms_triton``,
    ``ms_triton_graph``, ``tflops_native``, ``tflops_triton``, ``ratio`` (Triton eager /
    native) and ``difference``. fp32 runs exact products unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set (both sides follow it).
    """
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    results = []
    for name in presets:
        for label, rows, n_in, n_out, experts in _gemms(name, tokens):
            counts = _counts(rows, experts, skew, gen).to(device)
            flops = 2.0 * rows * n_in * n_out
            for dtype in dtypes:
                x = torch.randn(rows, n_in, generator=gen).to(device, dtype)
                w = (torch.randn(experts, n_out, n_in, generator=gen) / n_in ** 0.5).to(device,
                                                                                     dtype)
                g = torch.randn(rows, n_out, generator=gen).to(device, dtype)
                tg.prepare(x, w)
                for op, (native, triton) in _products(x, w, g, counts).items():
                    try:
                        diff = _difference(triton(), native(), rows)
                        ms_native = time_calls(native, repeats=repeats, inner=3)
                    except (RuntimeError, NotImplementedError) as err:   # no native op here
                        print(f"{label} {dtype} {op}: torch._grouped_mm failed: {err}")
                        diff = ms_native = float("nan")
                    ms_triton = time_calls(triton, repeats=repeats, inner=3)
                    ms_graph = time_replays(capture(triton, warmup=1), repeats)
                    results.append(dict(
                        gemm=label, dtype=str(dtype).replace("torch.", ""), op=op,
                        shape=f"{rows}x{n_in} @ {experts}x{n_in}x{n_out}",
                        precision=tg.precision(dtype) if dtype == torch.float32 else "-",
                        ms_native=ms_native,
                        ms_triton=ms_triton, ms_triton_graph=ms_graph,
                        tflops_native=flops / ms_native / 1e9,
                        tflops_triton=flops / ms_triton / 1e9,
                        ratio=ms_triton / ms_native, difference=diff))
                del x, w, g
                torch.cuda.empty_cache()
    return results


def print_table(results: list[dict]) -> None:
    """One line per (GEMM, dtype, product)."""
    print(f"{'gemm':<20}{'dtype':<10}{'prec':<6}{'op':<9}{'native ms':>10}{'triton ms':>10}"
          f"{'graph ms':>10}{'TF/s nat':>9}{'TF/s tri':>9}{'tri/nat':>8}{'max diff':>10}")
    for r in results:
        print(f"{r['gemm']:<20}{r['dtype']:<10}{r['precision']:<6}{r['op']:<9}"
              f"{r['ms_native']:>10.3f}{r['ms_triton']:>10.3f}{r['ms_triton_graph']:>10.3f}"
              f"{r['tflops_native']:>9.1f}{r['tflops_triton']:>9.1f}{r['ratio']:>8.2f}"
              f"{r['difference']:>10.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="mixtral-8x7b,qwen3-30b-a3b")
    parser.add_argument("--dtypes", default="float16,float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--skew", type=float, default=1.0,
                        help="tilt of the routing towards low expert ids (0: uniform shares)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tf32", action="store_true",
                        help="allow tf32 for fp32 (torch.backends.cuda.matmul.allow_tf32)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.tokens} tokens, skew {args.skew}")
    print_table(time_grouped_gemm(args.presets.split(","),
                                  [getattr(torch, d) for d in args.dtypes.split(",")],
                                  args.tokens, args.skew, args.repeats))


if __name__ == "__main__":
    main()
