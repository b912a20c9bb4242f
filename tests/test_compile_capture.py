"""graph_step over torch.compile'd code, on the CPU (NOTE [compile and capture] in
graphstash/graph/compile_guard.py).

Without CUDA graph_step runs every call eagerly, but from the call that would capture on it
runs the step as the capture would: a compile there raises the CaptureError the capture would
(NOTE [same contract on the CPU]). So these tests check on the CPU what the GPU tests check
with real captures: the compiled code does not recompile between the last warmup call and the
"captured" calls, whenever it was compiled (an eval pass, a train pass, another shape, an
earlier graph_step, inside the warmup), with and without a stash, for the reference model and
a HuggingFace model on the graphstash experts backend. ``aot_eager`` (dynamo's guards and
AOTAutograd's saved tensors, without Inductor's code generation) keeps them fast; the GPU twin
(test_compile_capture_gpu.py) uses Inductor.
"""
from __future__ import annotations

import dataclasses

import threading
import warnings

import pytest
import torch

import graphstash
from graphstash.errors import CaptureError
from graphstash.graph import compile_guard
from graphstash.models import MoEConfig, MoEModel

CONFIG = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=1, num_tokens=40,
                   capacity_factor=2.0, gated=True)
# tiny tensors: stash every saved tensor in pages of 8 rows (the "auto" plan would step aside)
STASH = dict(min_tensor_bytes=0, page_size=8, policy="always")
STEPS = 4
LR = 0.1


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)    # "runs eagerly without a CUDA graph"
        yield
    torch._dynamo.reset()


class CountingBackend:
    """``aot_eager`` that counts the graphs it compiles (a recompile is one more)."""

    def __init__(self):
        self.graphs = 0
        self._inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self._inner(graph_module, example_inputs)


def _inputs(gen, n=STEPS, tokens=CONFIG.num_tokens):
    """Fresh random tokens per step, and a fixed random projection: a loss that reaches every
    parameter (the model ends in an RMSNorm, whose mean square is constant)."""
    xs = [torch.randn(tokens, CONFIG.hidden, generator=gen) for _ in range(n)]
    proj = torch.randn(tokens, CONFIG.hidden, generator=gen)
    return xs, proj


def _eager_losses(model, xs, proj, lr=LR):
    """The control: the same model uncompiled, trained by a plain eager loop."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for x in xs:
        opt.zero_grad(set_to_none=True)
        loss = (model(x).float() * proj).sum()
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), first_grads


def _compile_before(compiled, how: str, gen, stash_manager=None):
    """Run ``compiled`` once outside the step the way a training loop would."""
    if how == "eval":
        with torch.no_grad():
            compiled(torch.randn(CONFIG.num_tokens, CONFIG.hidden, generator=gen))
    elif how in ("train", "shape"):
        tokens = CONFIG.num_tokens if how == "train" else CONFIG.num_tokens // 2
        compiled(torch.randn(tokens, CONFIG.hidden, generator=gen)).sum().backward()
        for p in compiled.parameters():
            p.grad = None


def _moe_case(gen, mode: str, before: str, warmup: int = 2, config: MoEConfig = CONFIG,
              lr: float = LR):
    seed = int(torch.randint(1 << 20, (1,), generator=gen))
    model = MoEModel(config, mode=mode, seed=seed)
    control = MoEModel(config, mode=mode, seed=seed)
    control.load_state_dict(model.state_dict())
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    stash = graphstash.StashConfig(**STASH) if mode == "stash" else None
    if mode == "stash" and before in ("eval", "train", "shape"):
        with graphstash.StashManager(graphstash.StashConfig(**STASH), device="cpu"):
            _compile_before(compiled, before, gen)
    else:
        _compile_before(compiled, before, gen)
    if before == "earlier_step":
        opt0 = torch.optim.SGD(model.parameters(), lr=0.0)    # changes nothing
        earlier = graphstash.graph_step(
            lambda x: compiled(x).sum().backward(), optimizer=opt0, warmup=1, stash=stash)
        for _ in range(2):
            earlier(torch.randn(CONFIG.num_tokens, CONFIG.hidden, generator=gen))
        earlier.release()
    xs, proj = _inputs(gen)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def train_step(x):
        loss = (compiled(x).float() * proj).sum()
        loss.backward()
        return loss

    step = graphstash.graph_step(train_step, optimizer=opt, warmup=warmup, stash=stash)
    losses = []
    for i, x in enumerate(xs):
        losses.append(step(x))
        if i == warmup - 1:
            graphs_after_warmup = backend.graphs
    assert backend.graphs == graphs_after_warmup, "compiled after the warmup"
    assert step.stats.steps == STEPS
    want, first_grads = _eager_losses(control, xs, proj, lr)
    assert min(float(g.abs().max()) for g in first_grads) > 1e-3     # the loss reaches them
    torch.testing.assert_close(torch.stack(losses), want, rtol=1e-5, atol=1e-5)
    for (name, got), ref in zip(model.named_parameters(), control.parameters()):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)
    return step, backend


@pytest.mark.slow
@pytest.mark.parametrize("mode,before", [
    (mode, before) for mode in ("budget", "stash")
    for before in ("inside", "eval", "train", "shape", "earlier_step")])
def test_compiled_model_does_not_compile_after_the_warmup(gen, mode, before):
    """Compiled before graph_step (an eval pass, a train pass, another shape, an earlier
    graph_step) or inside its warmup: every compile happens in the warmup calls, the calls that
    would capture run under the refusal and equal eager training."""
    _moe_case(gen, mode, before)


def test_stash_sized_after_a_single_warmup_call_is_invisible_to_compiled_code(gen):
    """warmup=1 with a stash: the warmup call measures (no buffer exists, every group keeps
    its tensors), the next call sizes the pool and stashes for the first time. The stash
    machinery runs untraced (NOTE [untraced machinery]), so that change compiles nothing.
    Traced, its first stash was a frame compiled at that call (measured on the code before)."""
    two = dataclasses.replace(CONFIG, layers=2)    # the first layer's group is stashed
    # a smaller step: at 0.1 the rounding of the compiled graph flips a token's expert within
    # four steps of two layers with the stash's hooks in place (stashing or not), and the
    # comparison would measure that flip
    step, _ = _moe_case(gen, "stash", "inside", warmup=1, config=two, lr=0.01)
    assert [r["stashed"] for r in step.stash_manager.plan()] == [True, False]
    assert step.stash_manager.read_status()["buffers"]      # it did stash


def test_a_recompile_after_the_warmup_is_refused_naming_the_guard(gen):
    settings = {"scale": 2.0}
    weight = torch.nn.Parameter(torch.randn(8, 8, generator=gen))

    def scaled(x):
        return (x @ weight) * settings["scale"]

    compiled = torch.compile(scaled, backend="aot_eager")
    opt = torch.optim.SGD([weight], lr=LR)
    step = graphstash.graph_step(lambda x: compiled(x).pow(2).sum().backward(), optimizer=opt,
                                 warmup=2)
    x = torch.randn(4, 8, generator=gen)
    for _ in range(3):
        step(x)
    settings["scale"] = 3.0                 # Python state the compiled code reads changes
    before = weight.detach().clone()
    with pytest.raises(CaptureError) as info:
        step(x)
    assert info.value.cause == "compile"
    message = str(info.value)
    assert "would fail to capture on a CUDA device" in message
    assert "scaled" in message and "recompiled inside the capture" in message
    assert "guard that failed" in message and "scale" in message
    assert torch.equal(weight, before) and step.stats.steps == 3    # nothing applied
    settings["scale"] = 2.0
    step(x)                                 # back to the warmup's value: runs
    assert step.stats.steps == 4


@pytest.mark.slow
def test_a_new_shape_runs_one_eager_call_before_its_capture(gen):
    """on_new_shape='recapture' with compiled code: the first call of a new signature runs
    eagerly (it may compile: a full step, update applied), the next is the one captured."""
    model = MoEModel(CONFIG, mode="budget", seed=5)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = graphstash.graph_step(lambda x, p: (compiled(x) * p).sum().backward(),
                                 optimizer=opt, warmup=2, on_new_shape="recapture")
    xs, proj = _inputs(gen)
    for x in xs:
        step(x, proj)
    graphs = backend.graphs
    half = CONFIG.num_tokens // 2
    small, proj_small = _inputs(gen, n=2, tokens=half)
    step(small[0], proj_small)              # new signature: eager, compiles
    assert backend.graphs > graphs
    graphs = backend.graphs
    step(small[1], proj_small)              # as the capture would: refuses any compile
    assert backend.graphs == graphs
    assert step.stats.steps == STEPS + 2


def test_the_dropless_rerun_runs_uncompiled_and_leaves_the_compiled_code_alone(gen):
    """The rerun of a flagged step runs dropless (host reads, other shapes), eager by design.
    Traced, it broke the graph inside dispatch and dynamo skipped the model's compiled frame
    for good, so the next call compiled the inner functions one by one (refused: measured on
    the code before). It runs uncompiled, and the calls after it compile nothing."""
    model, backend, step, tokens = _over_budget_compiled_step(gen, adapt=False)
    step(tokens())                          # the budget stays too small: every step reruns
    graphs = backend.graphs
    for _ in range(2):
        step(tokens())
    assert step.stats.eager_reruns == 3 and step.stats.steps == 3
    assert backend.graphs == graphs == 1


def _over_budget_compiled_step(gen, *, adapt: bool):
    """A one-block model compiled (counting its graphs) whose budget (capacity factor 0.5)
    every step goes over, its graph_step (warmup 1), and a maker of its input tokens."""
    config = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=1, num_tokens=40,
                       capacity_factor=0.5, gated=True)
    model = MoEModel(config, mode="budget", seed=3)
    model.budgets.adapt = adapt
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    proj = torch.randn(config.num_tokens, config.hidden, generator=gen)
    step = graphstash.graph_step(lambda x: (compiled(x) * proj).sum().backward(),
                                 optimizer=opt, warmup=1)
    return model, backend, step, lambda: torch.randn(config.num_tokens, config.hidden,
                                                     generator=gen)


def test_a_grown_budget_recompiles_once_in_an_eager_call(gen):
    """The budget grows after the first over-budget step (NOTE [adaptive budgets]); the
    compiled model recompiles for it once, in the eager call graph_step runs before the next
    capture (NOTE [budgets the step adapts]), and nothing reruns or compiles after that."""
    model, backend, step, tokens = _over_budget_compiled_step(gen, adapt=True)
    for _ in range(6):
        step(tokens())
    assert step.stats.eager_reruns == 1 and step.stats.steps == 6, step.stats
    assert model.budgets.factor("blocks.0") > 0.5
    assert backend.graphs == 2            # the warmup's, and the grown budget's
    # the traced steps' needs are judged against the grown budget, not the one before
    layer = model.budgets.stats()[0]
    assert (layer["over_budget"], layer["grows"], layer["capped"]) == (1, 1, 0), layer


@pytest.mark.slow
def test_hf_model_on_the_graphstash_backend_with_a_stash(gen):
    """A tiny OLMoE (graphstash experts backend, ``torch.compile(model)``) under graph_step
    with a stash manager: nothing compiles after the warmup, losses and weights equal the same
    model trained uncompiled."""
    pytest.importorskip("transformers", reason="needs transformers (the hf / dev extra)")
    import graphstash.integrations.transformers as gst

    from _hf_models import batch, seed_of, tiny_model, twin

    ref = tiny_model("olmoe", seed_of(gen))
    models = []
    for _ in range(2):
        model = twin(ref, gst.IMPLEMENTATION)
        gst.configure(model, stash=True)
        models.append(model)
    ours, control = models
    backend = CountingBackend()
    compiled = torch.compile(ours, backend=backend)
    batches = [batch(gen) for _ in range(STEPS)]

    def train(model, **kwargs):
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def train_step(ids):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss

        step = graphstash.graph_step(train_step, optimizer=opt, warmup=2,
                                     stash=graphstash.StashConfig(**STASH), **kwargs)
        losses = []
        for i, ids in enumerate(batches):
            losses.append(step(ids))
            if i == 1:
                graphs = backend.graphs
        return step, torch.stack(losses), graphs

    step, losses, graphs = train(compiled)
    assert backend.graphs == graphs, "compiled after the warmup"
    names = {entry[2] for entry in step.stash_manager.schedule}
    assert names == {f"model.layers.{i}.mlp.experts" for i in range(2)}, names
    _, want, _ = train(control)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(ours.named_parameters(), control.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_state_read_by_traced_code_holds_no_first_use_guard():
    """In a fresh thread, compiled code that asks for the running mode, the current status
    and the current stash manager compiles once, though a step, a manager and the mode come
    and go between its calls: no attribute appears after the first call (NOTE [state read by
    traced code]). Created on first use, each put a hasattr guard on it that failed at the
    second call."""
    from graphstash import status as status_module
    from graphstash.stash import current_manager

    backend = CountingBackend()

    def reads_state(x):
        scale = 2.0 if graphstash.is_dropless() else 1.0
        if status_module.current(x.device) is not None:
            scale += 1.0
        if current_manager() is not None:
            scale += 2.0
        return x * scale

    compiled = torch.compile(reads_state, backend=backend)
    errors = []

    def run():
        try:
            x = torch.ones(3)
            for _ in range(3):
                torch.testing.assert_close(compiled(x), x)
                # a step, a stash manager and the mode come and go between the calls
                with status_module.StepStatus("cpu").activate(), graphstash.dropless(False):
                    with graphstash.StashManager(device="cpu"):
                        pass
        except BaseException as exc:        # noqa: BLE001 - reported in the main thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors
    assert backend.graphs == 1


def test_untraced_code_puts_no_guard_on_what_it_reads():
    from graphstash._untraced import untraced

    settings = {"scale": 2.0}

    @untraced
    def scale_of() -> torch.Tensor:         # what it reads stays out of the guards
        return torch.full((), settings["scale"])

    backend = CountingBackend()
    compiled = torch.compile(lambda x: x * 3 + scale_of(), backend=backend)
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), torch.full((2,), 5.0))
    settings["scale"] = 4.0
    with compile_guard.refusing_compiles():
        torch.testing.assert_close(compiled(x), torch.full((2,), 7.0))
    assert backend.graphs >= 1


def test_eager_signatures_ask_for_an_eager_call_only_with_compiled_code(monkeypatch):
    seen = compile_guard.EagerSignatures()
    monkeypatch.setattr(compile_guard, "compile_in_use", lambda: False)
    assert not seen.needs_eager_call(("a",))
    monkeypatch.setattr(compile_guard, "compile_in_use", lambda: True)
    assert seen.needs_eager_call(("a",))
    seen.ran(("a",))
    assert not seen.needs_eager_call(("a",)) and seen.needs_eager_call(("b",))


def test_compile_in_use_after_a_compile():
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))
    assert compile_guard.compile_in_use()


def test_stash_manager_warmup_before_a_capture_runs():
    """graph_step calls StashManager.warmup() before every capture with a stash; after the
    manager was split it read an attribute that had moved (every GPU capture with a stash
    failed with AttributeError)."""
    manager = graphstash.StashManager(graphstash.StashConfig(**STASH), device="cpu")
    manager.warmup()
