"""The Triton grouped GEMM (NOTE [triton grouped GEMM]) against the per-expert loop, on the
CPU in Triton's interpreter at tiny sizes; its device-side tile plan; the selection in
grouped_mm. The same kernels on a GPU, captured: test_moe_triton_gpu.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from graphstash import _layout as L
from graphstash.errors import BackendUnavailableError
from graphstash.moe import _triton_grouped as tg
from graphstash.moe import budget_rows, combine, dispatch, expert_mlp, grouped_mm
from graphstash.moe.experts import grouped_mm_grads, resolve_impl

from _moe_data import routing, tokens

needs_triton = pytest.mark.skipif(tg.unavailable_reason(torch.device("cpu"), torch.float32)
                                  is not None, reason="needs triton (its CPU interpreter): "
                                  "not installed")

def _interpreter_skip_reason():
    """Why the interpreter tests cannot run here, or None. They were written against Triton
    3.9's CPU interpreter; Triton 3.6's (the GPU machines' image) rejects the kernels' scalar
    loads ("only 0-dimensional arrays can be converted to Python scalars") while its compiled
    kernels pass tests/test_moe_triton_gpu.py, so older interpreters are not used as the oracle."""
    why = tg.unavailable_reason(torch.device("cpu"), torch.float32)
    if why is not None:
        return "needs triton (its CPU interpreter): not installed"
    import triton

    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 9):
        return (f"Triton {triton.__version__}'s interpreter cannot run these kernels (3.9 can); "
                "the compiled kernels are tested by tests/test_moe_triton_gpu.py")
    return None


needs_interpreter = pytest.mark.skipif(_interpreter_skip_reason() is not None,
                                       reason=str(_interpreter_skip_reason()))
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


@needs_interpreter
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


@needs_interpreter
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


@needs_interpreter
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
    """graphstash's Triton kernels are imported on first use only: importing graphstash (and
    its MoE package) and choosing an implementation on the CPU leave the kernel module
    unimported. (Whether Triton itself is in sys.modules then is torch's business: where it
    is installed, torch's own modules import it; CI, without Triton, imports graphstash.)"""
    code = ("import sys, torch, graphstash, graphstash.moe\n"
            "from graphstash.moe.experts import resolve_impl\n"
            "resolve_impl(torch.ones(2, 4), torch.ones(1, 3, 4))\n"
            "assert 'graphstash.moe._triton_grouped_kernels' not in sys.modules, "
            "sorted(m for m in sys.modules if 'triton' in m)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def _compile_for_hopper(fn, args: dict, constexprs: dict, dtype: str, config):
    """Compile ``fn`` for sm90 without a GPU, specialised as a launch would be: pointers and
    multiples of 16 marked divisible by 16, ints equal to 1 made constants, the row counts
    (``do_not_specialize``) left alone."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        value = args.get(name)
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, str):                        # a pointer: "*fp16", "*i64"
            signature[name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif name not in ("M", "num_tiles") and value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if name not in ("M", "num_tiles") and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("dtype,prec", [("fp16", "tf32"), ("bf16", "tf32"), ("fp32", "ieee"),
                                        ("fp32", "tf32")])
def test_kernels_compile_for_hopper(dtype, prec):
    """The compiled (not interpreted) kernels build for sm90 at Mixtral-8x7B widths, forward,
    grad_x and grad_w: 16-bit and allowed-tf32 products on tensor cores (wgmma), exact fp32
    ones (tf32 not allowed) with no tensor-core instruction at all."""
    import triton

    from graphstash.moe import _triton_grouped_kernels as src

    rows_kernel = triton.jit(src.grouped_rows, do_not_specialize=["M", "num_tiles"])
    weight_kernel = triton.jit(src.grouped_weight_grad, do_not_specialize=["M"])
    config = tg._CONFIGS["16-bit" if dtype != "fp32" else prec]
    E, N, K, M = 8, 28672, 4096, 16384
    plan = dict(tile_expert_ptr="*i64", starts_ptr="*i64", ends_ptr="*i64",
                first_tile_ptr="*i64", M=M, num_tiles=M // 64 + E, num_experts=E,
                a_ptr=f"*{dtype}", b_ptr=f"*{dtype}", c_ptr=f"*{dtype}")
    tiles = dict(BM=config.block_m, BN=config.block_n, BK=config.block_k,
                 GROUP_M=config.group_m, PREC=prec, DOT_F32=False)
    builds = [
        (rows_kernel, dict(plan, N=N, K=K, stride_am=K, stride_be=N * K, stride_bk=1,
                           stride_bn=K, stride_cm=N), tiles),
        (rows_kernel, dict(plan, N=K, K=N, stride_am=N, stride_be=N * K, stride_bk=K,
                           stride_bn=1, stride_cm=K), tiles),
        (weight_kernel, dict(p_ptr=f"*{dtype}", q_ptr=f"*{dtype}", c_ptr=f"*{dtype}",
                             starts_ptr="*i64", ends_ptr="*i64", M=M, I=N, J=K, stride_pm=N,
                             stride_qm=K, stride_ce=N * K, stride_ci=K),
         dict(BI=config.block_n, BJ=config.block_n, BR=config.block_k, PREC=prec,
              DOT_F32=False)),
    ]
    for fn, args, constexprs in builds:
        ptx = _compile_for_hopper(fn, args, constexprs, dtype, config).asm["ptx"]
        tensor_cores = "wgmma" in ptx or "mma.sync" in ptx
        assert tensor_cores == (prec == "tf32" or dtype != "fp32"), (fn, args)


@needs_interpreter
def test_interpreted_moe_layer_through_triton_matches_loop(gen):
    """dispatch -> gated expert_mlp (the input regathered in backward, router weights) ->
    combine with impl="triton" for both GEMMs equals impl="loop": output and the gradients of
    the tokens, the router weights and both expert weights."""
    T, H, F, E, K = 20, 16, 12, 3, 2
    x = (tokens(T, H, gen) / T).requires_grad_()
    idx, w = routing(T, K, E, gen)
    w = w.requires_grad_()
    w1 = (torch.rand(E, 2 * F, H, generator=gen) - 0.5).requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen) - 0.5).requires_grad_()
    budget = budget_rows(T, K, E, capacity_factor=2.0)
    results = []
    for impl in ("triton", "loop"):
        status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32)
        permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, status=status)
        y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), gated=True,
                       impl=impl, handle=handle)
        out = combine(y, handle, weighted=False)
        results.append([out] + list(torch.autograd.grad(out.pow(2).sum(), (x, w, w1, w2))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **TOL[torch.float32])
