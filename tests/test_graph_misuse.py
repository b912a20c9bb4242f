"""CPU tests of @graph_step under misuse: a step function that updates by itself, failures
around a rerun's update, bad arguments, and the GPU contract checked on the CPU."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphstash
from graphstash import _layout as L
from graphstash.errors import UpdateAppliedError
from graphstash.graph import GraphStep, graph_step

WIDTH = 8


class FlagNet(torch.nn.Module):
    """Two linear layers; a forward given ``marker`` 1 raises the overflow flag in ``status``
    and poisons its activations with NaN (as an overflowed stash leaves garbage), except when
    it runs dropless. ``fail`` makes the next forward of the given kind raise."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(WIDTH, WIDTH)
        self.l2 = torch.nn.Linear(WIDTH, WIDTH)
        self.fail = None                  # None, "first" (the normal run) or "rerun" (dropless)

    @property
    def status(self):
        """The running step's status tensor (NOTE [current step]), or None outside a step."""
        owner = graphstash.status.current()
        return None if owner is None else owner.tensor

    def forward(self, x, marker):
        dropless = graphstash.is_dropless()
        if self.fail == ("rerun" if dropless else "first"):
            self.fail = None
            raise RuntimeError(f"injected failure in the {'rerun' if dropless else 'first run'}")
        h = torch.relu(self.l1(x))
        if not dropless and self.status is not None:
            s = self.status[L.SS_OVERFLOW: L.SS_OVERFLOW + 1]
            s.copy_(torch.maximum(s, marker))
            h = h + torch.where(marker.bool(), float("nan"), 0.0)
        return self.l2(h)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _pair(seed):
    torch.manual_seed(seed)
    model = FlagNet()
    ref = copy.deepcopy(model)
    return model, _sgd(model.parameters()), ref, _sgd(ref.parameters())


def _batch(gen, flagged=False):
    x = torch.randn(4, WIDTH, generator=gen)
    y = torch.randn(4, WIDTH, generator=gen)
    return x, y, torch.tensor([int(flagged)], dtype=torch.int32)


def _eager_update(ref, ref_opt, x, y):
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(ref(x, torch.zeros(1, dtype=torch.int32)), y).backward()
    ref_opt.step()


def _same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _count_updates(opt) -> list:
    """A one-element list counting ``opt.step()`` calls that completed."""
    count = [0]
    opt.register_step_post_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


@contextlib.contextmanager
def _quiet():
    """Silence the CPU fallback's RuntimeWarnings (tested in test_graph.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# ---- item 1: the step function must not call optimizer.step() ------------------------------
@pytest.mark.parametrize("warmup", [0, 2])
def test_step_function_calling_optimizer_step_is_refused(gen, warmup):
    model, opt, ref, ref_opt = _pair(1)
    x, y, m = _batch(gen)

    @graph_step(optimizer=opt, device="cpu", warmup=warmup)
    def train_step(x, y, marker):
        torch.nn.functional.mse_loss(model(x, marker), y).backward()
        opt.step()                     # what every eager loop does

    with _quiet(), pytest.raises(ValueError, match=r"fn: .*owns optimizer\.step\(\)"):
        train_step(x, y, m)
    assert _same_params(model, ref)                    # nothing applied, not even once
    assert train_step.stats.steps == 0 and not opt.state


def test_optimizer_step_outside_the_step_function_still_works(gen):
    """The refusal only covers the step function: the optimizer stays usable elsewhere."""
    model, opt, ref, ref_opt = _pair(2)
    x, y, m = _batch(gen)
    train_step = GraphStep(lambda *a: torch.nn.functional.mse_loss(model(*a[:1], a[2]),
                                                                   a[1]).backward(),
                           optimizer=opt, device="cpu")
    with _quiet():
        train_step(x, y, m)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x, m), y).backward()
    opt.step()
    _eager_update(ref, ref_opt, x, y)
    _eager_update(ref, ref_opt, x, y)
    assert _same_params(model, ref)


# ---- item 2: budget_growth and the rerun's update ------------------------------------------
@pytest.mark.parametrize("growth", [float("nan"), float("inf"), 1.0, 0.5, -2.0])
def test_budget_growth_must_be_finite_above_one(growth):
    with pytest.raises(ValueError, match=r"budget_growth: expected a finite number > 1"):
        GraphStep(lambda: None, budget_growth=growth)
    with pytest.raises(TypeError, match="budget_growth"):
        GraphStep(lambda: None, budget_growth=True)


def test_on_overflow_raising_after_the_update_says_it_was_applied(gen):
    model, opt, ref, ref_opt = _pair(3)
    updates = _count_updates(opt)
    calls = []

    def on_overflow(flags):
        calls.append(flags)
        raise KeyError("dispatch budget table is full")

    @graph_step(optimizer=opt, device="cpu", on_overflow=on_overflow)
    def train_step(x, y, marker):
        loss = torch.nn.functional.mse_loss(model(x, marker), y)
        loss.backward()
        return loss

    x, y, m = _batch(gen, flagged=True)
    with _quiet(), pytest.raises(UpdateAppliedError, match="update was already applied") as info:
        train_step(x, y, m)
    assert isinstance(info.value.__cause__, KeyError)
    _eager_update(ref, ref_opt, x, y)
    assert _same_params(model, ref) and updates[0] == 1
    assert train_step.stats.steps == 1 and len(calls) == 1
    x, y, m = _batch(gen)                 # the next step goes on normally
    with _quiet():
        train_step(x, y, m)
    _eager_update(ref, ref_opt, x, y)
    assert _same_params(model, ref) and updates[0] == train_step.stats.steps == 2


def test_on_overflow_interrupted_keeps_its_type_and_counts_the_step(gen):
    model, opt, ref, ref_opt = _pair(4)

    def on_overflow(flags):
        raise KeyboardInterrupt

    train_step = GraphStep(
        lambda x, y, m: torch.nn.functional.mse_loss(model(x, m), y).backward(),
        optimizer=opt, device="cpu", on_overflow=on_overflow)
    x, y, m = _batch(gen, flagged=True)
    with _quiet(), pytest.raises(KeyboardInterrupt) as info:
        train_step(x, y, m)
    assert any("already applied" in note for note in info.value.__notes__)
    _eager_update(ref, ref_opt, x, y)
    assert _same_params(model, ref) and train_step.stats.steps == 1


def test_budget_growth_failing_leaves_the_update_unapplied(gen, monkeypatch):
    """Growing the stash reallocates and may fail: it runs before the rerun's update, so a
    failure there applies nothing and counts nothing, and the batch can be retried."""
    stash = pytest.importorskip("graphstash.stash")
    model, opt, ref, ref_opt = _pair(5)
    config = stash.StashConfig(page_size=4, device_factor=1.0, min_tensor_bytes=0,
                               backend="reference")

    @graph_step(optimizer=opt, device="cpu", stash=config)
    def train_step(x, y, marker):
        torch.nn.functional.mse_loss(model(x, marker), y).backward()

    with _quiet():
        manager = train_step.stash_manager

    def no_memory():
        raise torch.OutOfMemoryError("out of memory (injected)")

    monkeypatch.setattr(manager, "size_from_demand", no_memory)
    x, y, m = _batch(gen, flagged=True)
    with _quiet(), pytest.raises(torch.OutOfMemoryError):
        train_step(x, y, m)
    assert _same_params(model, ref) and train_step.stats.steps == 0 and not opt.state
    monkeypatch.undo()
    with _quiet():
        train_step(x, y, m)                # the retry applies it, once
    _eager_update(ref, ref_opt, x, y)
    assert _same_params(model, ref) and train_step.stats.steps == 1


# ---- the acceptance property ---------------------------------------------------------------
_OP = st.sampled_from(["good", "overflow", "overflow_raising_callback", "fail_first_run",
                       "fail_rerun", "overflow_interrupted", "calls_optimizer_step"])


def _run_property(ops, seed, warmup):
    model, opt, ref, ref_opt = _pair(seed)
    updates = _count_updates(opt)
    gen = torch.Generator().manual_seed(seed)
    callback = {"raise": None}
    misuse = {"step": False}

    def on_overflow(flags):
        exc, callback["raise"] = callback["raise"], None
        if exc is not None:
            raise exc

    @graph_step(optimizer=opt, device="cpu", warmup=warmup, on_overflow=on_overflow)
    def train_step(x, y, marker):
        loss = torch.nn.functional.mse_loss(model(x, marker), y)
        loss.backward()
        if misuse["step"]:
            opt.step()
        return loss

    applied = 0
    for op in ops:
        x, y, m = _batch(gen, flagged=op not in ("good", "fail_first_run",
                                                 "calls_optimizer_step"))
        model.fail = {"fail_first_run": "first", "fail_rerun": "rerun"}.get(op)
        misuse["step"] = op == "calls_optimizer_step"
        if op == "overflow_raising_callback":
            callback["raise"] = ValueError("callback failed")
        elif op == "overflow_interrupted":
            callback["raise"] = KeyboardInterrupt()
        try:
            train_step(x, y, m)
            raised = None
        except (RuntimeError, ValueError, KeyboardInterrupt) as exc:
            raised = exc
        if op.startswith("fail"):
            assert isinstance(raised, RuntimeError) and "injected" in str(raised)
        elif op == "calls_optimizer_step":
            assert isinstance(raised, ValueError) and "owns optimizer.step()" in str(raised)
        elif op == "overflow_raising_callback":
            assert isinstance(raised, UpdateAppliedError)
        elif op == "overflow_interrupted":
            assert isinstance(raised, KeyboardInterrupt)
        else:
            assert raised is None
        if not op.startswith("fail") and op != "calls_optimizer_step":   # applied, once
            _eager_update(ref, ref_opt, x, y)
            applied += 1
        assert updates[0] == train_step.stats.steps == applied, (op, updates[0], applied)
        assert _same_params(model, ref), op


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=1, max_size=8), seed=st.integers(0, 2**16), warmup=st.integers(0, 2))
def test_updates_equal_steps_and_eager_under_random_misuse(ops, seed, warmup):
    with _quiet():
        _run_property(ops, seed, warmup)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=1, max_size=30), seed=st.integers(0, 2**16),
       warmup=st.integers(0, 3))
def test_updates_equal_steps_and_eager_under_random_misuse_long(ops, seed, warmup):
    with _quiet():
        _run_property(ops, seed, warmup)


# ---- item 5: a stash that can hold nothing --------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(host_tier=False), dict(host_factor=0.0),
                                    dict(host_tier=False, host_factor=2.0)])
def test_stash_config_refuses_zero_device_factor_without_host_tier(kwargs):
    stash = pytest.importorskip("graphstash.stash")
    with pytest.raises(ValueError, match="device_factor: expected a float > 0"):
        stash.StashConfig(device_factor=0, **kwargs)
    stash.StashConfig(device_factor=0, host_factor=1.0)      # a host-only stash is fine


def test_host_only_stash_grows_its_host_tier_after_overflow(gen):
    stash = pytest.importorskip("graphstash.stash")
    torch.manual_seed(6)
    layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
    opt = torch.optim.SGD(layers.parameters(), lr=0.01)
    tokens = torch.tensor([64], dtype=torch.int32)
    config = stash.StashConfig(page_size=8, device_factor=0.0, host_factor=0.3,
                               min_tensor_bytes=0, backend="reference")

    @graph_step(optimizer=opt, device="cpu", warmup=1, stash=config)
    def train_step(x, y):
        h = x
        for i, layer in enumerate(layers):
            with stash.stash_activations(tokens, name=f"layer{i}"):
                h = torch.relu(layer(h))
        torch.nn.functional.mse_loss(h, y).backward()

    with _quiet():
        for _ in range(8):
            train_step(torch.randn(64, 16, generator=gen), torch.randn(64, 16, generator=gen))
    st_ = train_step.stats
    # 0.3, 0.45, 0.675 of the demand overflow; 1.0125 holds it: every later step fits
    assert (st_.overflows, st_.steps) == (3, 8)
    grown = train_step.stash_manager.config          # a new config: the one passed is kept
    assert grown.device_factor == 0 and grown.host_factor == pytest.approx(0.3 * 1.5 ** 3)
    assert config.host_factor == 0.3


# ---- item 9: arguments named in the error ---------------------------------------------------
@pytest.mark.parametrize("device, error", [("meta", ValueError), ("bogus", ValueError),
                                           ("cuda:x", ValueError), (1.5, TypeError)])
def test_device_argument_is_named(device, error):
    with pytest.raises(error, match=r"device: expected 'cpu', 'cuda'"):
        GraphStep(lambda: None, device=device)


def test_parameters_on_meta_are_named():
    w = torch.nn.Parameter(torch.empty(3, device="meta"))
    step = GraphStep(lambda: None, optimizer=torch.optim.SGD([w], lr=0.1))
    with pytest.raises(ValueError, match="device: the optimizer's parameters are on meta"):
        step()


def test_lbfgs_is_refused_naming_the_optimizer():
    w = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="optimizer: LBFGS .*closure"):
        GraphStep(lambda: None, optimizer=torch.optim.LBFGS([w]))


# ---- item 10: the GPU contract, checked on the CPU ------------------------------------------
def test_cpu_refuses_new_shapes_after_warmup_as_the_gpu_does(gen):
    w = torch.nn.Parameter(torch.randn(WIDTH, generator=gen))
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x):
        (w * x).sum().backward()

    train_step = GraphStep(step, optimizer=opt, device="cpu", warmup=1)
    with _quiet():
        train_step(torch.randn(3, WIDTH, generator=gen))   # warmup: any shape (as on the GPU)
        train_step(torch.randn(4, WIDTH, generator=gen))   # the call that would capture
        train_step(torch.randn(4, WIDTH, generator=gen))
        with pytest.raises(ValueError, match=r"args\[0\].*captured for.*\(4, 8\).*"
                                             r"on_new_shape='recapture'"):
            train_step(torch.randn(5, WIDTH, generator=gen))
    assert train_step.stats.steps == 3
    relaxed = GraphStep(step, optimizer=opt, device="cpu", warmup=1, on_new_shape="recapture")
    with _quiet():
        for rows in (3, 4, 5):
            relaxed(torch.randn(rows, WIDTH, generator=gen))
    assert relaxed.stats.steps == 3


@pytest.mark.parametrize("make, warmup, expect", [
    (lambda p: torch.optim.AdamW(p, lr=1e-3), 2, "capturable=False"),
    (lambda p: torch.optim.Adagrad(p, lr=1e-3), 2, "no capturable option"),
    (lambda p: torch.optim.SGD(p, lr=1e-3), 0, "warmup: the optimizer has no state"),
])
def test_cpu_warns_once_about_what_a_gpu_run_would_refuse(gen, make, warmup, expect):
    w = torch.nn.Parameter(torch.randn(WIDTH, generator=gen))
    opt = make([w])
    train_step = GraphStep(lambda x: (w * x).sum().backward(), optimizer=opt, device="cpu",
                           warmup=warmup)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(warmup + 3):
            train_step(torch.randn(WIDTH, generator=gen))
    refused = [str(c.message) for c in caught if "would be refused" in str(c.message)]
    assert len(refused) == 1 and expect in refused[0], refused
    assert train_step.stats.steps == warmup + 3


def test_cpu_capturable_optimizer_gets_no_contract_warning(gen):
    w = torch.nn.Parameter(torch.randn(WIDTH, generator=gen))
    train_step = GraphStep(lambda x: (w * x).sum().backward(),
                           optimizer=torch.optim.SGD([w], lr=0.1), device="cpu", warmup=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            train_step(torch.randn(WIDTH, generator=gen))
    assert not [c for c in caught if "would be refused" in str(c.message)]


# ---- issue 27.4: steps that never ran ---------------------------------------------------------
def _gen_step(x):
    yield (x * 2).sum()


async def _async_step(x):
    return (x * 2).sum()


async def _async_gen_step(x):
    yield (x * 2).sum()


class _GeneratorCall:
    def __call__(self, x):
        yield x


@pytest.mark.parametrize("fn, what", [
    (_gen_step, "a generator function"), (_async_step, "an async function"),
    (_async_gen_step, "an async generator function"), (_GeneratorCall(), "a generator function"),
    (__import__("functools").partial(_gen_step), "a generator function")])
def test_generator_and_async_steps_are_refused_when_decorated(fn, what):
    with pytest.raises(TypeError, match=f"fn: .* is {what}: calling it returns before its body "
                                        "runs"):
        graph_step(fn, device="cpu")
    with pytest.raises(TypeError, match=f"is {what}"):
        GraphStep(fn, device="cpu")


@pytest.mark.parametrize("warmup", [0, 2])
@pytest.mark.parametrize("make", [lambda x: _gen_step(x), lambda x: _async_step(x)],
                         ids=["generator", "coroutine"])
def test_step_returning_a_generator_is_refused_with_nothing_counted(gen, warmup, make):
    """A plain callable that hides a generator or coroutine is refused at its first call, before
    any update: nothing applied, nothing counted, no "never awaited" warning."""
    w = torch.nn.Parameter(torch.randn(WIDTH, generator=gen))
    opt = torch.optim.SGD([w], lr=0.1)
    train_step = GraphStep(lambda x: make(w * x), optimizer=opt, device="cpu", warmup=warmup)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match=r"fn: .* returned a (generator|coroutine) instead of "
                                            r"running: its body .* never ran"):
            train_step(torch.randn(WIDTH, generator=gen))
    assert not [c for c in caught if "never awaited" in str(c.message)]
    st_ = train_step.stats
    assert (st_.steps, st_.eager_steps) == (0, 0) and not opt.state and w.grad is None


def test_memory_profile_refuses_steps_that_never_run(gen):
    from graphstash import memory

    x = torch.randn(64, 64, generator=gen)
    with pytest.raises(TypeError, match="step_fn: expected a function that runs the step when "
                                        "called, got a generator function"):
        memory.profile(_gen_step, x)
    with pytest.raises(TypeError, match="got an async function"):
        memory.profile(_async_step, x)
    with pytest.raises(TypeError, match="step_fn: returned a generator instead of running"):
        memory.profile(lambda x: _gen_step(x), x)


# ---- issue 27.5: a failing first call does not fix the signature -----------------------------
def test_a_failing_first_call_does_not_fix_the_signature(gen):
    """The issue's sequence: warmup on (4, 8), a call on (6, 8) that raises, then (4, 8): it
    runs (nothing was captured for (6, 8)), and from then on (6, 8) is the new shape."""
    w = torch.nn.Parameter(torch.randn(WIDTH, generator=gen))
    opt = torch.optim.SGD([w], lr=0.1)

    def step(x):
        if x.shape[0] == 6 and not seen:
            seen.append(x.shape)
            raise RuntimeError("injected failure on the first (6, 8) call")
        (w * x).sum().backward()

    seen = []
    train_step = GraphStep(step, optimizer=opt, device="cpu", warmup=1)
    with _quiet():
        train_step(torch.randn(4, WIDTH, generator=gen))            # warmup
        with pytest.raises(RuntimeError, match="injected"):
            train_step(torch.randn(6, WIDTH, generator=gen))        # would capture: fails
        assert train_step.stats.steps == 1
        train_step(torch.randn(4, WIDTH, generator=gen))            # captures (4, 8)
        with pytest.raises(ValueError, match=r"args\[0\].*captured for.*\(4, 8\).*\(6, 8\)"):
            train_step(torch.randn(6, WIDTH, generator=gen))
    assert train_step.stats.steps == 2


# ---- issue 27, unclear errors: graph_step twice, nested steps, generators= ------------------
def test_graph_step_applied_twice_says_so(gen):
    model, opt, _, _ = _pair(7)
    inner = graph_step(lambda x, y, m: None, optimizer=opt, device="cpu")
    with pytest.raises(TypeError, match=r"fn: .* is already a GraphStep; graph_step was applied "
                                        r"twice"):
        graph_step(inner, optimizer=opt)
    with pytest.raises(TypeError, match="already a GraphStep"):
        graph_step(optimizer=opt, device="cpu")(inner)


def test_a_step_called_inside_another_step_is_refused(gen):
    model, opt, ref, _ = _pair(8)
    x, y, m = _batch(gen)

    @graph_step(optimizer=opt, device="cpu")
    def inner(x, y, marker):
        torch.nn.functional.mse_loss(model(x, marker), y).backward()

    outer = GraphStep(lambda *a: inner(*a), optimizer=torch.optim.SGD(ref.parameters(), lr=0.1),
                      device="cpu")
    with _quiet(), pytest.raises(ValueError, match=r"fn: .* called .*inner, another graph_step "
                                                   r"step, from inside its step function; steps "
                                                   r"cannot nest"):
        outer(x, y, m)
    assert inner.stats.steps == 0 and outer.stats.steps == 0 and not opt.state


@pytest.mark.parametrize("value, match", [
    (5, r"generators: expected a list or tuple of torch\.Generator .*got int"),
    ("cuda", r"generators: expected a list or tuple .*got str"),
    ([torch.Generator(), 5], r"generators\[1\]: expected a torch\.Generator, got int"),
    ({"g": 1}, r"generators: expected .*got dict")])
def test_generators_argument_is_checked(value, match):
    with pytest.raises(TypeError, match=match):
        graph_step(generators=value)
    with pytest.raises(TypeError, match=match):
        GraphStep(lambda: None, generators=value)


def test_one_generator_is_accepted_as_a_tuple():
    g = torch.Generator()
    assert GraphStep(lambda: None, generators=g).options.generators == (g,)
    assert GraphStep(lambda: None, generators=[g]).options.generators == (g,)


# ---- issue 25: the options written once -------------------------------------------------------
def test_options_are_one_dataclass_with_the_public_keywords():
    import dataclasses
    import inspect

    from graphstash.graph import StepOptions

    fields = {f.name: f.default for f in dataclasses.fields(StepOptions)}
    assert len(fields) == 16
    for fn in (graph_step, GraphStep):
        params = inspect.signature(fn).parameters
        assert list(params) == ["fn", *fields]
        assert all(params[k].default == v for k, v in fields.items())
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in fields)
    opts = GraphStep(lambda: None, warmup=3).options
    assert isinstance(opts, StepOptions) and opts.warmup == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.warmup = 4
    with pytest.raises(TypeError, match=r"graph_step: unexpected keyword argument\(s\) "
                                        r"\['warmpu'\]"):
        graph_step(warmpu=3)
    with pytest.raises(ValueError, match="max_graphs: expected an int >= 1"):
        StepOptions(max_graphs=0)
