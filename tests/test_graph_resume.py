"""Checkpoint and resume into a live graph_step (NOTE [checkpoint and resume]), on the CPU: the
bookkeeping a GPU graph relies on. A checkpoint loaded into the same model and optimizer is
copied into the tensors the step holds (they stay the optimizer's state), replaced parameters
and state that cannot be copied drop the graphs (counted, warned once), and a Parameter
replaced in the model is refused at the next call. Losses equal the uninterrupted run (or an
eager loop doing the same) bit for bit. The GPU test in test_graph_gpu.py runs the real graph.
Data: seeded per test.
"""
from __future__ import annotations

import io
import warnings

import pytest
import torch

from graphstash.graph import GraphStep

STEPS = 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True,
                             capturable=True)


def _round_trip(obj):
    """``obj`` saved and loaded as a checkpoint file would be (new tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _stepper(model, opt, proj):
    def step(x, y):
        loss = ((model(x) - y) * proj).pow(2).mean()
        loss.backward()
        return loss

    return GraphStep(step, optimizer=opt, device="cpu", warmup=2)


def _batches(gen, n=STEPS):
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(n)]


def _held(opt):
    return {id(p): dict(st) for p, st in opt.state.items()}


@pytest.fixture
def quiet():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_resume_into_the_same_step_equals_the_uninterrupted_run(gen, quiet):
    """Save at step 4 of 8, train on, load the step-4 checkpoint into the same model and
    optimizer and continue with the same decorated step: steps 5-8 equal the uninterrupted
    run, and the optimizer state is the tensors the step held, holding the loaded values."""
    data = _batches(gen)
    proj = torch.randn(8, generator=gen)
    model_a = _model()
    opt_a = _opt(model_a)
    step_a = _stepper(model_a, opt_a, proj)
    straight = [step_a(*b) for b in data]

    model, opt = _model(), None
    opt = _opt(model)
    train_step = _stepper(model, opt, proj)
    for b in data[:4]:
        train_step(*b)
    checkpoint = _round_trip({"model": model.state_dict(), "opt": opt.state_dict()})
    for b in data[4:6]:                      # train on: the state moves past the checkpoint
        train_step(*b)
    held = _held(opt)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    for p, st in opt.state.items():          # the step's tensors, holding the checkpoint
        for k, v in st.items():
            assert v is held[id(p)][k], k
    resumed = [train_step(*b) for b in data[4:]]
    for i, (a, b) in enumerate(zip(resumed, straight[4:])):
        assert torch.equal(a, b), f"step {i + 5}: {a} != {b}"
    for p, q in zip(model.parameters(), model_a.parameters()):
        assert torch.equal(p, q)
    assert train_step.stats.invalidations == 0
    assert not [str(c.message) for c in quiet if "optimizer state" in str(c.message)]


def _reference_run(gen_state, data, proj, mutate_at, mutate):
    """An eager loop applying ``mutate(model, opt)`` before step ``mutate_at``."""
    model = _model()
    opt = _opt(model)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == mutate_at:
            mutate(model, opt)
        opt.zero_grad()
        loss = ((model(x) - y) * proj).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, losses


def _graph_run(data, proj, mutate_at, mutate):
    model = _model()
    opt = _opt(model)
    train_step = _stepper(model, opt, proj)
    losses = []
    for i, b in enumerate(data):
        if i == mutate_at:
            mutate(model, opt)
        losses.append(train_step(*b))
    return model, opt, train_step, losses


def _replace_state(model, opt):
    for p in list(opt.state):
        opt.state[p] = {k: (v * 0.5 if k != "step" else v.clone()) for k, v in opt.state[p].items()}


def _replace_storage(model, opt):
    with torch.no_grad():
        model[0].weight.data = model[0].weight.data.clone() * 0.5


def _empty_state(model, opt):
    opt.load_state_dict(_round_trip(_opt(_model()).state_dict()))     # saved before any step


@pytest.mark.parametrize("mutate, invalidations, note", [
    (_replace_state, 0, "the new values were copied into the tensors the graph updates"),
    (_replace_storage, 1, "the storage of param group 0 parameter 0 changed since the capture"),
    (_empty_state, 1, "has the keys [], the graph holds"),
], ids=["state_replaced", "p.data_replaced", "state_from_before_the_first_step"])
def test_state_replaced_between_calls_takes_effect(gen, quiet, mutate, invalidations, note):
    """Optimizer state replaced by assignment is copied in; a parameter storage replaced, or
    state that cannot be copied, drops the graphs (one eager step, then a recapture). Either
    way every step equals an eager loop that does the same, and a warning says it once."""
    data = _batches(gen)
    proj = torch.randn(8, generator=gen)
    model, opt, train_step, losses = _graph_run(data, proj, 5, mutate)
    ref, ref_losses = _reference_run(None, data, proj, 5, mutate)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(a, b), f"step {i}: {a} != {b}"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    st = train_step.stats
    assert st.invalidations == invalidations and st.steps == STEPS
    said = [str(c.message) for c in quiet if note in str(c.message)]
    assert len(said) == 1, [str(c.message) for c in quiet]


def test_load_with_assign_is_refused_at_the_next_call(gen, quiet):
    data = _batches(gen)
    model = _model()
    opt = _opt(model)
    train_step = _stepper(model, opt, torch.randn(8, generator=gen))
    for b in data[:4]:
        train_step(*b)
    checkpoint = _round_trip(model.state_dict())
    model.load_state_dict(checkpoint, assign=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"Linear\.weight was replaced by a new Parameter after "
                                         r"graph_step captured it \(load_state_dict\(\.\.\., "
                                         r"assign=True\).*Load checkpoints without assign=True"):
        train_step(*data[4])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert train_step.stats.steps == 4


def test_parameters_swapped_inside_the_step_are_not_replacements(gen, quiet):
    """A step that swaps a Parameter for another and back while it runs (as FSDP2 does with
    sharded and unsharded parameters) is not refused."""
    model = _model()
    opt = _opt(model)
    layer = model[0]

    def step(x, y):
        original = layer.weight
        layer.weight = torch.nn.Parameter(original.detach().clone())
        layer.weight = original
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    train_step = GraphStep(step, optimizer=opt, device="cpu", warmup=1)
    for b in _batches(gen, 5):
        train_step(*b)
    assert train_step.stats.steps == 5 and train_step.stats.invalidations == 0
