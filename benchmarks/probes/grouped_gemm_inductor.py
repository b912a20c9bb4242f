"""torch's CUTLASS grouped GEMM against the fastest Triton grouped GEMM Inductor can tune.

The question it answers: could the row copies around the experts' GEMMs (the dispatch's
spread into the first GEMM, the regathered input of its weight gradient, combine's backward
into the second GEMM's two backward products) be folded into a Triton grouped GEMM that
loads its rows through the routing's index? Such a kernel pays for itself only if it runs
within the copy's time of ``torch._grouped_mm`` (CUTLASS on sm90) on contiguous rows. This
probe times, per preset width (8192 tokens, bf16, the routing of random top-k scores sorted
by expert, ``spread_rows.py``'s maps) and per product of each expert GEMM:

- ``torch._grouped_mm`` itself (what graphstash and the peers launch);
- the same call ``torch.compile``d with ``mode="max-autotune-no-cudagraphs"`` and
  ``max_autotune_gemm_backends="TRITON"``: Inductor's persistent grouped-GEMM template (TMA
  loads on sm90), the best of its configurations for the shape, on contiguous rows, with
  no gather in it;
- graphstash's spread of the same rows (``gather_rows`` with the inverse map, NOTE [spread
  rows] in ``raw_kernels/moe_dispatch.cu``), the copy a fused kernel would save.

``break-even`` is ``(CUTLASS + copy) / CUTLASS``: the most a fused kernel may take over
CUTLASS for the product it would absorb the copy into. Prints a Markdown table; Inductor's
autotuning log (every configuration's time) goes to stderr.

    python benchmarks/probes/grouped_gemm_inductor.py
    python benchmarks/probes/grouped_gemm_inductor.py --presets qwen3-30b-a3b --ops forward
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from graphstash.moe.backend import OPERATORS  # noqa: E402
from graphstash.tools.bench.timing import time_calls_interleaved  # noqa: E402
from spread_rows import PRESETS, chosen_presets, routing_maps, time_us  # noqa: E402

OPS = ("forward", "grad x", "grad w")
# The products that read spread rows, whose spread a gathering kernel would save: the
# dispatch's (w1 forward), the regathered input (w1 grad w), combine's backward (w2 grad x
# and grad w share it).
READS_SPREAD = frozenset({("w1", "forward"), ("w1", "grad w"), ("w2", "grad x"),
                          ("w2", "grad w")})


def operands(op: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """``(a, b)`` of ``torch._grouped_mm(a, b, offs=offs)`` for one product of the GEMM
    ``out[rows of e] = x[rows of e] @ w[e].T``: x bf16 ``[rows, n_in]``, w bf16 ``[E, n_out,
    n_in]``, g bf16 ``[rows, n_out]`` (the output's gradient), all on one CUDA device."""
    if op == "forward":
        return x, w.transpose(-2, -1)
    if op == "grad x":
        return g, w
    return g.transpose(0, 1), x


def _grouped(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def triton_grouped():
    """``torch._grouped_mm`` compiled so that only Inductor's Triton templates may run it."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    compiled = torch.compile(_grouped, mode="max-autotune-no-cudagraphs", dynamic=False,
                             fullgraph=True)

    def call(a, b, offs):
        with inductor_config.patch(max_autotune_gemm_backends="TRITON"):
            return compiled(a, b, offs)
    return call


def measure(name, tokens, experts, topk, hidden, ffn, ops, gen, repeats) -> list[dict]:
    """Rows of the table for one preset (see the module docstring)."""
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    index, inverse = routing_maps(tokens, experts, topk, gen)
    rows = index.numel()
    # Rows per expert of another draw of the same routing (the GEMMs' rows are random).
    ids = torch.rand(tokens, experts, generator=gen, device=dev).topk(topk, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    spread_out = torch.empty(rows, hidden, device=dev, dtype=bf16)
    copy_ms = time_us(lambda: OPERATORS.gather_rows(spread_out, tok, index, inverse=inverse),
                      50) / 1e3
    torch.cuda.synchronize()
    results = []
    for gemm, n_in, n_out in (("w1", hidden, 2 * ffn), ("w2", ffn, hidden)):
        x = torch.randn(rows, n_in, device=dev, dtype=bf16)
        w = torch.randn(experts, n_out, n_in, device=dev, dtype=bf16) / n_in ** 0.5
        g = torch.randn(rows, n_out, device=dev, dtype=bf16)
        for op in ops:
            a, b = operands(op, x, w, g)
            triton = triton_grouped()
            want = _grouped(a, b, offs)
            got = triton(a, b, offs)
            diff = float((got.double() - want.double()).abs().max()
                         / want.double().abs().max().clamp(min=1e-30))
            ms = time_calls_interleaved({"cutlass": lambda: _grouped(a, b, offs),
                                         "triton": lambda: triton(a, b, offs)},
                                        repeats=repeats, inner=5)
            flops = 2.0 * rows * n_in * n_out
            absorbs = (gemm, op) in READS_SPREAD
            results.append(dict(
                preset=name, gemm=gemm, op=op, ms_cutlass=ms["cutlass"], ms_triton=ms["triton"],
                tflops_cutlass=flops / ms["cutlass"] / 1e9,
                tflops_triton=flops / ms["triton"] / 1e9, difference=diff,
                copy_ms=copy_ms if absorbs else None,
                break_even=(ms["cutlass"] + copy_ms) / ms["cutlass"] if absorbs else None))
            print_row(results[-1])
            del want, got
        del x, w, g
        torch.cuda.empty_cache()
    return results


def print_header() -> None:
    print("| widths | GEMM | product | CUTLASS ms (TFLOP/s) | Inductor Triton ms (TFLOP/s) "
          "| Triton / CUTLASS | max rel. diff | copy it could absorb ms | break-even |")
    print("|---|---|---|---|---|---|---|---|---|")


def print_row(r: dict) -> None:
    copy = f"{r['copy_ms']:.3f}" if r["copy_ms"] is not None else "-"
    even = f"{r['break_even']:.3f}" if r["break_even"] is not None else "-"
    print(f"| {r['preset']} | {r['gemm']} | {r['op']} | {r['ms_cutlass']:.3f} "
          f"({r['tflops_cutlass']:.0f}) | {r['ms_triton']:.3f} ({r['tflops_triton']:.0f}) | "
          f"{r['ms_triton'] / r['ms_cutlass']:.3f} | {r['difference']:.1e} | {copy} | {even} |",
          flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,olmoe-1b-7b",
                        help="comma-separated, of " + ", ".join(p[0] for p in PRESETS))
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated, of " +
                        ", ".join(OPS))
    parser.add_argument("--repeats", type=int, default=20, help="timed samples per figure")
    args = parser.parse_args(argv)
    presets = chosen_presets(parser, args.presets, args.repeats)
    ops = [o for o in args.ops.split(",") if o]
    for o in ops:
        if o not in OPS:
            parser.error(f"--ops: unknown product {o!r}; expected one of {list(OPS)}")
    if not torch.cuda.is_available():
        sys.exit("grouped_gemm_inductor.py: needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, 8192 tokens")
    print_header()
    for p in presets:
        measure(*p, ops, gen, args.repeats)


if __name__ == "__main__":
    main()
