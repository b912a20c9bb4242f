"""The training set-up that ``graphstash demo``, ``graphstash memory`` and ``graphstash bench
moe`` run: the reference MoE model, its AdamW, its batches and its step, written once.

A step is either a plain eager loop (``zero_grad``, forward, backward, ``optimizer.step()``)
or the same forward and backward under :func:`graphstash.graph_step`, which on a GPU warms up
eagerly, captures the whole step (AdamW fused and capturable) and replays it, and on the CPU
runs every step eagerly with the reference backend.

The loss is the mean squared distance of the model's output to a target that is a fixed
random map of the input, RMS-normalised like the output (NOTE [training loss]).

Example::

    run = build(MoEConfig(), "budget", device, torch.bfloat16, graphed=True)
    for x, y in batches(MoEConfig(), 4, seed=0, device=device, dtype=torch.bfloat16):
        loss = run.step(x, y)
    run.release()
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import warnings
from typing import Callable

import torch

from ..graph import GraphStep, graph_step
from ..models import MoEConfig, MoEModel, parse_routing
from ..moe import prepare_experts

WARMUP = 2          # eager graph_step calls before the capture

# NOTE [training loss]: the model ends in an RMSNorm whose weight starts at ones, so the mean
# square of its output is constant and the gradients of ``model(x).pow(2).mean()`` are
# rounding noise. The distance to a target reaches every parameter: its gradient at the output
# is ``2 (out - y) / numel``. The target, a fixed random map of the tokens normalised like the
# output, makes the loss start near 2 and fall as the model learns the map.


def batches(config: MoEConfig, count: int, *, seed: int, device, dtype) -> list:
    """``count`` batches ``(x, y)``: ``x`` ``[num_tokens, hidden]`` tokens in ``dtype`` on
    ``device``, ``y`` float32 ``[num_tokens, hidden]`` targets on ``device``
    (NOTE [training loss]), drawn from ``seed`` by a generator on ``device`` (equal seeds on
    equal devices give equal batches)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    hidden = config.hidden
    proj = torch.randn(hidden, hidden, generator=gen, device=device) / math.sqrt(hidden)
    out = []
    for _ in range(count):
        x = torch.randn(config.num_tokens, hidden, generator=gen, device=device)
        y = torch.tanh(x @ proj)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        out.append((x.to(dtype), y))
    return out


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Float32 scalar ``mean((model(x) - y)^2)`` (NOTE [training loss]); ``x`` as
    :func:`batches` makes it, ``y`` float32 of the output's shape on its device."""
    return (model(x).float() - y).pow(2).mean()


def forward_backward_of(model: torch.nn.Module) -> Callable:
    """``f(x, y)``: :func:`loss_of` ``(model, x, y)``, its backward, and the loss detached (the
    body a ``graph_step`` captures). Tensors as for :func:`loss_of`."""
    def forward_backward(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        return loss.detach()
    return forward_backward


def eager_step(forward_backward: Callable, optimizer: torch.optim.Optimizer) -> Callable:
    """``step(x, y)``: the eager loop's step around ``forward_backward`` (zero the gradients,
    run it, ``optimizer.step()``); returns its loss."""
    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(x, y)
        optimizer.step()
        return loss
    return step


@dataclasses.dataclass
class TrainingRun:
    """A model, its optimizer and its step.

    ``step(x, y)`` runs one training step on a batch of :func:`batches` and returns the loss
    (a detached float32 scalar). ``graph`` is the :class:`graphstash.GraphStep` behind it, or
    ``None`` for an eager loop; ``compiled`` the ``torch.compile`` wrapper of ``model`` the
    step calls, or ``None`` when it calls ``model`` itself.
    """

    model: MoEModel
    optimizer: torch.optim.Optimizer
    step: Callable
    graph: GraphStep | None
    compiled: torch.nn.Module | None = None

    @property
    def stash_manager(self):
        """The stash manager of the graphed step (``None`` without stashing)."""
        return None if self.graph is None else self.graph.stash_manager

    def release(self) -> None:
        """Free the captured graphs and stash pools (an eager run holds none)."""
        if self.graph is not None:
            self.graph.release()


def build(config: MoEConfig, mode: str, device: torch.device, dtype: torch.dtype, *,
          graphed: bool, seed: int = 0, lr: float = 1e-4, stash=None, group=None,
          warmup: int = WARMUP, compile_kwargs: dict | None = None) -> TrainingRun:
    """The model of ``config`` in ``mode`` (a :class:`~graphstash.models.MoEModel` mode:
    ``"dropless"``, ``"budget"``, ``"stash"`` or ``"plain"``) with AdamW and its step.

    Args:
        config: the model's sizes.
        mode: the model's MoE path.
        device: where the model lives and the step runs (``cpu`` or ``cuda``).
        dtype: parameter dtype (bf16 on a GPU is what the benchmarks measure).
        graphed: the step under :func:`graphstash.graph_step` (``warmup`` eager calls, then
            capture and replays on CUDA; every call eager on the CPU), else a plain eager loop.
        seed: the model's initialisation seed (equal seeds give equal models).
        lr: AdamW's learning rate.
        stash: ``graph_step``'s ``stash=`` (a :class:`graphstash.StashConfig`), for
            ``mode="stash"``.
        group: ``torch.distributed`` group for expert parallelism.
        warmup: ``graph_step``'s eager warmup calls.
        compile_kwargs: the step calls ``torch.compile(model, **compile_kwargs)`` (``{}``:
            torch.compile's defaults, Inductor) instead of the model; ``None``: uncompiled.
            The wrapper is made here, before any warmup; the step's first call compiles it
            (under ``graph_step``: the first warmup call, NOTE [compile and capture] in
            ``graphstash/graph/compile_guard.py``).
    """
    on_gpu = device.type == "cuda"
    if on_gpu:
        # Decide, before anything is captured, whether the experts' grouped GEMM can be
        # (NOTE [grouped_mm under capture] in graphstash/moe/experts.py).
        prepare_experts(device, dtype)
    model = MoEModel(config, mode=mode, group=group, seed=seed, device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=on_gpu or None,
                            capturable=on_gpu and graphed)
    if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
        raise TypeError(f"compile_kwargs: expected a dict of torch.compile arguments or None, "
                        f"got {type(compile_kwargs).__name__}")
    compiled = None if compile_kwargs is None else torch.compile(model, **compile_kwargs)
    runs = model if compiled is None else compiled

    forward_backward = forward_backward_of(runs)
    if not graphed:
        return TrainingRun(model, opt, routed_step(model, eager_step(forward_backward, opt)),
                           None, compiled)
    # dispatch raises its flags in the running step's status (no status= wiring)
    train_step = graph_step(forward_backward, optimizer=opt, stash=stash, warmup=warmup,
                            device=device)
    return TrainingRun(model, opt, routed_step(model, train_step), train_step, compiled)


def routed_step(model: MoEModel, step: Callable) -> Callable:
    """``step``, with ``model``'s router bias set for each call's step number first when its
    routing moves over the steps (``drift``: NOTE [training-like routing] in
    ``graphstash/models/routing.py``); ``step`` itself otherwise (the bias is set once)."""
    if parse_routing(model.config.routing).kind != "drift":
        return step
    calls = itertools.count()

    def call(*args):
        model.set_routing_step(next(calls))
        return step(*args)

    return call


@contextlib.contextmanager
def quiet_cpu_graph_step(on_gpu: bool):
    """Without CUDA, silence graph_step's notes that it runs eagerly and that the (eager,
    hence not capturable) optimizer would be refused on a GPU: the tools say once, in their
    own output, that they run eagerly on the CPU."""
    with warnings.catch_warnings():
        if not on_gpu:
            warnings.filterwarnings("ignore", message=r"graphstash\.graph_step\(",
                                    category=RuntimeWarning)
        yield
