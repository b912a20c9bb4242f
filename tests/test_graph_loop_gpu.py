"""GPU tests of graph_step in a real training loop: replays compute on each call's batch (every
container kind, the middle of large tensors included), learning-rate schedules replay with one
capture, a checkpoint loaded into the live step resumes exactly, steps that never ran and a
failing first call are refused as on the CPU.

Reference runs are eager loops in the same process with the same seeds. Losses are projections
of the output (``(out * proj).sum()``-style) so gradients reach every parameter; the reference
gradients are checked far from zero. Timings live in benchmarks/probes/scheduled_lr.py.
"""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.optim import lr_scheduler as sched

from graphstash.errors import CaptureError
from graphstash.graph import GraphStep, graph_step

from _batches import KINDS, ROWS, WIDTH
from _batches import make as _make
from _batches import take as _take

pytestmark = pytest.mark.gpu


def _fused_adamw(params, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True, capturable=True)


# ---- every replay computes on its own batch ---------------------------------------------------
def _replay_batches(kind, seed, changes):
    torch.manual_seed(seed)
    model = torch.nn.Linear(WIDTH, WIDTH).cuda()
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model.parameters()), _fused_adamw(ref.parameters())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    proj = torch.randn(ROWS, WIDTH, device="cuda", generator=gen)
    base_a = torch.randn(ROWS, WIDTH, device="cuda", generator=gen)
    base_b = torch.randn(ROWS, WIDTH, device="cuda", generator=gen)

    def loss_of(m, args):
        a, b = _take(kind, args)
        return (m(a) * proj).sum() + 0.5 * (m(b) * proj).sum()

    @graph_step(optimizer=opt, warmup=1)
    def train_step(*args):
        loss = loss_of(model, args)
        loss.backward()
        return loss

    for i, (where, value) in enumerate(changes):
        a, b = base_a.clone(), base_b.clone()
        (a if i % 2 else b).view(-1)[where] = value
        batch = _make(kind, a, b)
        got = train_step(*batch)
        ref_opt.zero_grad()
        want = loss_of(ref, batch)
        want.backward()
        ref_opt.step()
        assert torch.equal(got, want.detach()), f"{kind}, call {i}: {got} != {want} (stale?)"
        assert float(ref.weight.grad.abs().max()) > 1e-3
    st_ = train_step.stats
    assert (st_.captures, st_.replays) == (1, len(changes) - 1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2 ** 16),
       changes=st.lists(st.tuples(st.integers(0, ROWS * WIDTH - 1),
                                  st.floats(-4, 4, allow_nan=False, width=32)),
                        min_size=3, max_size=5))
def test_every_replay_computes_on_its_own_batch(kind, seed, changes):
    _replay_batches(kind, seed, changes)


@pytest.mark.parametrize("kind", KINDS)
def test_replays_see_the_middle_of_large_tensors(kind):
    middle = ROWS * WIDTH // 2
    _replay_batches(kind, 5, [(middle, 3.0), (middle + 1, -3.0), (middle, 1.5), (middle - 7, 2.0)])


def test_numpy_argument_is_refused_at_capture():
    np = pytest.importorskip("numpy")
    w = torch.nn.Parameter(torch.randn(4, device="cuda"))
    train_step = GraphStep(lambda x, a: (w * x).sum().backward(), optimizer=_fused_adamw([w]),
                           warmup=1)
    x = torch.randn(4, device="cuda")
    train_step(x, np.ones(4, dtype=np.float32))
    with pytest.raises(TypeError, match=r"args\[1\]: a numpy\.ndarray cannot be staged"):
        train_step(x, np.ones(4, dtype=np.float32))
    assert train_step.stats.captures == 0 and train_step.stats.steps == 1


# ---- schedules: one capture ---------------------------------------------------------------
STEPS = 100


def _scheduler(name, opt):
    if name == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=STEPS)
    if name == "warmup_then_decay":
        return sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.05, total_iters=10),
                                        sched.CosineAnnealingLR(opt, T_max=STEPS - 10)],
                                  milestones=[10])
    if name == "one_cycle":
        return sched.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS, cycle_momentum=False)
    if name == "lambda":
        return sched.LambdaLR(opt, lambda s: 0.97 ** s)
    raise AssertionError(name)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64)).cuda()


def _loop_data(steps, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(32, 64, device="cuda", generator=g),
             torch.randn(32, 64, device="cuda", generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("make_opt", [_fused_adamw,
                                      lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9,
                                                                fused=True)],
                         ids=["adamw_fused", "sgd_fused"])
@pytest.mark.parametrize("schedule", ["cosine", "warmup_then_decay", "one_cycle", "lambda"])
def test_schedule_replays_with_one_capture(schedule, make_opt):
    """100 steps of a float-lr schedule: one capture, and losses bit for bit those of an eager
    loop whose optimizer is handed each step's lr rounded to float32 (what the kernels read from
    the device tensor, NOTE [scheduled hyperparameters]); within 1e-4 of the plain-float loop."""
    model = _mlp()
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt, plain_opt = (make_opt(m.parameters()) for m in (model, ref, plain))
    scheds = [_scheduler(schedule, o) for o in (opt, ref_opt, plain_opt)]
    proj = torch.randn(64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    data = _loop_data(STEPS)

    def loss_of(m, x, y):
        return ((m(x) - y) * proj).pow(2).mean()

    @graph_step(optimizer=opt, warmup=2)
    def train_step(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    losses, ref_losses, plain_losses = [], [], []
    for x, y in data:
        losses.append(train_step(x, y))
        for m, o, out, rounded in ((ref, ref_opt, ref_losses, True),
                                   (plain, plain_opt, plain_losses, False)):
            o.zero_grad()
            loss = loss_of(m, x, y)
            loss.backward()
            floats = [g["lr"] for g in o.param_groups]
            if rounded:
                for g in o.param_groups:
                    g["lr"] = float(torch.tensor(g["lr"], dtype=torch.float32))
            o.step()
            for g, lr in zip(o.param_groups, floats):
                g["lr"] = lr
            out.append(loss.detach())
        for s in scheds:
            s.step()
    assert float(ref[0].weight.grad.abs().max()) > 1e-4
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(a, b), f"step {i}: {a.item()} != {b.item()}"
    worst = max(float((a - b).abs() / b.abs()) for a, b in zip(losses, plain_losses))
    assert worst < 1e-4, worst
    st_ = train_step.stats
    assert (st_.captures, st_.replays, st_.invalidations) == (1, STEPS - 2, 0)
    assert set(train_step.scheduled_lr) == {0}
    assert all(isinstance(g["lr"], float) for g in opt.param_groups)


def test_lr_change_recaptures_once_then_never():
    """Without a scheduler, a fused optimizer's first lr change after the capture recaptures once
    (the lr becomes a device tensor); later changes cost nothing. A non-fused SGD recaptures at
    every change, with one warning saying fused=True avoids it."""
    data = _loop_data(6)
    for make, captures in ((_fused_adamw, 2),
                           (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True),
                            5)):
        model = _mlp()
        opt = make(model.parameters())
        train_step = GraphStep(lambda x, y: (model(x) - y).pow(2).mean().backward(),
                               optimizer=opt, warmup=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, (x, y) in enumerate(data):
                if i >= 2:
                    opt.param_groups[0]["lr"] *= 0.5
                train_step(x, y)
        assert train_step.stats.captures == captures
        assert len([c for c in caught if "lr changed" in str(c.message)]) == 1


# ---- checkpoint and resume ----------------------------------------------------------------
def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_resume_into_the_same_step_equals_the_uninterrupted_run():
    """The issue's case: save at step 4 of 8, load into the same model and optimizer, continue
    with the same decorated step: losses bit for bit those of the uninterrupted run, with the
    loaded state copied into the tensors the graph updates (no recapture)."""
    data = _loop_data(8, seed=3)
    proj = torch.randn(64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))

    def run(resume: bool):
        model = _mlp()
        opt = _fused_adamw(model.parameters())

        @graph_step(optimizer=opt, warmup=2)
        def train_step(x, y):
            loss = ((model(x) - y) * proj).pow(2).mean()
            loss.backward()
            return loss

        losses = [train_step(*b) for b in data[:4]]
        if resume:
            ckpt = _round_trip({"model": model.state_dict(), "opt": opt.state_dict()})
            for b in data[4:6]:                       # the state moves past the checkpoint
                train_step(*b)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
        losses += [train_step(*b) for b in data[4:]]
        return model, train_step, losses

    model_a, step_a, straight = run(False)
    model_b, step_b, resumed = run(True)
    for i, (a, b) in enumerate(zip(resumed, straight)):
        assert torch.equal(a, b), f"step {i}: {a.item()} != {b.item()}"
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    assert step_b.stats.captures == 1 and step_b.stats.invalidations == 0


def test_state_of_another_shape_recaptures_and_p_data_too():
    """State that cannot be copied in (a checkpoint from before the first step) and a replaced
    parameter storage drop the graph: one eager step, then a new capture; training goes on
    equal to an eager loop doing the same."""
    data = _loop_data(10, seed=5)

    def mutate(i, model, opt):
        if i == 4:
            opt.load_state_dict(_round_trip(_fused_adamw(_mlp().parameters()).state_dict()))
        if i == 7:
            with torch.no_grad():
                model[0].weight.data = model[0].weight.data.clone() * 0.5

    model, ref = _mlp(), _mlp()
    opt, ref_opt = _fused_adamw(model.parameters()), _fused_adamw(ref.parameters())

    def step(x, y):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    train_step = GraphStep(step, optimizer=opt, warmup=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, (x, y) in enumerate(data):
            mutate(i, model, opt)
            mutate(i, ref, ref_opt)
            train_step(x, y)
            ref_opt.zero_grad()
            (ref(x) - y).pow(2).mean().backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    st_ = train_step.stats
    assert st_.invalidations == 2 and st_.captures == 3 and st_.steps == 10


def test_load_with_assign_is_refused():
    model = _mlp()
    opt = _fused_adamw(model.parameters())
    train_step = GraphStep(lambda x, y: (model(x) - y).pow(2).mean().backward(), optimizer=opt,
                           warmup=1)
    data = _loop_data(4)
    for b in data[:3]:
        train_step(*b)
    model.load_state_dict(_round_trip(model.state_dict()), assign=True)
    with pytest.raises(ValueError, match=r"was replaced by a new Parameter .*assign=True"):
        train_step(*data[3])


# ---- steps that never ran, a failing first call -------------------------------------------
def test_step_returning_a_generator_is_refused_at_capture():
    def hidden(x):
        yield x.sum()

    train_step = GraphStep(lambda x: hidden(x), warmup=0)
    with pytest.raises(TypeError, match="returned a generator instead of running"):
        train_step(torch.randn(4, device="cuda"))
    st_ = train_step.stats
    assert (st_.steps, st_.captures, st_.graphs) == (0, 0, 0)


def test_a_failing_first_call_does_not_fix_the_signature():
    """The CPU sequence of test_graph_misuse.py on the GPU: warmup on (4, 8), the capture of a
    (6, 8) call fails (CaptureError caused by the step's error), (4, 8) then captures and replays,
    and (6, 8) is the new shape."""
    w = torch.nn.Parameter(torch.randn(8, device="cuda"))
    failed = []

    def step(x):
        if x.shape[0] == 6 and not failed:
            failed.append(1)
            raise RuntimeError("injected failure on the first (6, 8) call")
        (w * x).sum().backward()

    train_step = GraphStep(step, optimizer=_fused_adamw([w]), warmup=1)
    train_step(torch.randn(4, 8, device="cuda"))
    with pytest.raises(CaptureError, match="injected") as info:
        train_step(torch.randn(6, 8, device="cuda"))
    assert isinstance(info.value.__cause__, RuntimeError)
    train_step(torch.randn(4, 8, device="cuda"))
    train_step(torch.randn(4, 8, device="cuda"))
    with pytest.raises(ValueError, match=r"args\[0\].*captured for.*\(4, 8\).*\(6, 8\)"):
        train_step(torch.randn(6, 8, device="cuda"))
    st_ = train_step.stats
    assert (st_.steps, st_.captures, st_.replays) == (3, 1, 2)


def test_public_introspection_after_replays():
    model = _mlp()
    train_step = GraphStep(lambda x, y: (model(x) - y).pow(2).mean().backward(),
                           optimizer=_fused_adamw(model.parameters()), warmup=1)
    for b in _loop_data(3):
        train_step(*b)
    (info,) = train_step.captured_graphs()
    assert "args[0]: torch.float32 tensor of shape (32, 64)" in info.inputs and info.nbytes > 0
    last = train_step.last_replay
    assert last.flags == {"overflow": False, "host_spill": False, "over_budget": False}
    assert last.status_wait_us >= 0 and last.done_event is not None
    assert train_step.read_flags() == (0, 0, 0)
    info.graph.replay()                      # what a timing tool does
    torch.cuda.synchronize()
