"""The expert activations of NOTE [expert activations] on the reference backend: every kind,
gated (concatenated or interleaved) or plain, with clamps, caps, an offset on up and a
per-expert bias, against autograd through the plain torch formula (float64); and the expert
MLP with biases and transposed weights against a per-expert loop."""
from __future__ import annotations

import math

import pytest
import torch

from graphstash.moe import ExpertActivation, expert_mlp
from graphstash.reference import experts as ref
from graphstash.reference.activation import KINDS

ACTS = [ExpertActivation(k) for k in KINDS if k != "softcap_silu"] + [
    ExpertActivation("softcap_silu", gate_cap=3.0, up_cap=5.0),
    ExpertActivation("glu_alpha", alpha=1.702, gate_limit=1.5, up_limit=1.0, up_offset=1.0),
    ExpertActivation("silu", gate_limit=0.5, up_limit=0.7),
]


def _formula(g, u, act: ExpertActivation):
    """The activation written plainly (autograd differentiates it)."""
    if not math.isinf(act.gate_limit):
        g = g.clamp(max=act.gate_limit)
    f = {"silu": lambda: torch.nn.functional.silu(g),
         "glu_alpha": lambda: g * torch.sigmoid(act.alpha * g),
         "softcap_silu": lambda: act.gate_cap * torch.tanh(g / act.gate_cap) * torch.sigmoid(g),
         "gelu": lambda: torch.nn.functional.gelu(g),
         "gelu_tanh": lambda: torch.nn.functional.gelu(g, approximate="tanh"),
         "relu": lambda: torch.relu(g),
         "relu2": lambda: torch.relu(g) ** 2}[act.kind]()
    if u is None:
        return f
    if not math.isinf(act.up_limit):
        u = u.clamp(-act.up_limit, act.up_limit)
    if act.up_cap:
        u = act.up_cap * torch.tanh(u / act.up_cap)
    return f * (u + act.up_offset)


@pytest.mark.parametrize("layout", ["plain", "gated", "interleaved"])
@pytest.mark.parametrize("act", ACTS, ids=lambda a: f"{a.kind}-{a.gate_limit}-{a.up_cap}")
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_activation_equals_autograd_of_the_formula(gen, layout, act, with_bias):
    gated = layout != "plain"
    interleaved = layout == "interleaved"
    if not gated and act.up_cap:
        pytest.skip("plain experts have no up projection")
    rows, ffn, experts = 12, 16, 3
    width = 2 * ffn if gated else ffn
    pre = torch.randn(rows, width, generator=gen, dtype=torch.float64) * 2
    weight = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    grad_out = torch.randn(rows, ffn, generator=gen, dtype=torch.float64)
    live = torch.tensor([rows - 3])
    ends = torch.tensor([4, 7, rows - 3])
    bias = (torch.randn(experts, width, generator=gen, dtype=torch.float64)
            if with_bias else None)
    kw = dict(gated=gated, activation=act.kind, constants=act.constants(),
              interleaved=interleaved, bias=bias, ends=ends if with_bias else None)
    out = torch.full((rows, ffn), 7.0, dtype=torch.float64)
    ref.act_forward(out, pre, weight, live, **kw)
    grad_pre = torch.empty_like(pre)
    grad_row = torch.empty(rows, dtype=torch.float64)
    ref.act_backward(grad_pre, grad_row, grad_out.clone(), pre, weight, live, **kw)

    h = pre.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    x = h + bias[ref.expert_of_row(ends, rows)] if with_bias else h
    if not gated:
        g, u = x, None
    elif interleaved:
        g, u = x[:, 0::2], x[:, 1::2]
    else:
        g, u = x[:, :ffn], x[:, ffn:]
    want = _formula(g, u, act) * w.unsqueeze(1)
    want_grad_pre, want_grad_row = torch.autograd.grad(want, (h, w), grad_out)
    n = int(live)
    assert float(want.detach().abs().max()) > 0.1 and float(want_grad_pre.abs().max()) > 0.1
    torch.testing.assert_close(out[:n], want.detach()[:n], rtol=1e-12, atol=1e-12)
    assert (out[n:] == 7.0).all()                             # rows past live untouched
    torch.testing.assert_close(grad_pre[:n], want_grad_pre[:n], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_row[:n], want_grad_row[:n], rtol=1e-10, atol=1e-10)


def _loop_mlp(x, w1, w2, counts, row_weight, act, gated, interleaved, b1, b2):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = x[start:start + n] @ w1[e].t() + b1[e]
        if interleaved:
            g, u = h[:, 0::2], h[:, 1::2]
        else:
            ffn = w2.shape[2]
            g, u = h[:, :ffn], h[:, ffn:]
        a = _formula(g, u if gated else None, act) * row_weight[start:start + n, None]
        out.append(a @ w2[e].t() + row_weight[start:start + n, None] * b2[e])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("interleaved", [False, True])
def test_expert_mlp_with_biases_and_transposed_weights_equals_a_loop(gen, interleaved):
    """GPT-OSS's layout: w1 and w2 stored [E, in, out] and passed as views, both biases, the
    clamped GLU; output and every gradient equal a per-expert loop (float64)."""
    E, hidden, ffn = 3, 8, 6
    counts = torch.tensor([5, 0, 7])
    rows = int(counts.sum())
    act = ExpertActivation("glu_alpha", alpha=1.702, gate_limit=2.0, up_limit=2.0,
                           up_offset=1.0)
    f64 = dict(dtype=torch.float64)
    x = torch.randn(rows, hidden, generator=gen, **f64).requires_grad_()
    w1t = torch.randn(E, hidden, 2 * ffn, generator=gen, **f64).requires_grad_()
    w2t = torch.randn(E, ffn, hidden, generator=gen, **f64).requires_grad_()
    b1 = torch.randn(E, 2 * ffn, generator=gen, **f64).requires_grad_()
    b2 = torch.randn(E, hidden, generator=gen, **f64).requires_grad_()
    rw = (torch.rand(rows, generator=gen, **f64) + 0.5).requires_grad_()
    inputs = (x, w1t, w2t, b1, b2, rw)
    y = expert_mlp(x, w1t.transpose(1, 2), w2t.transpose(1, 2), counts, rw, gated=True,
                   activation=act, interleaved=interleaved, bias1=b1, bias2=b2)
    want = _loop_mlp(x, w1t.transpose(1, 2), w2t.transpose(1, 2), counts, rw, act, True,
                     interleaved, b1, b2)
    proj = torch.randn(want.shape, generator=gen, **f64)
    got_grads = torch.autograd.grad((y * proj).sum(), inputs)
    want_grads = torch.autograd.grad((want * proj).sum(), inputs)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(("x", "w1", "w2", "b1", "b2", "row_weight"), got_grads, want_grads):
        assert float(b.abs().max()) > 0.1, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
        assert a.shape == b.shape and a.is_contiguous() == b.is_contiguous(), name


def test_activation_arguments_are_checked():
    with pytest.raises(ValueError, match="activation: expected a kind in"):
        ExpertActivation.of("swish")
    with pytest.raises(ValueError, match="softcap_silu needs gate_cap > 0"):
        ExpertActivation.of(ExpertActivation("softcap_silu"))
    with pytest.raises(TypeError, match="activation: expected a kind name"):
        ExpertActivation.of(3)
