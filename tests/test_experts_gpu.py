"""The fused count-aware expert activation kernels on the GPU against the reference backend.

Elementwise results and the per-row router-weight dot are compared exactly: the kernels and
graphstash/reference/experts.py perform the same rounded operations in the same order (NOTE
[expert activation arithmetic], NOTE [row dot order]), both on the GPU here.
"""
from __future__ import annotations

import pytest
import torch

from graphstash.moe import ExpertActivation, expert_mlp

from _moe_data import tokens

pytestmark = pytest.mark.gpu
EXACT = dict(atol=0, rtol=0)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _ops():
    from graphstash._kernels import experts as cupy_ops
    from graphstash.reference import experts as ref_ops

    return cupy_ops, ref_ops


def _poisoned(shape, dtype):
    return [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("ffn", [5, 64, 200, 768])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_kernels_match_reference_exactly(gen, dtype, gated, ffn, zero_tail):
    """Forward and backward, weighted and not, 8-element packs (ffn % 8 == 0) and element
    loads (ffn=5, and an offset view that breaks the pack alignment); rows past the live count
    stay poisoned (NaN) unless zero_tail asks for zeros."""
    cupy_ops, ref_ops = _ops()
    R, live_rows = 37, 29
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    width = 2 * ffn if gated else ffn
    base = (torch.randn(R, width + 1, generator=gen, dtype=torch.float64) * 3).to("cuda", dtype)
    for pre in (base[:, :width].contiguous(), base.view(-1)[1:1 + R * width].view(R, width)):
        live = torch.tensor([live_rows], dtype=torch.int64, device="cuda")
        rw = (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1).to("cuda", dtype)
        grad_out = torch.randn(R, ffn, generator=gen, dtype=torch.float64).to("cuda", dtype)
        for w in (rw, None):
            outs = _poisoned((R, ffn), dtype)
            cupy_ops.act_forward(outs[0], pre, w, live, gated=gated, zero_tail=zero_tail)
            ref_ops.act_forward(outs[1], pre, w, live, gated=gated, zero_tail=zero_tail)
            torch.testing.assert_close(outs[0], outs[1], equal_nan=True, **EXACT)
            assert not outs[0][:live_rows].isnan().any()
            tail = outs[0][live_rows:]
            assert (tail == 0).all() if zero_tail else tail.isnan().all()

            grads = _poisoned((R, width), dtype)
            rows = [torch.full((R,), float("nan"), dtype=acc, device="cuda") for _ in range(2)]
            cupy_ops.act_backward(grads[0], rows[0], grad_out, pre, w, live, gated=gated,
                                  zero_tail=zero_tail)
            ref_ops.act_backward(grads[1], rows[1], grad_out, pre, w, live, gated=gated,
                                 zero_tail=zero_tail)
            torch.testing.assert_close(grads[0], grads[1], equal_nan=True, **EXACT)
            torch.testing.assert_close(rows[0], rows[1], equal_nan=True, **EXACT)
            assert not grads[0][:live_rows].isnan().any()
            assert (grads[0][live_rows:] == 0).all() if zero_tail else grads[0][live_rows:].isnan().all()

            # write_act: the same gradients, and the forward's output over grad_out (the
            # tail poisoned, so untouched rows show)
            overwritten = [grad_out.clone() for _ in range(2)]
            for o in overwritten:
                o[live_rows:] = float("nan")
            again = _poisoned((R, width), dtype)
            cupy_ops.act_backward(again[0], None, overwritten[0], pre, w, live, gated=gated,
                                  zero_tail=zero_tail, write_act=True)
            ref_ops.act_backward(again[1], None, overwritten[1], pre, w, live, gated=gated,
                                 zero_tail=zero_tail, write_act=True)
            torch.testing.assert_close(again[0], grads[0], equal_nan=True, **EXACT)
            torch.testing.assert_close(again[1], grads[1], equal_nan=True, **EXACT)
            torch.testing.assert_close(overwritten[0], outs[0], equal_nan=True, **EXACT)
            torch.testing.assert_close(overwritten[1], outs[1], equal_nan=True, **EXACT)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so -0.0 and 0.0 differ)."""
    return t.view(_BITS[t.element_size()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("ffn", [5, 64])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_silu_kernels_equal_the_generic_kernels_bit_for_bit(gen, monkeypatch, dtype, gated, ffn,
                                                            zero_tail):
    """NOTE [plain SiLU kernels]: SiLU and SwiGLU with the default constants and no bias run
    gs_expert_silu_*, whose arithmetic is the generic kernels' GS_ACT_SILU without the clamp,
    cap, offset and bias steps; every output (forward, grad_pre, grad_row, the forward's
    output written over grad_out) has the same bits as the generic kernels', weighted and
    not, packed (ffn=64) and element by element (ffn=5), with values whose exp overflows.
    Outputs start at a finite sentinel, so the rows past the count compare too."""
    from graphstash._kernels import experts as launcher

    cupy_ops, _ = _ops()
    R, live_rows = 37, 29
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    width = 2 * ffn if gated else ffn
    pre = torch.randn(R, width, generator=gen, dtype=torch.float64) * 3
    every_7th = (pre.numel() + 6) // 7          # exp(100) overflows float: silu(-100) is -0.0
    specials = torch.tensor([-100.0, 100.0, 0.0, -0.0, -30.0, 30.0], dtype=torch.float64)
    pre.view(-1)[::7] = specials.repeat(every_7th)[:every_7th]
    pre = pre.to("cuda", dtype)
    live = torch.tensor([live_rows], dtype=torch.int64, device="cuda")
    rw = (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1).to("cuda", dtype)
    grad_out = torch.randn(R, ffn, generator=gen, dtype=torch.float64).to("cuda", dtype)
    kw = dict(gated=gated, zero_tail=zero_tail)

    def run(plain: bool, w: torch.Tensor | None) -> list[torch.Tensor]:
        monkeypatch.setattr(launcher, "PLAIN_SILU", plain)
        act = ExpertActivation()
        for way, tensors in (("fwd", (pre,)), ("bwd", (pre, pre))):
            name = launcher._variant(way, pre, gated, False, ffn, act, None, *tensors)
            assert name.startswith(f"gs_expert_{'silu' if plain else 'act'}_{way}_"), name
        out = torch.full((R, ffn), 7.0, dtype=dtype, device="cuda")
        cupy_ops.act_forward(out, pre, w, live, **kw)
        grads = [torch.full((R, width), 7.0, dtype=dtype, device="cuda") for _ in range(2)]
        row = torch.full((R,), 7.0, dtype=acc, device="cuda")
        act_out = grad_out.clone()
        cupy_ops.act_backward(grads[0], row, act_out, pre, w, live, write_act=True, **kw)
        cupy_ops.act_backward(grads[1], None, grad_out, pre, w, live, **kw)
        return [out, grads[0], row, act_out, grads[1]]

    for w in (rw, None):
        plain, generic = run(True, w), run(False, w)
        for name, a, b in zip(("out", "grad_pre", "grad_row", "act_out", "grad_pre (no row)"),
                              plain, generic):
            assert not a[:live_rows].isnan().any(), name
            assert torch.equal(_bits(a), _bits(b)), name
        assert (plain[0][live_rows:] == (0 if zero_tail else 7)).all()
        assert float(plain[0][:live_rows].float().abs().max()) > 0.1


@pytest.mark.parametrize("gated", [False, True])
def test_expert_mlp_gradcheck_fp64_on_gpu(gen, gated):
    R, H, F, E = 14, 5, 7, 3
    counts = torch.tensor([4, 0, 8], dtype=torch.int32, device="cuda")
    x = (tokens(R, H, gen, torch.float64) / R).cuda().requires_grad_()
    w1 = (torch.rand(E, 2 * F if gated else F, H, generator=gen, dtype=torch.float64)
          - 0.5).cuda().requires_grad_()
    w2 = (torch.rand(E, H, F, generator=gen, dtype=torch.float64) - 0.5).cuda().requires_grad_()
    rw = (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1).cuda().requires_grad_()

    def f(x, w1, w2, rw):
        return expert_mlp(x, w1, w2, counts, rw, gated=gated)[:12]

    assert torch.autograd.gradcheck(f, (x, w1, w2, rw))


@pytest.mark.parametrize("gated", [False, True])
def test_expert_backward_holds_one_activation_sized_temporary(gen, gated):
    """NOTE [expert backward temporaries]: above what the forward left alive (the saved
    tensors, the output and its gradient), the backward of expert_mlp allocates one
    [rows, ffn] block (the recomputed activation, then its gradient in the same memory) plus
    the weight gradients and x's gradient; the activation's gradient is written over the
    pre-activation. Before, it held two (plain) or three (gated) such blocks at once."""
    R, H, F, E = 16384, 256, 2048, 4
    dtype = torch.bfloat16
    counts = torch.tensor([5000, 0, 4000, 3000], dtype=torch.int32, device="cuda")
    x = tokens(R, H, gen, torch.float32).to("cuda", dtype).requires_grad_()
    w1 = ((torch.rand(E, 2 * F if gated else F, H, generator=gen) - 0.5) / 16).to(
        "cuda", dtype).requires_grad_()
    w2 = ((torch.rand(E, H, F, generator=gen) - 0.5) / 16).to("cuda", dtype).requires_grad_()
    rw = (torch.rand(R, generator=gen) + 0.1).to("cuda", dtype).requires_grad_()
    y = expert_mlp(x, w1, w2, counts, rw, gated=gated)
    g = torch.randn(R, H, generator=gen).to("cuda", dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(y, (x, w1, w2, rw), g)
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - base
    unit = R * F * x.element_size()                         # one [rows, ffn] block
    others = sum(t.numel() * t.element_size() for t in grads) + R * 4 + (2 << 20)
    assert above <= unit + others, (above / 2**20, unit / 2**20, others / 2**20)
    assert all(t[:12000].isfinite().all() for t in grads)


# Activations whose arithmetic is exp, division, products and comparisons only compare exactly;
# those that call tanhf or erff (GELU, GELU-tanh, the softcaps) compare within 2 ulps of the
# accumulator: torch's CUDA kernels and NVRTC call the CUDA math library's tanhf and erff, but
# torch may be built against another CUDA version than the one NVRTC compiles with (NOTE
# [expert activation arithmetic]).
EXACT_ACTS = [ExpertActivation("silu", gate_limit=1.5, up_limit=2.0),
              ExpertActivation("glu_alpha", alpha=1.702, gate_limit=1.5, up_limit=1.5,
                               up_offset=1.0),
              ExpertActivation("relu"), ExpertActivation("relu2")]
MATH_ACTS = [ExpertActivation("gelu"), ExpertActivation("gelu_tanh"),
             ExpertActivation("softcap_silu", gate_cap=2.0, up_cap=3.0)]


def _close(got, want, exact: bool) -> None:
    """Equal (exact), or within 2 ulps of the stored dtype relative to the values' scale."""
    if exact:
        torch.testing.assert_close(got, want, equal_nan=True, **EXACT)
        return
    eps = torch.finfo(want.dtype).eps
    scale = float(want.nan_to_num().abs().max())
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2 * eps, atol=2 * eps * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["plain", "gated", "interleaved"])
@pytest.mark.parametrize("act", EXACT_ACTS + MATH_ACTS,
                         ids=lambda a: f"{a.kind}-{a.gate_limit}-{a.up_cap}")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("ffn", [5, 64])
def test_activation_kinds_layouts_and_bias_match_reference(gen, dtype, layout, act, with_bias,
                                                           ffn):
    """Every activation kind, with clamps, caps and the offset on up, plain, gated and
    interleaved, with and without the first GEMM's per-expert bias, packed (ffn=64) and
    element by element (ffn=5): forward, backward (router-weight dot, write_act) against the
    reference on the GPU; rows past the live count stay poisoned."""
    cupy_ops, ref_ops = _ops()
    gated, interleaved = layout != "plain", layout == "interleaved"
    R, live_rows, E = 37, 29, 4
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    width = 2 * ffn if gated else ffn
    pre = (torch.randn(R, width, generator=gen, dtype=torch.float64) * 3).to("cuda", dtype)
    live = torch.tensor([live_rows], dtype=torch.int64, device="cuda")
    ends = torch.tensor([7, 7, 20, live_rows], dtype=torch.int64, device="cuda")
    bias = ((torch.randn(E, width, generator=gen, dtype=torch.float64)).to("cuda", dtype)
            if with_bias else None)
    rw = (torch.rand(R, generator=gen, dtype=torch.float64) + 0.1).to("cuda", dtype)
    grad_out = torch.randn(R, ffn, generator=gen, dtype=torch.float64).to("cuda", dtype)
    kw = dict(gated=gated, activation=act.kind, constants=act.constants(),
              interleaved=interleaved, bias=bias, ends=ends if with_bias else None)
    exact = act in EXACT_ACTS
    outs = _poisoned((R, ffn), dtype)
    cupy_ops.act_forward(outs[0], pre, rw, live, **kw)
    ref_ops.act_forward(outs[1], pre, rw, live, **kw)
    _close(outs[0], outs[1], exact)
    assert not outs[0][:live_rows].isnan().any() and outs[0][live_rows:].isnan().all()
    assert float(outs[1][:live_rows].float().abs().max()) > 0.1
    grads = _poisoned((R, width), dtype)
    rows = [torch.full((R,), float("nan"), dtype=acc, device="cuda") for _ in range(2)]
    acts = [grad_out.clone() for _ in range(2)]
    cupy_ops.act_backward(grads[0], rows[0], acts[0], pre, rw, live, write_act=True, **kw)
    ref_ops.act_backward(grads[1], rows[1], acts[1], pre, rw, live, write_act=True, **kw)
    _close(grads[0], grads[1], exact)
    _close(rows[0], rows[1], exact)
    # write_act writes the forward's activation over the live rows and leaves the rest as given
    torch.testing.assert_close(acts[0][:live_rows], outs[0][:live_rows], **EXACT)
    assert torch.equal(acts[0][live_rows:], grad_out[live_rows:])
    _close(acts[0], acts[1], exact)
    assert float(grads[1][:live_rows].float().abs().max()) > 0.1
    assert grads[0][live_rows:].isnan().all()


@pytest.mark.parametrize("interleaved", [False, True])
def test_gpt_oss_layout_expert_mlp_gradcheck_fp64_on_gpu(gen, interleaved):
    """Transposed weights as views, both biases, the clamped GLU: gradcheck on the GPU."""
    R, H, F, E = 14, 5, 4, 3
    counts = torch.tensor([4, 0, 8], dtype=torch.int32, device="cuda")
    act = ExpertActivation("glu_alpha", alpha=1.702, gate_limit=0.4, up_limit=0.4,
                           up_offset=1.0)
    f64 = dict(dtype=torch.float64, device="cuda")
    x = (torch.rand(R, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
         - 0.5).cuda().requires_grad_()
    w1t = (torch.rand(E, H, 2 * F, **f64) - 0.5).requires_grad_()
    w2t = (torch.rand(E, F, H, **f64) - 0.5).requires_grad_()
    b1 = (torch.rand(E, 2 * F, **f64) - 0.5).requires_grad_()
    b2 = (torch.rand(E, H, **f64) - 0.5).requires_grad_()
    rw = (torch.rand(R, **f64) + 0.1).requires_grad_()

    def f(x, w1t, w2t, b1, b2, rw):
        return expert_mlp(x, w1t.transpose(1, 2), w2t.transpose(1, 2), counts, rw, gated=True,
                          activation=act, interleaved=interleaved, bias1=b1, bias2=b2)[:12]

    assert torch.autograd.gradcheck(f, (x, w1t, w2t, b1, b2, rw))
