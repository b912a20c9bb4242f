"""The Triton grouped GEMM (NOTE [triton grouped GEMM]) against the per-expert loop, on the
CPU in Triton's interpreter at tiny sizes; its device-side tile plan; the selection in
grouped_mm. The same kernels on a GPU, captured: test_moe_triton_gpu.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from graphstash.errors import BackendUnavailableError
from graphstash.moe import _triton_grouped as tg
from graphstash.moe import grouped_mm
from graphstash.moe.experts import grouped_mm_grads, reads_rows_past_counts, resolve_impl

from _moe_data import tokens

needs_triton = pytest.mark.skipif(tg.unavailable_reason(torch.device("cpu"), torch.float32)
                                  is not None, reason="needs triton (its CPU interpreter): "
                                  "not installed")
SMALL = tg.TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4,
                      num_stages=1)
# float32: products and sums in float32 either way, in another order; 16-bit: the kernel
# rounds once from a float32 sum, the CPU loop may round partial sums.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=5e-2),
       torch.bfloat16: dict(rtol=1.6e-2, atol=0.5)}


def _case(gen, dtype, counts, rows, n_in=20, n_out=24):
    """x, weight, grad with rows past the counts set to NaN (a read of one shows)."""
    live = sum(counts)
    x = tokens(rows, n_in, gen, dtype) / rows
    w = (torch.rand(len(counts), n_out, n_in, generator=gen) - 0.5).to(dtype)
    g = (torch.rand(rows, n_out, generator=gen) - 0.5).to(dtype)
    x[live:] = float("nan")
    g[live:] = float("nan")
    return x, w, g, torch.tensor(counts, dtype=torch.int32), live


COUNTS = [
    ([20, 0, 33, 5], 70),       # an empty expert, experts over several row tiles, 12 past
    pytest.param([0, 0, 0], 9, marks=pytest.mark.slow),             # no rows at all
    # tile-aligned experts, nothing past the counts
    pytest.param([16, 32], 48, marks=pytest.mark.slow),
    # tiny experts, a ragged large one
    pytest.param([1, 40, 0, 2, 7], 50, marks=pytest.mark.slow),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("counts,rows", COUNTS)
def test_interpreted_kernels_match_loop(gen, dtype, counts, rows):
    x, w, g, counts_t, n = _case(gen, dtype, counts, rows)
    want = grouped_mm(x, w, counts_t, impl="loop")
    want_x, want_w = grouped_mm_grads(g, x, w, counts_t, "loop")
    got = tg.forward(x, w, counts_t, config=SMALL)
    got_x, got_w = tg.grads(g, x, w, counts_t, config=SMALL)
    tol = TOL[dtype]
    torch.testing.assert_close(got[:n].float(), want[:n].float(), **tol)
    torch.testing.assert_close(got_x[:n].float(), want_x[:n].float(), **tol)
    torch.testing.assert_close(got_w.float(), want_w.float(), **tol)
    for e, c in enumerate(counts):
        if c == 0:      # no rows: exactly zero, not left unwritten
            assert torch.equal(got_w[e], torch.zeros_like(got_w[e]))


@needs_triton
def test_interpreted_grouped_mm_autograd_default_tiles(gen):
    """impl="triton" through autograd (default tiles, int64 counts) equals autograd through the
    loop; rows past the counts are neither read (NaN there) nor needed."""
    x, w, g, counts_t, n = _case(gen, torch.float32, [9, 0, 30], 45, n_in=20, n_out=36)
    counts_t = counts_t.long()
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_()
    out = grouped_mm(xs, ws, counts_t, impl="triton")
    got = torch.autograd.grad(out[:n], (xs, ws), g[:n])
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    ref = grouped_mm(xr, wr, counts_t, impl="loop")
    want = torch.autograd.grad(ref[:n], (xr, wr), g[:n])
    torch.testing.assert_close(out[:n], ref[:n], **TOL[torch.float32])
    torch.testing.assert_close(got[0][:n], want[0][:n], **TOL[torch.float32])
    torch.testing.assert_close(got[1], want[1], **TOL[torch.float32])
    gx, gw = grouped_mm_grads(g, x, w, counts_t, "triton")
    torch.testing.assert_close(gx[:n], want[0][:n], **TOL[torch.float32])
    torch.testing.assert_close(gw, want[1], **TOL[torch.float32])


@needs_triton
def test_interpreted_views_and_counts_past_the_rows(gen):
    """A transposed weight view and an offset row view are made dense; counts summing past
    the buffer read and write no row outside it (rows are clamped; the values there are
    wrong by contract, memory is safe)."""
    x, w, _, counts_t, n = _case(gen, torch.float32, [5, 11], 20, n_in=16, n_out=20)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)     # same values, strides (.., 1, 20)
    big = torch.cat([torch.full((1,), float("nan")), x.flatten()])[1:].view(20, 16)
    assert big.data_ptr() % 16                              # 4 bytes past an aligned base
    got = tg.forward(big, wt, counts_t, config=SMALL)
    torch.testing.assert_close(got[:n], grouped_mm(x, w, counts_t, impl="loop")[:n],
                               **TOL[torch.float32])
    over = torch.tensor([12, 30], dtype=torch.int32)         # 42 rows claimed, 20 exist
    out = tg.forward(x, w, over, config=SMALL)
    gx, gw = tg.grads(out, x, w, over, config=SMALL)
    torch.testing.assert_close(out[:12], x[:12] @ w[0].t(), **TOL[torch.float32])
    assert out.shape == (20, 20) and gx.shape == x.shape and gw.shape == w.shape


def _plan_by_hand(counts, rows, block_m):
    """Slot -> (expert, first row, end row) by enumeration, and the slot count."""
    slots, start = [], 0
    for e, c in enumerate(counts):
        for first in range(start, start + c, block_m):
            slots.append((e, first, start + c))
        start += c
    return slots, tg._row_tile_slots(rows, len(counts), block_m)


@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_plan_covers_every_row_once_within_the_static_slots(gen, block_m):
    """NOTE [triton grouped GEMM]: the device plan gives each used slot its expert and first
    row, as enumeration does, for random counts summing to at most ``rows``; the unused
    slots say ``E``; the static slot count always suffices."""
    for _ in range(40):
        E = int(torch.randint(1, 9, (1,), generator=gen))
        rows = int(torch.randint(0, 300, (1,), generator=gen))
        live = int(torch.randint(0, rows + 1, (1,), generator=gen))
        share = torch.rand(E, generator=gen) * (torch.rand(E, generator=gen) < 0.7)
        counts = (share / share.sum().clamp(min=1e-9) * live).floor().long().tolist()
        tile_expert, starts, ends, first_tile = tg._plan(torch.tensor(counts), rows, block_m)
        want, num_slots = _plan_by_hand(counts, rows, block_m)
        assert len(want) <= num_slots == tile_expert.shape[0], (counts, rows)
        got = []
        for slot in range(num_slots):
            e = int(tile_expert[slot])
            if e == E:
                continue
            first = int(starts[e]) + (slot - int(first_tile[e])) * block_m
            got.append((e, first, int(ends[e])))
        assert got == want, (counts, rows)
        assert (tile_expert[len(want):] == E).all()


def test_selection_and_bad_input_name_the_argument(gen, monkeypatch):
    x = tokens(12, 8, gen)
    w = torch.rand(2, 4, 8, generator=gen)
    counts = torch.tensor([5, 7], dtype=torch.int32)
    assert resolve_impl(x, w) in ("grouped", "loop")        # eager "auto" never picks triton
    assert not reads_rows_past_counts(x, w)
    with pytest.raises(TypeError, match="x: impl='triton' expected float16, bfloat16 or "
                                        "float32, got torch.float64"):
        grouped_mm(x.double(), w.double(), counts, impl="triton")
    with pytest.raises(ValueError, match="impl: expected 'auto', 'grouped', 'triton'"):
        grouped_mm(x, w, counts, impl="cutlass")
    monkeypatch.setattr(tg, "_triton_missing", lambda: "triton is not installed")
    with pytest.raises(BackendUnavailableError, match="triton is not installed"):
        grouped_mm(x, w, counts, impl="triton")
    assert not tg.prepare(x, w)                               # nothing to prepare on a CPU


@pytest.mark.slow
def test_package_imports_without_triton():
    """Triton is imported on first use only: importing graphstash (and its MoE package) and
    choosing an implementation on the CPU leave it unimported."""
    code = ("import sys, torch, graphstash, graphstash.moe\n"
            "from graphstash.moe.experts import resolve_impl\n"
            "resolve_impl(torch.ones(2, 4), torch.ones(1, 3, 4))\n"
            "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
