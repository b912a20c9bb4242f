"""Gradient checks that can fail: a loss that reaches every parameter, reference gradients
asserted far from zero, and errors measured against each gradient's own magnitude.

The reference MoE model ends in an RMSNorm whose weight starts at ones, so the mean square
of its output is constant and the gradients of ``model(x).pow(2).mean()`` are rounding noise
(6e-19 measured in float64): a comparison of those passes whatever the backward computes.
A fixed random projection of the output, ``(out.float() * proj).sum()``, reaches every
parameter (its gradient at the output is ``proj``).

Example::

    proj = projection(out_shape, gen)
    loss = projected_loss(model(x), proj)
    loss.backward()
    want = named_grads(reference_model)          # reference gradients, by name
    assert_far_from_zero(want)
    assert_grads_close(named_grads(model), want, rel=1e-5)
"""
from __future__ import annotations

import torch

# A gradient whose largest magnitude is below this is treated as zero. The projection loss
# gives the tests' models gradients of order 1e-2 and above; the constant loss gave 1e-18.
FLOOR = 1e-4


def projection(shape, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """A fixed random projection for an output of ``shape``: float32 N(0, 1) values drawn
    from ``gen`` on the CPU, moved to ``device``."""
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device)


def projected_loss(out: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """``(out.float() * proj).sum()``: a float32 scalar whose gradient at ``out`` is
    ``proj`` (``out`` any float tensor of ``proj``'s shape and device)."""
    return (out.float() * proj).sum()


def named_grads(model: torch.nn.Module, **extra: torch.Tensor) -> dict:
    """``{name: p.grad}`` of every parameter of ``model`` (clones), plus ``extra`` gradients
    (e.g. ``x=x.grad``) under their keyword names. A parameter without a gradient maps to
    None (:func:`assert_far_from_zero` reports it)."""
    out = {name: None if p.grad is None else p.grad.detach().clone()
           for name, p in model.named_parameters()}
    for name, g in extra.items():
        out[name] = None if g is None else g.detach().clone()
    return out


def max_abs(t: torch.Tensor) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


def assert_far_from_zero(grads: dict, floor: float = FLOOR) -> None:
    """Every gradient in ``{name: grad}`` exists, is finite and its largest magnitude is at
    least ``floor``: a loss that reached what the check compares."""
    for name, g in grads.items():
        assert g is not None, f"{name}: no gradient (the loss does not reach it)"
        assert torch.isfinite(g).all(), f"{name}: non-finite reference gradient"
        assert max_abs(g) >= floor, (f"{name}: reference gradient max |g| = {max_abs(g):.3g} "
                                     f"< {floor}: the loss does not reach it")


def assert_grads_close(got: dict, want: dict, rel: float, *, floor: float = FLOOR) -> None:
    """``max |got - want| <= rel * max |want|`` for every gradient of ``want`` (a dict
    ``{name: tensor}``, :func:`named_grads`), whose reference gradients must be far from zero
    first (:func:`assert_far_from_zero`). ``got`` has the same names."""
    assert_far_from_zero(want, floor)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, w in want.items():
        g = got[name]
        assert g is not None, f"{name}: no gradient"
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        err = (g.double() - w.double()).abs().max().item()
        scale = max_abs(w)
        assert err <= rel * scale, (f"{name}: max error {err:.3g} > {rel} x max |grad| "
                                    f"{scale:.3g}")


def max_rel_error(got: dict, want: dict) -> float:
    """The largest ``max |got - want| / max |want|`` over the gradients of ``want``."""
    return max((got[n].double() - w.double()).abs().max().item() / max(max_abs(w), 1e-300)
               for n, w in want.items())


def max_norm_rel_error(got: dict, want: dict) -> float:
    """The largest ``||got - want|| / ||want||`` over the gradients of ``want``: a whole-tensor
    measure, for comparisons in which single elements may differ by a rounding (bf16)."""
    return max((got[n].double() - w.double()).norm().item() / max(w.double().norm().item(), 1e-300)
               for n, w in want.items())
