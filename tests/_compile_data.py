"""Helpers of the torch.compile tests (CPU and GPU): operator checks, pool tensors, explain."""
from __future__ import annotations

import torch

from graphstash import _layout as L
from graphstash._kernels import experts as kernel_experts
from graphstash._kernels import moe as kernel_moe
from graphstash.models import MoEConfig, MoEModel

from _moe_data import tokens

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def opcheck(entry, args, kwargs=None) -> None:
    """``torch.library.opcheck`` of a graphstash operator entry point; every check passes."""
    result = torch.library.opcheck(entry.op, args, kwargs or {}, test_utils=OPCHECK_TESTS)
    assert result == {name: "SUCCESS" for name in OPCHECK_TESTS}


def opcheck_moe_operators(gen, dtype, device="cpu", M=23, N=17, K=3, H=16) -> None:
    """opcheck of gather_rows, combine_rows (with and without weights) and weight_grad on
    fresh routing-shaped data; outputs start as 7s (a row left unwritten shows)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    src = tokens(M, H, gen, dtype).to(device)
    index = torch.randint(-1, M, (N,), generator=gen, dtype=torch.int32).to(device)
    index2 = torch.randint(-1, M, (N, K), generator=gen, dtype=torch.int32).to(device)
    weight = torch.rand(N, K, generator=gen, dtype=torch.float64).to(device, acc)
    grad = tokens(N, H, gen, dtype, offset=100).to(device)
    full = dict(dtype=dtype, device=device)
    opcheck(kernel_moe.gather_rows, (torch.full((N, H), 7, **full), src, index))
    for w in (weight, None):
        opcheck(kernel_moe.combine_rows, (torch.full((N, H), 7, **full), src, index2, w))
    opcheck(kernel_moe.weight_grad, (torch.full((N * K,), 7, dtype=acc, device=device), grad,
                                     src, index2))


def opcheck_expert_operators(gen, dtype, gated, device="cpu", rows=21, ffn=16) -> None:
    """opcheck of act_forward and act_backward (with and without router weights and the
    router-weight gradient) on fresh pre-activations, ``live`` inside the rows."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    width = 2 * ffn if gated else ffn
    pre = (torch.randn(rows, width, generator=gen, dtype=torch.float64) * 2).to(device, dtype)
    row_weight = torch.rand(rows, generator=gen, dtype=torch.float64).to(device, dtype)
    grad_out = torch.randn(rows, ffn, generator=gen, dtype=torch.float64).to(device, dtype)
    live = torch.randint(1, rows, (1,), generator=gen).to(device)
    for weight in (row_weight, None):
        for zero_tail in (False, True):
            flags = dict(gated=gated, zero_tail=zero_tail)
            opcheck(kernel_experts.act_forward,
                    (torch.full((rows, ffn), 7, dtype=dtype, device=device), pre, weight, live),
                    flags)
            grad_row = (torch.full((rows,), 7, dtype=acc, device=device)
                        if weight is not None else None)
            opcheck(kernel_experts.act_backward,
                    (torch.full((rows, width), 7, dtype=dtype, device=device), grad_row,
                     grad_out, pre, weight, live), flags)


def pool_tensors(gen, num_dev, num_host, page_rows, row_bytes, device="cpu", entries=256):
    """The tensors of a fresh paged pool: pages hold random bytes (a page read before it is
    written shows), rings hand out ids in order, the host tier is pinned on CUDA."""
    page_bytes = page_rows * row_bytes
    state = torch.zeros(L.STATE_SIZE, dtype=torch.int64)
    state[L.ST_DEV_TAIL], state[L.ST_HOST_TAIL] = num_dev, num_host
    host_pages = torch.randint(0, 256, (num_host, page_bytes), generator=gen, dtype=torch.uint8)
    if torch.device(device).type == "cuda":
        host_pages = host_pages.pin_memory()
    return dict(
        dev_pages=torch.randint(0, 256, (num_dev, page_bytes), generator=gen,
                                dtype=torch.uint8).to(device),
        host_pages=host_pages,
        dev_ring=torch.arange(num_dev, dtype=torch.int32, device=device),
        host_ring=torch.arange(num_dev, num_dev + num_host, dtype=torch.int32, device=device),
        state=state.to(device), status=torch.zeros(L.STATUS_SIZE, dtype=torch.int32,
                                                   device=device),
        table=torch.zeros(entries, dtype=torch.int32, device=device))


def stash_args(pool, src, counts, page_rows, offset) -> tuple:
    """Arguments of ``graphstash._kernels.paged_stash.stash`` for ``pool_tensors``."""
    p = pool
    return (src, counts, p["dev_pages"], p["host_pages"], p["dev_ring"], p["host_ring"],
            p["state"], p["status"], p["table"], page_rows, offset)


def reload_args(pool, dst, page_rows, offset, zero_tail) -> tuple:
    """Arguments of ``graphstash._kernels.paged_stash.reload`` for ``pool_tensors``."""
    p = pool
    return (dst, p["dev_pages"], p["host_pages"], p["dev_ring"], p["host_ring"], p["state"],
            p["table"], page_rows, offset, zero_tail)


def explain(fn, *args, **kwargs):
    """``(graphs, graph breaks, break reasons, graphstash operators in the graphs)``."""
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = [b.reason.splitlines()[0] for b in explanation.break_reasons]
    ops = set()
    for graph in explanation.graphs:        # autograd Functions are nested graph modules
        for module in graph.modules():
            if isinstance(module, torch.fx.GraphModule):
                ops |= {str(n.target) for n in module.graph.nodes
                        if n.op == "call_function" and str(n.target).startswith("graphstash.")}
    return explanation.graph_count, explanation.graph_break_count, reasons, ops


def budget_model(gated: bool, *, hidden=32, ffn=48, seed=0, device="cpu",
                 dtype=torch.float32) -> MoEModel:
    """A one-block budget-mode MoEModel (4 experts, top-2)."""
    config = MoEConfig(hidden=hidden, ffn=ffn, num_experts=4, topk=2, layers=1,
                       num_tokens=24, gated=gated)
    return MoEModel(config, mode="budget", seed=seed).to(device, dtype)


def assert_close_scaled(got, want, tol, what=""):
    """``max |got - want| <= tol * max(1, max |want|)``: one tolerance for tensors of any
    magnitude (gradients summed over tokens included)."""
    err = (got.double() - want.double()).abs().max().item()
    scale = max(1.0, want.double().abs().max().item())
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def assert_close_norm(got, want, tol, what=""):
    """``||got - want|| <= tol * ||want||``: the norm-relative error, the check for bf16 runs
    whose roundings differ (a few elements may differ by more than ``tol`` of the largest)."""
    err = (got.double() - want.double()).norm().item()
    scale = want.double().norm().item()
    assert err <= tol * max(scale, 1e-30), f"{what}: relative error {err / max(scale, 1e-30):.3g} > {tol}"


def compare_compiled(gen, gated, backend, *, steps=2, device="cpu", dtype=torch.float32,
                     hidden=32, ffn=48, tokens_per_step=24, tol=1e-5, grad_tol=1e-4,
                     check=assert_close_scaled):
    """A compiled budget-mode model (fullgraph: any graph break fails) against an eager one
    from the same state_dict, over ``steps`` steps: outputs, input and parameter gradients."""
    eager = budget_model(gated, hidden=hidden, ffn=ffn, seed=3, device=device, dtype=dtype)
    compiled_model = budget_model(gated, hidden=hidden, ffn=ffn, seed=4, device=device,
                                  dtype=dtype)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    for step in range(steps):
        x = tokens(tokens_per_step, hidden, gen, offset=100 * step).to(device, dtype)
        x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_e, y_c = eager(x_e), compiled(x_c)
        check(y_c, y_e, tol, f"step {step} output")
        y_e.float().pow(2).sum().backward()
        y_c.float().pow(2).sum().backward()
        check(x_c.grad, x_e.grad, grad_tol, f"step {step} x.grad")
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            check(q.grad, p.grad, grad_tol, f"step {step} {name}.grad")
