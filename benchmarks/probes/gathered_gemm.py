"""A grouped GEMM that gathers its rows as it loads them, against the copy and CUTLASS.

The experts' first GEMM reads each token once per expert it is routed to. graphstash (and
every peer) first copies the tokens into expert-sorted rows (the dispatch's spread, NOTE
[spread rows] in ``raw_kernels/moe_dispatch.cu``), then runs ``torch._grouped_mm`` (CUTLASS
on sm90) on them. A Triton kernel that loads its A tile through the routing's index
(``x[index[rows]]``) needs no copy. This probe measures whether that pays, at real widths
(8192 tokens, bf16, the routing of random top-k scores sorted by expert):

- ``CUTLASS``: ``torch._grouped_mm`` on the sorted rows;
- ``spread + CUTLASS``: the copy and the GEMM, what a step runs today;
- ``Triton``: the kernel below on the sorted rows (no gather), best of a few tile configs;
- ``Triton, gathered``: the same kernel loading its rows through the index, best config.

The kernel: one program per (row tile, column tile), a row tile holding one expert's rows
(a tile plan built on the device, as NOTE [triton grouped GEMM] in
``graphstash/moe/_triton_grouped.py`` describes), ``tl.dot`` over K in fp32. Every result is
checked against ``torch._grouped_mm`` on the copied rows before it is timed. Each timed call
builds its tile plan too (about ten small torch kernels, as the library's Triton path does
on every call), in both Triton columns alike.

    python benchmarks/probes/gathered_gemm.py
    TRITON_INTERPRET=1 python benchmarks/probes/gathered_gemm.py --check-only   # on a CPU
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from spread_rows import chosen_presets, routing_maps  # noqa: E402

# (BM, BN, BK, num_warps, num_stages)
CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
           (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 256, 64, 8, 4)]


@triton.jit
def gathered_rows(x_ptr, index_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
                  N, K, num_tiles, GATHER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GROUP_M: tl.constexpr):
    # out[r, :] = x[index[r] if GATHER else r, :] @ w[e].T for the rows r of expert e that the
    # program's row tile holds; x [*, K], w [E, N, K], out [rows, N], all row-major.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    per_group = GROUP_M * n_tiles
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    tile = first + (pid % per_group) % size
    col_tile = (pid % per_group) // size
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BM)
    row_ok = rows < tl.load(ends_ptr + e)
    if GATHER:
        src = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = col_tile * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + src[:, None] * K + ks[None, :]
    b_ptrs = w_ptr + (e.to(tl.int64) * N + cols[None, :]) * K + ks[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_plan(counts: torch.Tensor, rows: int, bm: int):
    """``(tile_expert, tile_row, ends)`` for row tiles of ``bm`` rows: int64 on counts' device;
    ``tile_expert`` is -1 for a slot no expert uses. counts: int ``[E]``, summing to ``rows``."""
    c = counts.to(torch.int64)
    experts = c.numel()
    ends = torch.cumsum(c, 0)
    tiles = (c + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    slots = torch.arange((rows + bm - 1) // bm + experts, device=c.device)
    e = torch.searchsorted(tile_end, slots, right=True)
    used = e < experts
    ec = e.clamp(max=experts - 1)
    row = (ends - c)[ec] + (slots - (tile_end - tiles)[ec]) * bm
    return torch.where(used, e, -1), row, ends


def launch(x, index, w, counts, out, config, gather: bool) -> torch.Tensor:
    """``out[rows] = (x[index] if gather else x) @ w[e].T`` per expert's rows: x ``[T or rows,
    K]``, index int32 ``[rows]``, w ``[E, N, K]``, counts int ``[E]``, out ``[rows, N]``, one
    dtype and device."""
    bm, bn, bk, warps, stages = config
    rows, (n, k) = out.shape[0], w.shape[1:]
    if k % bk:
        raise ValueError(f"config: K = {k} is not a multiple of BK = {bk}")
    tile_expert, tile_row, ends = tile_plan(counts, rows, bm)
    num_tiles = tile_expert.numel()
    grid = (num_tiles * triton.cdiv(n, bn),)
    gathered_rows[grid](x, index, w, out, tile_expert, tile_row, ends, n, k, num_tiles,
                        GATHER=gather, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps,
                        num_stages=stages)
    return out


def reference(x_rows, w, counts) -> torch.Tensor:
    """The per-expert product in fp32 with ``torch.matmul``: x_rows ``[rows, K]``, w ``[E,
    N, K]``, counts int ``[E]``; ``[rows, N]`` fp32."""
    pieces = torch.split(x_rows.float(), counts.tolist())
    return torch.cat([p @ w[e].float().T for e, p in enumerate(pieces)])


def check(device: torch.device, dtype: torch.dtype) -> None:
    """Both modes of the kernel against :func:`reference` on a small routing (uneven counts,
    an expert without rows); exits with the difference if either is off."""
    gen = torch.Generator(device=device).manual_seed(1)
    tokens, experts, topk, k, n = 40, 5, 2, 64, 48
    index, _ = routing_maps(tokens, experts, topk, gen)
    counts = torch.tensor([30, 0, 17, 20, 13], device=device)
    x = torch.randn(tokens, k, generator=gen, device=device).to(dtype)
    w = torch.randn(experts, n, k, generator=gen, device=device).to(dtype)
    x_rows = x[index.long()]
    want = reference(x_rows, w, counts)
    for gather, src in ((False, x_rows), (True, x)):
        out = torch.full((tokens * topk, n), float("nan"), device=device, dtype=dtype)
        got = launch(src, index, w, counts, out, (16, 16, 32, 4, 2), gather).float()
        err = float((got - want).abs().max() / want.abs().max())
        if not err < (1e-5 if dtype == torch.float32 else 1e-2):
            sys.exit(f"gathered_gemm.py: gather={gather} differs from the reference by {err}")


def time_ms(fn, repeats: int) -> float:
    """Median ms of one call over ``repeats`` samples of 5 calls (CUDA events), after 3 calls."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 5)
    return sorted(samples)[len(samples) // 2]


def measure(name, tokens, experts, topk, hidden, ffn, gen, repeats) -> None:
    """One preset's row: the first expert GEMM (``[rows, hidden] x [E, 2 ffn, hidden]``)."""
    from graphstash.moe.backend import OPERATORS

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    index, inverse = routing_maps(tokens, experts, topk, gen)
    rows = index.numel()
    ids = torch.rand(tokens, experts, generator=gen, device=dev).topk(topk, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    n = 2 * ffn
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    w = torch.randn(experts, n, hidden, device=dev, dtype=bf16) / hidden ** 0.5
    x_rows = torch.empty(rows, hidden, device=dev, dtype=bf16)
    out = torch.empty(rows, n, device=dev, dtype=bf16)

    def spread():
        OPERATORS.gather_rows(x_rows, x, index, inverse=inverse)

    spread()
    want = torch._grouped_mm(x_rows, w.transpose(-2, -1), offs=offs)
    scale = float(want.float().abs().max())
    cutlass = time_ms(lambda: torch._grouped_mm(x_rows, w.transpose(-2, -1), offs=offs),
                      repeats)
    copy = time_ms(spread, repeats)
    best = {}
    for gather, src in ((False, x_rows), (True, x)):
        for config in CONFIGS:
            out.fill_(float("nan"))
            got = launch(src, index, w, counts, out, config, gather)
            err = float((got.float() - want.float()).abs().max()) / scale
            if not err < 1e-2:
                sys.exit(f"{name}: gather={gather} {config} differs from CUTLASS by {err}")
            ms = time_ms(lambda: launch(src, index, w, counts, out, config, gather), repeats)
            if gather not in best or ms < best[gather][0]:
                best[gather] = (ms, config)
    flops = 2.0 * rows * hidden * n
    tri, gat = best[False], best[True]
    print(f"| {name} | {rows}x{hidden} @ {experts}x{n}x{hidden} | {cutlass:.3f} "
          f"({flops / cutlass / 1e9:.0f}) | {copy:.3f} | {cutlass + copy:.3f} | "
          f"{tri[0]:.3f} ({flops / tri[0] / 1e9:.0f}) {tri[1]} | "
          f"{gat[0]:.3f} ({flops / gat[0] / 1e9:.0f}) {gat[1]} | "
          f"{gat[0] / (cutlass + copy):.3f} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b,olmoe-1b-7b")
    parser.add_argument("--repeats", type=int, default=20, help="timed samples per figure")
    parser.add_argument("--check-only", action="store_true",
                        help="only check the kernel against the reference (CPU: interpreter)")
    args = parser.parse_args(argv)
    presets = chosen_presets(parser, args.presets, args.repeats)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Triton's interpreter multiplies bfloat16 as raw bits (NOTE [interpreted bf16 products]).
    for dtype in (torch.float32, torch.float16) if device.type == "cpu" else (torch.bfloat16,):
        check(device, dtype)
    print(f"gathered_gemm.py: both modes match the reference on {device}")
    if args.check_only:
        return
    if device.type != "cuda":
        sys.exit("gathered_gemm.py: timing needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, bf16, 8192 tokens; the first expert GEMM's forward")
    print("| widths | shape | CUTLASS ms (TFLOP/s) | spread ms | spread + CUTLASS ms "
          "| Triton ms (TFLOP/s), config | Triton gathered ms (TFLOP/s), config "
          "| gathered / (spread + CUTLASS) |")
    print("|---|---|---|---|---|---|---|---|")
    for p in presets:
        measure(*p, gen, args.repeats)


if __name__ == "__main__":
    main()
