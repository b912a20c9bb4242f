"""Model-level gradient checks of the MoE path, written once: the tests run them, and
``tests/test_checks_can_fail.py`` runs them again under a test-only fault (``_faults.py``) to
prove they fail when a backward is wrong.

Every check uses a loss that reaches every parameter (a fixed random projection of the output,
``_grad_checks.py``), asserts the reference gradients far from zero and compares each gradient
against its own magnitude. ``fault``/``faulty``: a :class:`_faults.Fault` armed only while the
named side runs its forward and backward (so that the two sides of a comparison differ);
``None``: no fault.
"""
from __future__ import annotations

import warnings

import torch

import graphstash
from graphstash import _layout as L
from graphstash.models import MoEConfig, MoEModel

from _grad_checks import assert_grads_close, named_grads, projected_loss, projection
from _moe_data import tokens


def _status():
    return torch.zeros(L.STATUS_SIZE, dtype=torch.int32)


def _arm(fault, side, faulty) -> None:
    if fault is not None:
        fault.armed = side == faulty


def plain_peer_check(gen, gated: bool, mode: str = "dropless", *, fault=None,
                     faulty=None) -> None:
    """graphstash's MoE path in ``mode`` ("dropless" or "budget") equals the peer (plain
    PyTorch: sort, histc, grouped GEMM over T*K rows, index_add_): outputs, the input's and
    every parameter's gradient, 1e-4 of each gradient's largest magnitude (float32: the two
    sum in different orders, and the router's gradient, a sum over tokens with cancellation,
    measured 1.2e-5 of its largest magnitude on a 16-core CPU). The peer shares no kernel
    with graphstash, so a wrong graphstash backward shows here."""
    config = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=2, num_tokens=40,
                       gated=gated, capacity_factor=4.0)
    x = tokens(40, 16, gen) / 40
    proj = projection((40, 16), gen)
    out, grads = {}, {}
    for side in ("plain", mode):
        _arm(fault, side, faulty)
        model = MoEModel(config, mode=side, seed=7)
        xi = x.clone().requires_grad_()
        out[side] = model(xi)
        projected_loss(out[side], proj).backward()
        grads[side] = named_grads(model, x=xi.grad)
    _arm(fault, None, faulty)
    torch.testing.assert_close(out[mode], out["plain"], rtol=1e-5, atol=1e-6)
    assert_grads_close(grads[mode], grads["plain"], rel=1e-4)


def budget_dropless_check(gen, attention: bool, *, fault=None, faulty=None) -> None:
    """A budget-mode model with room for every row equals the dropless one: outputs and
    every parameter's gradient, 1e-5 of each gradient's largest magnitude; no flag raised."""
    config = MoEConfig(hidden=32, ffn=48, num_experts=4, topk=2, layers=2, num_tokens=64,
                       capacity_factor=4.0, pad_multiple=4, attention=attention, seq_len=16)
    x = tokens(config.num_tokens, config.hidden, gen) / config.num_tokens
    proj = projection((config.num_tokens, config.hidden), gen)
    outs, grads = {}, {}
    for mode in ("dropless", "budget"):
        _arm(fault, mode, faulty)
        status = _status()
        model = MoEModel(config, mode=mode, status=status, seed=3)
        outs[mode] = model(x)
        projected_loss(outs[mode], proj).backward()
        grads[mode] = named_grads(model)
        assert int(status[L.SS_OVER_BUDGET]) == 0
    _arm(fault, None, faulty)
    torch.testing.assert_close(outs["budget"], outs["dropless"])
    assert_grads_close(grads["budget"], grads["dropless"], rel=1e-5)


def stash_budget_check(gen, *, fault=None, faulty=None) -> None:
    """Stash mode (the experts' saved tensors paged out and reloaded for backward) equals
    budget mode over two steps (the second on measured sizes): outputs and every gradient,
    1e-5 of each gradient's largest magnitude; the pool never overflows and something was
    stashed."""
    from graphstash.stash import StashConfig, StashManager

    config = MoEConfig(hidden=64, ffn=64, num_experts=4, topk=2, layers=2, num_tokens=64,
                       capacity_factor=4.0, pad_multiple=4)
    xs = [tokens(config.num_tokens, config.hidden, gen, offset=50 * step) / config.num_tokens
          for step in range(2)]
    projs = [projection((config.num_tokens, config.hidden), gen) for _ in range(2)]
    results = {}
    for mode in ("budget", "stash"):
        _arm(fault, mode, faulty)
        manager = None
        if mode == "stash":
            manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4096),
                                   device=torch.device("cpu"))
        model = MoEModel(config, mode=mode, stash_manager=manager, seed=5)
        per_step = []
        for x, proj in zip(xs, projs):
            if manager is not None:
                manager.begin_step()
                with manager:
                    y = model(x)
                    projected_loss(y, proj).backward()
                manager.end_step()
                assert not manager.read_status()["overflow"]
            else:
                y = model(x)
                projected_loss(y, proj).backward()
            per_step.append((y.detach(), named_grads(model)))
            model.zero_grad(set_to_none=True)
        if manager is not None:
            buffers = manager.read_status()["buffers"].values()
            assert any(b["peak_pages"] > 0 for b in buffers), "nothing was stashed"
        results[mode] = per_step
    _arm(fault, None, faulty)
    for (ya, ga), (yb, gb) in zip(results["stash"], results["budget"]):
        torch.testing.assert_close(ya, yb)
        assert_grads_close(ga, gb, rel=1e-5)


def graph_step_eager_check(gen, *, steps: int = 3, fault=None, faulty=None) -> None:
    """``graph_step`` training of a budget-mode model equals a plain eager loop of a dropless
    one from the same state (AdamW, float32, CPU: graph_step runs its eager path): the loss
    and every gradient of each step, 1e-5 of each gradient's largest magnitude, and the
    parameters after each update. ``faulty="graph"`` arms ``fault`` inside the decorated
    step only."""
    config = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=2, num_tokens=40,
                       capacity_factor=4.0, gated=True)
    graphed = MoEModel(config, mode="budget", seed=11)
    eager = MoEModel(config, mode="dropless", seed=12)
    eager.load_state_dict(graphed.state_dict())
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    proj = projection((config.num_tokens, config.hidden), gen)

    def step(x):
        _arm(fault, "graph", faulty)
        try:
            loss = projected_loss(graphed(x), proj)
            loss.backward()
        finally:
            _arm(fault, None, faulty)
        return loss.detach()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # "runs eagerly without a CUDA graph"
        train_step = graphstash.graph_step(step, optimizer=opt_g, warmup=1, device="cpu")
        for i in range(steps):
            x = tokens(config.num_tokens, config.hidden, gen, offset=40 * i) / config.num_tokens
            loss_g = train_step(x)
            opt_e.zero_grad(set_to_none=True)
            loss_e = projected_loss(eager(x), proj)
            loss_e.backward()
            want = named_grads(eager)
            opt_e.step()
            torch.testing.assert_close(loss_g, loss_e.detach(), rtol=1e-5, atol=1e-5)
            assert_grads_close(named_grads(graphed), want, rel=1e-5)
            for (name, a), b in zip(graphed.named_parameters(), eager.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert train_step.stats.over_budget == 0
