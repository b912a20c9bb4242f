"""What a graph_step may take (NOTE [what a step may take]): tensors inside dataclasses,
Mappings (transformers' BatchEncoding), attrs classes and nested containers are staged every
call, so a batch that differs anywhere (the middle of a large tensor included) is the batch the
step computes on; what cannot be staged or compared is refused, naming its path.

On the CPU the call that would capture and every later one run the step on arguments rebuilt
around static buffers, as a replay does (NOTE [same contract on the CPU]), so a tensor the
staging missed would be seen stale here. Data: seeded per test (``gen`` fixture) or drawn by
hypothesis, as each test says.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphstash.graph import GraphStep, graph_step

from _batches import KINDS, ROWS, WIDTH, FrozenBatch
from _batches import make as _make
from _batches import take as _take


def _model_and_step(kind, seed, **step_kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Linear(WIDTH, WIDTH)
    ref = copy.deepcopy(model)
    proj = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed + 1))

    def loss_of(m, args):
        a, b = _take(kind, args)
        return (m(a) * proj).sum() + 0.5 * (m(b) * proj).sum()

    def step(*args):
        loss = loss_of(model, args)
        loss.backward()
        return loss

    train_step = graph_step(step, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                            device="cpu", **step_kwargs)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)

    def eager(args):
        ref_opt.zero_grad()
        loss = loss_of(ref, args)
        loss.backward()
        ref_opt.step()
        return loss.detach()

    return model, ref, train_step, eager


def _run_batches(kind, seed, changes):
    """Train on batches that differ from the first one at ``changes`` (flat index, value) and
    compare each call with an eager step on the same batch."""
    gen = torch.Generator().manual_seed(seed)
    base_a = torch.randn(ROWS, WIDTH, generator=gen)
    base_b = torch.randn(ROWS, WIDTH, generator=gen)
    model, ref, train_step, eager = _model_and_step(kind, seed, warmup=1)
    for i, (where, value) in enumerate(changes):
        a, b = base_a.clone(), base_b.clone()
        (a if i % 2 else b).view(-1)[where] = value     # one element, anywhere
        batch = _make(kind, a, b)
        got = train_step(*batch)
        want = eager(batch)
        assert torch.equal(got, want), f"{kind}, call {i}: {got} != {want} (stale batch?)"
        assert _take(kind, batch)[0] is a              # the caller's objects are not modified
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert train_step.stats.steps == len(changes)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2 ** 16),
       changes=st.lists(st.tuples(st.integers(0, ROWS * WIDTH - 1),
                                  st.floats(-4, 4, allow_nan=False, width=32)),
                        min_size=3, max_size=6))
def test_every_call_computes_on_its_own_batch(kind, seed, changes):
    """Batches of every container kind, each differing from the captured one in one element
    chosen by hypothesis (the middle of the tensors included): every call equals an eager step
    on that call's batch, and the rebuilt containers keep their types."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _run_batches(kind, seed, changes)


@pytest.mark.parametrize("kind", KINDS)
def test_middle_of_a_large_tensor(kind):
    """The acceptance case: batches equal except in the middle of the tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _run_batches(kind, 7, [(ROWS * WIDTH // 2, 3.0), (ROWS * WIDTH // 2 + 1, -3.0),
                               (ROWS * WIDTH // 2, 1.5), (ROWS * WIDTH // 2 - 5, 2.0)])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), warmup=st.integers(0, 2))
def test_numpy_arrays_are_refused_naming_the_path(seed, warmup):
    """A numpy array is refused at the call that would capture, naming it, with nothing run or
    counted; eager warmup calls take it as they are."""
    rng = np.random.default_rng(seed)
    w = torch.nn.Parameter(torch.randn(4))
    train_step = GraphStep(lambda batch: (w * torch.as_tensor(batch["x"])).sum().backward(),
                           optimizer=torch.optim.SGD([w], lr=0.1), device="cpu", warmup=warmup)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(warmup):
            train_step({"x": rng.standard_normal(4).astype(np.float32)})
        before = w.detach().clone()
        with pytest.raises(TypeError, match=r"args\[0\]\['x'\]: a numpy\.ndarray cannot be "
                                            r"staged.*torch\.from_numpy"):
            train_step({"x": rng.standard_normal(4).astype(np.float32)})
    assert torch.equal(w, before) and train_step.stats.steps == warmup


class Opaque:
    """An object graph_step cannot see into or compare (identity hash, no __eq__)."""

    def __init__(self, scale):
        self.scale = scale


class Scale:
    """A value object: equal and hashed by its value; its repr never shows the value."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Scale) and other.value == self.value

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return "Scale(...)"


def _scalar_step(gen, **kwargs):
    w = torch.nn.Parameter(torch.randn(4, generator=gen))

    def step(x, cfg):
        scale = cfg.scale if isinstance(cfg, Opaque) else cfg.value if isinstance(cfg, Scale) \
            else cfg
        (w * x * scale).sum().backward()

    return w, GraphStep(step, optimizer=torch.optim.SGD([w], lr=0.1), device="cpu", warmup=1,
                        **kwargs)


def test_object_it_cannot_see_into_is_refused_naming_the_path(gen):
    w, train_step = _scalar_step(gen)
    x = torch.randn(4, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        train_step(x, Opaque(2.0))                        # warmup: eager, as given
        before = w.detach().clone()
        with pytest.raises(TypeError, match=r"args\[1\]: graph_step cannot see into an object "
                                            r"of type Opaque"):
            train_step(x, Opaque(2.0))
    assert torch.equal(w, before) and train_step.stats.steps == 1


def test_value_objects_are_compared_by_value_not_by_repr(gen):
    """Two values with the same repr are different constants; equal values replay."""
    w, train_step = _scalar_step(gen)
    x = torch.randn(4, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            train_step(x, Scale(2.0))
        with pytest.raises(ValueError, match=r"args\[1\] changed from Scale\(\.\.\.\) to "
                                             r"Scale\(\.\.\.\).*baked into the graph"):
            train_step(x, Scale(3.0))
        long_a, long_b = "a" * 500 + "x" + "a" * 500, "a" * 500 + "y" + "a" * 500
        strings = GraphStep(lambda x, s: x.sum(), device="cpu", warmup=0)
        strings(x, long_a)
        with pytest.raises(ValueError, match=r"args\[1\] changed from"):
            strings(x, long_b)              # equal reprs when elided; compared in full


def test_batch_encoding_ids_differing_in_the_middle(gen):
    """The issue's case: a language model fed a tokenizer's BatchEncoding whose ids differ from
    the captured batch only in the middle of two rows trains on each call's own ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    vocab, hidden = 50, 16
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab))
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    def loss_of(m, batch):
        logits = m(batch["input_ids"])
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.cross_entropy((logits * mask).flatten(0, 1),
                                                 batch["input_ids"].flatten())

    @graph_step(optimizer=opt, device="cpu", warmup=1)
    def train_step(batch):
        loss = loss_of(model, batch)
        loss.backward()
        return loss

    ids = torch.randint(0, vocab, (2, 600), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(5):
            changed = ids.clone()
            changed[:, 300] = (ids[:, 300] + i) % vocab       # the middle of both rows
            batch = transformers.BatchEncoding({"input_ids": changed,
                                                "attention_mask": torch.ones_like(changed)})
            loss = train_step(batch)
            ref_opt.zero_grad()
            want = loss_of(ref, batch)
            want.backward()
            ref_opt.step()
            assert torch.equal(loss, want.detach()), f"call {i}"


def test_rebuilt_frozen_dataclass_holds_the_static_tensors(gen):
    """The captured call gets a new FrozenBatch around static buffers, and the same one on every
    later call, as a graph would; the caller's FrozenBatch is untouched."""
    seen = []

    def step(batch):
        seen.append(batch)
        return batch.ids.sum()

    train_step = GraphStep(step, device="cpu", warmup=0)
    user = [FrozenBatch(torch.randn(3, generator=gen), torch.ones(3)) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        outs = [train_step(b) for b in user]
    assert all(type(b) is FrozenBatch for b in seen)
    assert seen[0] is seen[1] is seen[2] and seen[0] is not user[0]
    assert seen[0].ids is not user[0].ids and torch.equal(seen[0].ids, user[2].ids)
    for out, b in zip(outs, user):
        assert torch.equal(out, b.ids.sum())
