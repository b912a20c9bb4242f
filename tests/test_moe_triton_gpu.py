"""The Triton grouped GEMM on the GPU (NOTE [triton grouped GEMM]): captured in a CUDA graph
and replayed with changing counts, forward and both gradients against a float64 per-expert
loop over the same inputs, within the rounding of each dtype; what "auto" picks and when."""
from __future__ import annotations

import warnings

import pytest
import torch

from _capture import capture_with_output
from graphstash.errors import CaptureError
from graphstash.moe import _triton_grouped as tg
from graphstash.moe import expert_mlp, experts, grouped_mm, prepare_experts
from graphstash.moe.experts import resolve_impl

from _moe_data import tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(tg.unavailable_reason(torch.device("cuda"), torch.float32)
                                 is not None, reason="needs triton: not installed")]

# Against float64: the kernel accumulates in float32 and rounds once (16-bit); float32 takes
# exact products unless tf32 is allowed (a tf32 product is off by ~2**-11: the strict float32
# tolerance fails it, so it also checks that tf32 stays off when not allowed).
TOL = {"float16": dict(rtol=2e-3, atol=2e-3), "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
       "float32": dict(rtol=2e-5, atol=2e-5), "tf32": dict(rtol=4e-3, atol=4e-3)}
R, H, N, E = 200, 96, 80, 5         # widths off the 128-wide tiles: masked edges
REPLAY_COUNTS = ([40, 0, 100, 35, 25],      # every row, an empty expert
                 [13, 57, 0, 1, 60],        # 69 rows past the counts
                 [0, 0, 0, 0, 0],           # nothing
                 [200, 0, 0, 0, 0],         # one expert takes all
                 [0, 0, 0, 0, 199])


def _reference(x, w, g, counts):
    """Forward and both gradients in float64 through the loop (rows inside the counts)."""
    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    n = sum(counts)
    y = grouped_mm(xr, wr, torch.tensor(counts, device=x.device), impl="loop")
    gx, gw = torch.autograd.grad(y[:n], (xr, wr), g[:n].double())
    return y[:n], gx[:n], gw


def _poison_past(t, n):
    t[n:] = float("nan")
    return t


@pytest.mark.parametrize("case", ["float16", "float32", "tf32", "bfloat16"])
def test_captured_triton_matches_loop_with_changing_counts(gen, case, monkeypatch):
    """fp16 and fp32 through "auto" (which must pick triton inside the capture: the native op
    cannot be captured there), bf16 through impl="triton"; rows past the counts of x and of
    the output gradient are NaN and must not be read; an expert without rows gets a zero
    weight gradient."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", case == "tf32")
    dtype = getattr(torch, "float32" if case == "tf32" else case)
    impl = "triton" if dtype == torch.bfloat16 else "auto"
    static_x = (tokens(R, H, gen, dtype) / R).cuda().requires_grad_()
    static_w = (torch.rand(E, N, H, generator=gen) - 0.5).to("cuda", dtype).requires_grad_()
    static_g = (torch.rand(R, N, generator=gen) - 0.5).to("cuda", dtype)
    static_counts = torch.tensor(REPLAY_COUNTS[0], dtype=torch.int32, device="cuda")
    chosen = []

    def step():
        static_x.grad = static_w.grad = None
        chosen.append(resolve_impl(static_x, static_w, impl))
        y = grouped_mm(static_x, static_w, static_counts, impl=impl)
        y.backward(static_g)
        return y.detach()

    graph, static_y = capture_with_output(step)
    assert chosen[-1] == "triton" and chosen[0] in ("grouped", "loop", "triton")
    for counts in REPLAY_COUNTS:
        n = sum(counts)
        x = _poison_past((tokens(R, H, gen, dtype) / R).cuda(), n)
        g = _poison_past((torch.rand(R, N, generator=gen) - 0.5).to("cuda", dtype), n)
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
            static_counts.copy_(torch.tensor(counts, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        y, gx, gw = _reference(x, static_w.detach(), g, counts)
        tol = TOL[case]
        torch.testing.assert_close(static_y[:n].double(), y, **tol, msg=f"y {counts}")
        torch.testing.assert_close(static_x.grad[:n].double(), gx, **tol, msg=f"dx {counts}")
        torch.testing.assert_close(static_w.grad.double(), gw, **tol, msg=f"dw {counts}")
        for e, c in enumerate(counts):
            if c == 0:
                assert (static_w.grad[e] == 0).all(), (counts, e)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_captured_gated_expert_mlp_takes_triton(gen, dtype):
    """expert_mlp (SwiGLU, router weights) captured in fp16/fp32: both GEMMs run the Triton
    kernels inside the graph; output and every gradient match the float64 loop."""
    Rm, Hm, F, Em = 160, 64, 48, 4
    params = [(tokens(Rm, Hm, gen, dtype) / Rm).cuda(),
              (torch.rand(Em, 2 * F, Hm, generator=gen) - 0.5).to("cuda", dtype),
              (torch.rand(Em, Hm, F, generator=gen) - 0.5).to("cuda", dtype),
              (torch.rand(Rm, generator=gen) + 0.1).to("cuda", dtype)]
    params = [p.requires_grad_() for p in params]
    static_counts = torch.tensor([30, 0, 90, 20], dtype=torch.int32, device="cuda")
    static_g = (torch.rand(Rm, Hm, generator=gen) - 0.5).to("cuda", dtype)

    def step():
        for p in params:
            p.grad = None
        y = expert_mlp(*params[:3], static_counts, params[3], gated=True)
        y.backward(static_g)
        return y.detach()

    graph, static_y = capture_with_output(step)
    # two GEMMs with a rounded activation between them (as test_experts_gpu.py allows)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for counts in ([30, 0, 90, 20], [0, 150, 0, 9], [1, 1, 1, 1]):
        n = sum(counts)
        with torch.no_grad():
            static_counts.copy_(torch.tensor(counts, dtype=torch.int32))
            params[0].copy_(_poison_past((tokens(Rm, Hm, gen, dtype) / Rm).cuda(), n))
        graph.replay()
        torch.cuda.synchronize()
        ref = [p.detach().double().requires_grad_() for p in params]
        yr = expert_mlp(*ref[:3], torch.tensor(counts, device="cuda"), ref[3], gated=True,
                        impl="loop")
        got = torch.autograd.grad(yr[:n], ref, static_g[:n].double())
        torch.testing.assert_close(static_y[:n].double(), yr[:n].detach(), **tol)
        torch.testing.assert_close(params[0].grad[:n].double(), got[0][:n], **tol)
        for p, want in zip(params[1:3], got[1:3]):
            torch.testing.assert_close(p.grad.double(), want, **tol)
        torch.testing.assert_close(params[3].grad[:n].double(), got[3][:n], **tol)


def test_auto_prepares_triton_only_where_the_native_op_cannot_be_captured(gen):
    """An eager "auto" call compiles the Triton kernels for fp16/fp32 (and bf16 with rows
    the native op cannot take), not for aligned bf16 where torch._grouped_mm is captured."""
    w = (torch.rand(3, 48, 32, generator=gen) - 0.5).cuda()
    for dtype in (torch.float16, torch.float32):
        x = tokens(20, 32, gen, dtype).cuda()
        resolve_impl(x, w.to(dtype))
        assert tg.ready(x, w.to(dtype)), dtype
    x = tokens(20, 32, gen, torch.bfloat16).cuda()
    _, native_captured = prepare_experts(x.device, torch.bfloat16)
    resolve_impl(x, w.bfloat16())
    assert tg.ready(x, w.bfloat16()) != native_captured
    odd = tokens(20, 33, gen, torch.bfloat16).cuda()      # 66-byte rows: not the native path
    w_odd = (torch.rand(3, 48, 33, generator=gen) - 0.5).to("cuda", torch.bfloat16)
    resolve_impl(odd, w_odd)
    assert tg.ready(odd, w_odd)


def test_unprepared_signature_under_capture(gen, monkeypatch):
    """Inside a capture, a weight shape no eager call prepared: impl="triton" raises
    CaptureError before launching (a kernel load would break the capture); "auto" falls back
    to the masked product and warns."""
    monkeypatch.setattr(experts, "_warned_masked", set())
    x = (tokens(24, 40, gen, torch.float16) / 24).cuda()
    w = (torch.rand(2, 72, 40, generator=gen) - 0.5).to("cuda", torch.float16)
    counts = torch.tensor([10, 14], dtype=torch.int32, device="cuda")
    assert not tg.ready(x, w)
    prepare_experts(x.device, x.dtype)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match="not compiled before this CUDA graph capture"):
        with torch.cuda.graph(graph):
            grouped_mm(x, w, counts, impl="triton")
    del graph
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph):
            picked = resolve_impl(x, w)
            y = grouped_mm(x, w, counts)
    assert picked == "masked"
    assert any("masked dense fallback" in str(c.message) for c in caught)
    graph.replay()
    torch.testing.assert_close(y[:24], grouped_mm(x, w, counts, impl="loop")[:24],
                               rtol=2e-3, atol=2e-3)


def _compiled_count() -> int:
    """Kernels Triton has compiled for our two sources, over every device and signature."""
    kernels = tg._kernels(False)
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps its compiled kernels elsewhere (no device_caches)")
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prepare_compiles_what_the_capture_launches(gen, dtype):
    """prepare() (run by an eager "auto" call) compiles exactly the signatures the captured
    forward and both gradients launch: the capture compiles nothing (loading a module inside
    a capture is not permitted), for an x of any row count and a grad from autograd."""
    x = (tokens(77, 40, gen, dtype) / 77).cuda().requires_grad_()
    w = (torch.rand(3, 56, 40, generator=gen) - 0.5).to("cuda", dtype).requires_grad_()
    counts = torch.tensor([30, 0, 41], dtype=torch.int32, device="cuda")
    assert tg.prepare(x.new_empty(0, 8), w)            # another width, no rows: same kernels
    before = _compiled_count()

    def step():
        x.grad = w.grad = None
        grouped_mm(x, w, counts, impl="triton").backward(torch.ones(77, 56, device="cuda",
                                                                   dtype=dtype))

    capture_with_output(step, warmup=0)
    assert _compiled_count() == before
