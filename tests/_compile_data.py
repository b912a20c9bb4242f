"""Helpers of the torch.compile tests (CPU and GPU): operator checks, pool tensors, explain."""
from __future__ import annotations

import torch

from graphstash import _layout as L
from graphstash._kernels import experts as kernel_experts
from graphstash._kernels import moe as kernel_moe
from graphstash.models import MoEConfig, MoEModel
from graphstash.stash import StashConfig, StashManager

from _grad_checks import (assert_far_from_zero, max_norm_rel_error, max_rel_error, named_grads,
                          projected_loss)
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
            for write_act in (False, True):
                opcheck(kernel_experts.act_backward,
                        (torch.full((rows, width), 7, dtype=dtype, device=device), grad_row,
                         grad_out.clone(), pre, weight, live), {**flags, "write_act": write_act})


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
    """A one-block budget-mode MoEModel (4 experts, top-2) for the trace checks."""
    config = MoEConfig(hidden=hidden, ffn=ffn, num_experts=4, topk=2, layers=1,
                       num_tokens=24, gated=gated)
    return MoEModel(config, mode="budget", seed=seed).to(device, dtype)


# ---- compiled against eager -----------------------------------------------------------------
# NOTE [what compiles in each mode]: budget mode traces whole (fullgraph, no graph break).
# Dropless mode reads its counts back to size its buffers (Tensor.item()), so Dynamo breaks
# the graph there and compiles the pieces between. Stash mode enters
# torch.autograd.graph.saved_tensors_hooks inside each block, which Dynamo does not trace: it
# breaks the graph at the stash context and compiles around it. Every mode's compiled
# gradients equal eager (CPU, aot_eager and Inductor).
MODES = ("budget", "stash", "dropless")
EMPTY_EXPERTS = 2            # the last experts: never routed to
POPULAR_EXPERTS = 2          # the first experts: routed to by most tokens


def compile_config(gated: bool, capacity_factor: float, *, num_tokens: int = 1024,
                   num_experts: int = 8, hidden: int = 32, ffn: int = 48,
                   layers: int = 1) -> MoEConfig:
    """The compiled-vs-eager model: top-2 of ``num_experts``, ``num_tokens`` tokens."""
    return MoEConfig(hidden=hidden, ffn=ffn, num_experts=num_experts, topk=2, layers=layers,
                     num_tokens=num_tokens, capacity_factor=capacity_factor, gated=gated)


def skew_routers_(model: MoEModel, direction: torch.Tensor) -> None:
    """Make the routers send no token to the last :data:`EMPTY_EXPERTS` experts and most to
    the first :data:`POPULAR_EXPERTS`, for tokens shifted along ``direction`` (float32
    ``[hidden]``, unit norm, CPU)."""
    with torch.no_grad():
        for block in model.blocks:
            w = block.router.weight
            d = direction.to(w.device, w.dtype)
            w[-EMPTY_EXPERTS:] = -8 * d
            w[:POPULAR_EXPERTS] += 0.5 * d


def compile_batch(config: MoEConfig, gen, step: int, direction: torch.Tensor):
    """Tokens ``[num_tokens, hidden]`` (float32, CPU) of step ``step``: rows derived from their
    index (``_moe_data.tokens``) plus unit noise, with their component along ``direction``
    set to 3 (so :func:`skew_routers_` decides which experts stay empty); and a fixed random
    projection of the output (the loss)."""
    t = tokens(config.num_tokens, config.hidden, gen, offset=100 * step) / config.num_tokens
    x = t + torch.randn(config.num_tokens, config.hidden, generator=gen)
    x = x + (3 - x @ direction).unsqueeze(1) * direction
    return x, torch.randn(config.num_tokens, config.hidden, generator=gen)


def routing_counts(model: MoEModel, x: torch.Tensor) -> torch.Tensor:
    """Rows per expert (int64 ``[num_experts]``) of the first block's router on ``x``."""
    block = model.blocks[0]
    with torch.no_grad():
        idx, _ = block.route(block.norm(x))
    return torch.bincount(idx.reshape(-1).cpu(), minlength=model.config.num_experts)


class CompiledPair:
    """A model and its compiled twin from the same state, trained step by step on routing
    with empty and popular experts (:func:`skew_routers_`), eager and compiled gradients
    compared after each step.

    ``mode``: the model's MoE path (``"budget"``, ``"stash"``, ``"dropless"`` or ``"plain"``
    for the peer); budget mode compiles with ``fullgraph=True``. ``fault_scale``: a test-only
    fault: when set, the compiled model's first expert weight gradient is scaled by it."""

    def __init__(self, gen, mode: str, gated: bool, capacity_factor: float, backend: str, *,
                 device="cpu", dtype=torch.float32, **sizes):
        self.gen, self.mode, self.device, self.dtype = gen, mode, device, dtype
        self.config = compile_config(gated, capacity_factor, **sizes)
        hidden = self.config.hidden
        self.direction = torch.nn.functional.normalize(torch.randn(hidden, generator=gen), dim=0)
        self.eager = MoEModel(self.config, mode=mode, seed=3).to(device, dtype)
        skew_routers_(self.eager, self.direction)
        self.compiled_model = MoEModel(self.config, mode=mode, seed=4).to(device, dtype)
        self.compiled_model.load_state_dict(self.eager.state_dict())
        self.fault_scale = None
        self.compiled_model.blocks[0].w1.register_hook(
            lambda g: None if self.fault_scale is None else g * self.fault_scale)
        self.managers = {}
        self.compiled = torch.compile(self.compiled_model, backend=backend,
                                      fullgraph=mode == "budget")
        self.steps = 0

    def _run(self, name, fn, x, proj):
        """Forward and backward of ``fn`` on ``x`` (stash mode: inside its own manager)."""
        if self.mode != "stash":
            out = fn(x)
            projected_loss(out, proj).backward()
            return out.detach()
        if name not in self.managers:
            self.managers[name] = StashManager(StashConfig(min_tensor_bytes=0, host_tier=False),
                                               device=torch.device(self.device))
        manager = self.managers[name]
        manager.begin_step()
        with manager:
            out = fn(x)
            projected_loss(out, proj).backward()
        manager.end_step()
        return out.detach()

    def step(self) -> dict:
        """One step of both; ``{"output": e, "grads": e}``, ``e`` the largest
        ``max |compiled - eager| / max |eager|`` in float32, ``||compiled - eager|| /
        ||eager||`` in bf16 (the output; every parameter's and the input's gradient, the eager
        ones asserted far from zero)."""
        x, proj = compile_batch(self.config, self.gen, self.steps, self.direction)
        x, proj = x.to(self.device, self.dtype), proj.to(self.device)
        if self.steps == 0:
            counts = routing_counts(self.eager, x)
            assert (counts[-EMPTY_EXPERTS:] == 0).all(), counts
            assert counts.max() >= 2 * counts.sum() / self.config.num_experts, counts
        self.steps += 1
        x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_e = self._run("eager", self.eager, x_e, proj)
        y_c = self._run("compiled", self.compiled, x_c, proj)
        want = named_grads(self.eager, x=x_e.grad)
        got = named_grads(self.compiled_model, x=x_c.grad)
        assert_far_from_zero(want)
        self.eager.zero_grad(set_to_none=True)
        self.compiled_model.zero_grad(set_to_none=True)
        if self.mode == "stash":
            for manager in self.managers.values():
                buffers = manager.read_status()["buffers"].values()
                assert not any(b["overflow"] for b in buffers)
        # NOTE [compiled-vs-eager tolerances]: float32 element-wise, bf16 norm-relative
        measure = max_rel_error if self.dtype == torch.float32 else max_norm_rel_error
        return {"output": measure({"y": y_c}, {"y": y_e}), "grads": measure(got, want)}


def compiled_errors(gen, mode: str, gated: bool, capacity_factor: float, backend: str, *,
                    steps: int = 2, **kwargs) -> dict:
    """The largest errors of :meth:`CompiledPair.step` over ``steps`` steps."""
    pair = CompiledPair(gen, mode, gated, capacity_factor, backend, **kwargs)
    per_step = [pair.step() for _ in range(steps)]
    return {key: max(e[key] for e in per_step) for key in ("output", "grads")}


# NOTE [compiled-vs-eager tolerances]: float32 compiled gradients equal eager within 1e-4 of
# each gradient's largest magnitude, element by element (measured on the CPU: 4e-7). In bf16
# Inductor keeps in float32 what eager rounds to bf16 (the norms, the router's softmax and
# top-k weights), so neither side is a reference for the other and single elements differ by
# a rounding or two: graphstash's compiled-vs-eager error, norm-relative per tensor (the
# largest over the output and every gradient), must be no worse than the plain-PyTorch peer's
# own on the same model, routing and data, up to one bf16 rounding (2**-8). Element-wise the
# two differ by one or two roundings at the largest magnitude (CPU, budget mode: output 9.1e-3
# against the peer's 4.6e-3), which says nothing about either.
FLOAT32_TOL = 1e-4
BF16_ROUNDING = 2.0 ** -8
FAULT_SCALE = {torch.float32: 1.01, torch.bfloat16: 1.25}


def check_errors(errors: dict, what: str, *, peer: dict | None = None) -> None:
    """float32 (``peer`` None): element-wise errors within :data:`FLOAT32_TOL`; bf16:
    norm-relative errors no worse than the plain peer's own ``peer`` errors plus
    :data:`BF16_ROUNDING` (NOTE [compiled-vs-eager tolerances])."""
    for key in ("output", "grads"):
        bound = FLOAT32_TOL if peer is None else peer[key] + BF16_ROUNDING
        assert errors[key] <= bound, (f"{what} {key}: compiled-vs-eager error {errors[key]:.3g} "
                                      f"> {bound:.3g}"
                                      + ("" if peer is None else " (the plain peer's own + "
                                         "one bf16 rounding)"))


def compare_compiled(gen, mode: str, gated: bool, capacity_factor: float, backend: str, *,
                     dtype=torch.float32, steps: int = 2, fault_check: bool = False,
                     **kwargs) -> dict:
    """Compiled equals eager over ``steps`` steps (NOTE [compiled-vs-eager tolerances]):
    float32 within 1e-4 of each gradient's (and the output's) largest magnitude; bf16 no worse
    than the plain-PyTorch peer's own compiled-vs-eager difference, measured here on the same
    routing. ``fault_check``: one more step with the compiled model's ``w1`` gradient scaled
    (:data:`FAULT_SCALE`, a test-only fault) must then fail the same check. Returns the
    errors (bf16: with the peer's under ``"peer"``)."""
    what = f"{mode}, gated={gated}, capacity {capacity_factor}, {backend}"
    pair = CompiledPair(gen, mode, gated, capacity_factor, backend, dtype=dtype, **kwargs)
    per_step = [pair.step() for _ in range(steps)]
    errors = {key: max(e[key] for e in per_step) for key in ("output", "grads")}
    peer = None
    if dtype != torch.float32:
        peer = compiled_errors(gen, "plain", gated, capacity_factor, backend, dtype=dtype,
                               steps=steps, **kwargs)
        errors["peer"] = peer
    check_errors(errors, what, peer=peer)
    if fault_check:
        pair.fault_scale = FAULT_SCALE[dtype]
        faulty = pair.step()
        try:
            check_errors(faulty, what, peer=peer)
        except AssertionError:
            pass
        else:
            raise AssertionError(f"{what}: a {pair.fault_scale}x w1 gradient went unnoticed "
                                 f"({faulty})")
    return errors
