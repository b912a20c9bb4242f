"""The graph manager: :class:`GraphStep` and the :func:`graph_step` decorator.

One call of a decorated training step runs one of three ways:

1. eagerly (the first ``warmup`` calls, every call on a machine without CUDA, and the rerun of
   an overflowed step), with the usual ``zero_grad`` / step / ``optimizer.step()`` order;
2. by capture and replay: the tensors of the call are copied into static buffers and one CUDA
   graph runs forward, backward and the optimizer update;
3. by replay then recovery: when the step's device status says *overflow* or *over budget*,
   the replayed update was skipped on the device (NOTE [update skipping]) and the same inputs
   run again eagerly in dropless mode, applying the update once; a step whose stash alone
   overflowed runs again through a new capture with the grown stash instead (NOTE [rerun by
   capture]).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import time
import traceback
import typing
import warnings
import weakref

import torch

from .._checks import forbid_capture
from .._mode import dropless
from ..errors import CaptureError, ReleasedError, UpdateAppliedError
from ..status import MAX_STEP_PEAKS, StepStatus
from . import _staging as S
from . import capture_errors, capture_memory, compile_guard, failed_capture
from ._binding import CapturedState, step_running
from ._data_parallel import (DDP_WARMUP, check_ddp, find_ddp, quiet_sampling,
                             rebuild_on_side_stream)
from ._options import StepOptions, keyword_signature
from ._schedule import ScheduledHyperparameters
from ._update import DeviceUpdate, check_optimizer, has_state
from .protocol import StepParticipant

_LIVE_GRAPHS: "weakref.WeakSet" = weakref.WeakSet()


def live_graphs() -> int:
    """How many CUDA graphs captured by :class:`GraphStep` objects are still alive."""
    return len(_LIVE_GRAPHS)


@dataclasses.dataclass
class GraphStepStats:
    """Counters of a :class:`GraphStep` (a snapshot; read ``train_step.stats`` again to refresh).

    ``steps`` counts the steps whose update was applied (each once; NOTE [transactional
    rerun]), ``replays`` graph replays,
    ``eager_steps`` steps run eagerly on purpose (warmup, no CUDA), ``eager_reruns`` dropless
    reruns after a flagged step, ``capture_reruns`` flagged replays rerun by capturing the step
    again with the grown stash (without CUDA: run again eagerly with it; NOTE [rerun by
    capture]; ``reruns`` is both),
    ``overflows`` / ``over_budget`` / ``host_spills`` steps whose status carried that flag,
    ``captures`` graphs captured and ``capture_ms`` their total capture time.
    ``status_wait_us`` is the mean host time per replay between launching the graph and holding
    its flags (it includes waiting for the GPU to finish the step).
    ``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated`` of the device,
    ``stash_pages_peak`` the stash manager's device-page high-water mark (0 without one),
    ``memory_before_capture`` ``torch.cuda.memory_allocated`` just before the first capture.
    ``invalidations`` counts the calls that dropped the graphs because something baked into
    them changed: a hyperparameter that is not a device tensor (NOTE [scheduled
    hyperparameters]) or replaced parameters and optimizer state that could not be copied in
    (NOTE [checkpoint and resume]). Without CUDA it counts the same calls (each would recapture).
    ``budget_changes`` counts the calls that found an adaptive dispatch budget changed (NOTE
    [budgets the step adapts]): each ran one eager step at the new sizes and recaptured.
    ``stash_growths`` counts the reruns that grew the stash (an overflow or a host spill, NOTE
    [stash growth]), ``stash_grown_ahead`` the calls that grew it before a step overflowed it
    (NOTE [stash growth ahead]); each drops the graphs, and the next call recaptures (a rerun
    by capture recaptures in the call that grew the stash).
    """

    mode: str = "graph"
    steps: int = 0
    replays: int = 0
    eager_steps: int = 0
    eager_reruns: int = 0
    overflows: int = 0
    over_budget: int = 0
    host_spills: int = 0
    captures: int = 0
    capture_ms: float = 0.0
    status_wait_us: float = 0.0
    graphs: int = 0
    graph_bytes: int = 0
    peak_memory_bytes: int = 0
    stash_pages_peak: int = 0
    memory_before_capture: int | None = None
    invalidations: int = 0
    budget_changes: int = 0
    stash_growths: int = 0
    stash_grown_ahead: int = 0
    capture_reruns: int = 0

    @property
    def reruns(self) -> int:
        """Flagged steps run again, eagerly or by capture: ``eager_reruns + capture_reruns``."""
        return self.eager_reruns + self.capture_reruns

    def as_dict(self) -> dict:
        """The counters as a plain ``dict`` (for logging or JSON)."""
        return dataclasses.asdict(self)


class _RerunByCapture(typing.NamedTuple):
    """What a flagged replay returns to its caller for NOTE [rerun by capture]: its flags
    (overflow, host spill, over budget) and the step's peaks (NOTE [step peaks])."""
    flags: tuple
    peaks: list


class _StepCalledError(ValueError):
    """``optimizer.step()`` called by the step function (NOTE [step ownership])."""


class _NeverRanError(TypeError):
    """The step function returned a generator, coroutine or awaitable (NOTE [steps that never
    ran])."""


@dataclasses.dataclass(frozen=True)
class GraphInfo:
    """One graph a :class:`GraphStep` holds (read-only; see :meth:`GraphStep.captured_graphs`).

    ``inputs`` describes the call it was captured for (each argument's path and tensor spec or
    value), ``nbytes`` the memory it holds (pool growth during capture plus static inputs).
    ``graph`` is the ``torch.cuda.CUDAGraph`` itself: replaying it directly skips staging the
    inputs, writing scheduled hyperparameters and reading the status (timing tools only).
    """

    inputs: str
    nbytes: int
    graph: object


@dataclasses.dataclass(frozen=True)
class ReplayInfo:
    """The last replay of a :class:`GraphStep` (see :attr:`GraphStep.last_replay`).

    ``flags`` is what the status said (``{"overflow", "host_spill", "over_budget"}``, bools),
    ``status_wait_us`` the host time between launching the graph and holding its flags (it
    includes waiting for the GPU to finish the step), ``done_event`` the ``torch.cuda.Event``
    recorded on the current stream right after the replay (``done_event.elapsed_time(...)``
    needs an event created with ``enable_timing=True`` on the caller's side).
    """

    flags: dict
    status_wait_us: float
    done_event: object


@dataclasses.dataclass
class _Graph:
    """One captured graph and what it must keep alive."""

    signature: tuple
    graph: object
    inputs: S.StaticInputs
    outputs: object                 # what the captured call returned (static tensors)
    grads: list                     # (parameter, gradient it writes) pairs (its pool)
    nbytes: int                     # pool growth during capture + static inputs
    described: str                  # the captured call's arguments, for GraphInfo


# NOTE [gradients]
# Right before a capture the gradients are set to None, so the first backward inside the graph
# *writes* them (in the graph's pool) and later microbatches accumulate: every replay starts
# from zero gradients exactly as ``optimizer.zero_grad()`` would, with no memset. Eager steps
# (warmup, reruns) call ``zero_grad(set_to_none=True)`` first, which is what an eager loop does.
# A rerun of a replayed step writes its gradients into the graph's own tensors (a hook after
# each parameter's gradient is accumulated copies it there and points ``p.grad`` at it), so it
# holds no second set of gradients beside the graph's (4.5 GiB a rank at qwen3-30b-a3b widths
# over two GPUs, 8 layers; docs/exchange.md, "Rows the stash keeps"); a parameter that got no
# gradient keeps ``p.grad`` None, as eagerly. Without DDP: its reducer owns its gradients'
# layout. After every replay ``p.grad`` is the replayed graph's gradient (set again only when
# another graph, a rerun or ``zero_grad`` pointed it elsewhere): with two graphs, or a graph
# kept after a rerun, it would otherwise still show an older step's gradient. A rerun that
# grew the stash or a budget drops the graphs but not ``p.grad``: the call returns with the
# rerun's gradient, as an eager step would, and the next capture sets them to None first
# (they used to be None after such a call). A step function therefore must not call
# ``optimizer.step()`` itself (it is refused: NOTE [step ownership]); calling ``zero_grad()``
# is harmless.

# NOTE [step ownership]
# The decorator applies the update itself (``optimizer.step()``, or ``scaler.step``/``update``):
# inside the graph, where a device flag can skip it, and eagerly once the flags were read. A
# step function that calls ``optimizer.step()`` as an eager loop does would apply every update
# twice (and once more, unskippable, inside the capture). A step pre-hook on the optimizer
# refuses any ``step()`` while the step function runs, before the optimizer writes anything, so
# such a call fails with nothing applied and the same error eagerly, under capture and on the
# CPU.

# NOTE [transactional rerun]
# A rerun applies the update of a step the device skipped. Everything that can fail runs before
# that update: the step function, growing the stash budget (it reallocates) and preparing the
# outputs. A failure there leaves the update unapplied and the step uncounted, so retrying the
# batch is correct. The update is counted in ``stats.steps`` as it is applied, so the counter
# always equals the updates made. Only the user's ``on_overflow`` runs after it (it must see
# the grown budget); if it raises, the graphs are still dropped and the error is an
# UpdateAppliedError saying that the update was applied and the batch must not be retried.

# NOTE [steps that never ran]
# A generator function, an async function, or any step that returns a generator, coroutine or
# other awaitable, returns before its body runs: nothing is computed, and counting or capturing
# such a call would train on nothing while stats say it trained. A function known to be one is
# refused when it is decorated; otherwise the first call whose step returns one is refused
# (TypeError) before any update, so nothing is applied or counted. The same goes for decorating
# a GraphStep again and for calling one GraphStep from inside another's step function: a capture
# cannot contain another capture, and the outer step would see the inner update as its step
# function calling optimizer.step().

# NOTE [status readback]
# Inside the graph, after backward, the flags (overflow, host spill, over budget) are reduced
# to indicators and, under torch.distributed, summed over ranks in one all_reduce, so every
# rank skips, reruns and recaptures together. The reduced int32 [3] vector is copied into a
# pinned host buffer by the graph itself; after the replay the host waits on one event and
# reads it. This is one sync per step: the next step must not start before the host knows
# whether this one is rerun (a rerun applies the update that the next step builds on).


def _refuse_never_running(fn) -> None:
    """TypeError for a step function whose calls return before running (NOTE [steps that never
    ran]) or that is already a GraphStep."""
    if isinstance(fn, GraphStep):
        raise TypeError(f"fn: {fn._name} is already a GraphStep; graph_step was applied twice "
                        "(graph_step(graph_step(f, ...), ...)). Decorate the function once")
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) or \
        isinstance(fn, functools.partial) else getattr(type(fn), "__call__", fn)
    for check, what in ((inspect.isgeneratorfunction, "a generator function"),
                        (inspect.iscoroutinefunction, "an async function"),
                        (inspect.isasyncgenfunction, "an async generator function")):
        if check(fn) or check(target):
            name = getattr(fn, "__qualname__", type(fn).__name__)
            raise TypeError(f"fn: {name} is {what}: calling it returns before its body runs, so "
                            "graph_step would count (and capture) steps that never ran. Make it "
                            "a plain function that runs forward and backward")


def _refuse_unrun_result(out, name: str) -> None:
    """_NeverRanError when a step returned a generator, coroutine or awaitable."""
    if inspect.isgenerator(out) or inspect.iscoroutine(out) or inspect.isasyncgen(out) or \
            inspect.isawaitable(out):
        close = getattr(out, "close", None) or getattr(out, "aclose", None)
        if inspect.isgenerator(out) or inspect.iscoroutine(out):
            close()                 # no "never awaited" warning; the body never ran anyway
        raise _NeverRanError(
            f"fn: {name} returned a {type(out).__name__} instead of running: its body (forward, "
            f"backward) never ran, so nothing was applied or counted. graph_step needs a plain "
            f"function that runs the step when called (NOTE [steps that never ran])")


_RUNNING = threading.local()        # GraphSteps whose step function runs on this thread


_DDP_HINT = ("the optimizer's parameters belong to a DistributedDataParallel module: DDP must be "
             "constructed on a side stream (with torch.cuda.stream(torch.cuda.Stream()): model = "
             "DDP(model, ...)), or its gradient hooks sync with the default stream, which a "
             "capture cannot contain (NOTE [DDP])")


class GraphStep:
    """A training step captured whole into a CUDA graph and replayed; see :func:`graph_step`.

    ``GraphStep(fn, **options)`` takes the options of :func:`graph_step` (:class:`StepOptions`).
    """

    def __init__(self, fn, **options):
        opts = StepOptions.from_keywords("GraphStep", options)
        if not callable(fn):
            raise TypeError(f"fn: expected a callable training step, got {type(fn).__name__}")
        _refuse_never_running(fn)                  # NOTE [steps that never ran]
        functools.update_wrapper(self, fn)
        self.options = opts
        self._fn = fn
        self._name = getattr(fn, "__qualname__", getattr(fn, "__name__", "step"))
        self.optimizer = opts.optimizer
        self.scaler = opts.scaler
        self.warmup = opts.warmup
        self._stash_arg = opts.stash
        self._outputs_mode = opts.outputs
        self._on_new_shape = opts.on_new_shape
        self._max_graphs = opts.max_graphs
        self._graph_memory_budget = opts.graph_memory_budget
        self._budget_growth = opts.budget_growth
        self._on_overflow = opts.on_overflow
        self._generators = opts.generators
        self._process_group = opts.process_group
        self._distributed_arg = opts.distributed
        self._update_skip = opts.update_skip
        self._device_arg = opts.device
        self._release_warmup_cache = opts.release_warmup_cache

        self._device: torch.device | None = None
        self._status: StepStatus | None = None
        self._manager = None
        self._update: DeviceUpdate | None = None
        self._hyper: ScheduledHyperparameters | None = None
        self._baked = None                        # hyperparameters the graphs baked in
        self._held: CapturedState | None = None   # NOTE [checkpoint and resume]
        self._stale: str | None = None
        self._eager_pending = 0
        self._graphs: dict[tuple, _Graph] = {}   # insertion order = least recently used first
        self._grads_of: _Graph | None = None     # whose gradients p.grad holds (NOTE [gradients])
        self._cpu_inputs: dict[tuple, S.StaticInputs] = {}   # NOTE [same contract on the CPU]
        self._first_signature = None
        self._eager_done = 0
        self._warmup_steps = opts.warmup
        self._ddp: tuple = ()
        self._ddp_stream = None          # where DDP's reducer is rebuilt (NOTE [DDP] item 3)
        self._released = False
        self._ready = False
        self._warned_eager = False
        self._said: set = set()
        self._flags_host: torch.Tensor | None = None
        self._flags_view = None
        self._done_event = None
        self._capture_stream = None
        self._stats = GraphStepStats()
        self._status_wait_s = 0.0
        self._last_replay: ReplayInfo | None = None
        self._fn_running = False
        self._warned_contract = False
        self._eager_signatures = compile_guard.EagerSignatures()   # NOTE [compile and capture]
        self._refuse_compiles = False
        self._versions_baked: dict = {}          # NOTE [budgets the step adapts]
        if self.optimizer is not None:           # NOTE [step ownership], [checkpoint and resume]
            me = weakref.ref(self)
            hooks = (self.optimizer.register_step_pre_hook(functools.partial(_refuse_step, me)),
                     self.optimizer.register_load_state_dict_post_hook(
                         functools.partial(_after_load, me)))
            weakref.finalize(self, _remove_hooks, hooks)

    # ---- set-up -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the step runs: ``device=``, else the optimizer's parameters, else CUDA/CPU."""
        if self._device is None:
            self._device = self._resolve_device()
        return self._device

    def _resolve_device(self) -> torch.device:
        if self._device_arg is not None:
            dev = self._device_arg
        elif self.optimizer is not None and self.optimizer.param_groups[0]["params"]:
            dev = self.optimizer.param_groups[0]["params"][0].device
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device: the optimizer's parameters are on {dev}; graph_step "
                                 "runs on CUDA (or eagerly on the CPU): pass device= or move them")
        elif torch.cuda.is_available():
            dev = torch.device("cuda")
        else:
            dev = torch.device("cpu")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device: {dev} requested but torch sees no CUDA device")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @property
    def graphed(self) -> bool:
        """True when calls are captured and replayed (False: eager fallback without CUDA)."""
        return self.device.type == "cuda"

    @property
    def status(self) -> torch.Tensor:
        """int32 ``[8]`` status on :attr:`device`, shared by the stash manager. While the step
        runs it is the current status (NOTE [current step] in ``graphstash/status.py``), so
        MoE dispatch and the expert GEMMs raise their flags in it without ``status=``."""
        return self.step_status.tensor

    @property
    def step_status(self):
        """The :class:`~graphstash.status.StepStatus` that owns :attr:`status`: register an
        expert-parallel transport on it (``register_reducer``) to combine the flags across
        ranks through that transport (NOTE [flags across ranks])."""
        if self._status is None:
            manager = self._stash_manager_if_given()
            self._status = (StepStatus.adopt(manager.status) if manager is not None
                            else StepStatus(self.device))
        return self._status

    def _stash_manager_if_given(self):
        arg = self._stash_arg
        if not isinstance(arg, StepParticipant):
            return None
        self._manager = arg
        return arg

    @property
    def stash_manager(self):
        """The :class:`graphstash.stash.StashManager` of the step (None without ``stash=``)."""
        self._setup()
        return self._manager

    def _setup(self) -> None:
        if self._ready:
            return
        dev = self.device
        status = self.status
        if self._manager is None and self._stash_arg not in (None, False):
            from ..stash import StashConfig, StashManager   # lazily: graph does not need stash

            config = StashConfig() if self._stash_arg is True else self._stash_arg
            if not isinstance(config, StashConfig):
                raise TypeError(f"stash: expected a graphstash.StashConfig, a StashManager (or "
                                f"another StepParticipant), True or None, got "
                                f"{type(config).__name__}")
            self._manager = StashManager(config, device=dev, status=status)
        if self.optimizer is not None:
            self._update = DeviceUpdate(self.optimizer, scaler=self.scaler, mode=self._update_skip,
                                        device=dev)
            self._hyper = ScheduledHyperparameters(self.optimizer, dev)
        self._stats.mode = "graph" if self.graphed else "eager"
        if dev.type == "cuda" and self.optimizer is not None:
            check_optimizer(self.optimizer)       # before any step runs, not at capture time
        if dev.type == "cuda":
            for i, gen in enumerate(self._generators):
                if gen.device.type != "cuda":
                    raise ValueError(f"generators[{i}]: expected a CUDA torch.Generator (the "
                                     f"graph registers its state), got one on {gen.device}")
        self._setup_data_parallel()
        if dev.type == "cuda":
            self._flags_host = torch.zeros(3 + MAX_STEP_PEAKS, dtype=torch.int32,
                                           pin_memory=True)
            self._flags_view = self._flags_host.numpy()
            self._done_event = torch.cuda.Event()
            self._capture_stream = torch.cuda.Stream(device=dev)
        else:
            self._flags_host = torch.zeros(3 + MAX_STEP_PEAKS, dtype=torch.int32)
            self._flags_view = self._flags_host.numpy()
            if not self._warned_eager:
                self._warned_eager = True
                why = ("CUDA is not available" if not torch.cuda.is_available()
                       else f"the step runs on {dev}")
                warnings.warn(f"graphstash.graph_step({self._name}): {why}, so the step runs "
                              "eagerly without a CUDA graph; stats still count its steps",
                              RuntimeWarning, stacklevel=4)
        self._ready = True

    def _setup_data_parallel(self) -> None:
        """Find DDP modules holding the optimizer's parameters and meet their conditions
        (NOTE [DDP]): refuse what cannot capture, warm up >= 11 eager steps."""
        found = find_ddp(self.optimizer)
        for ddp in found:
            check_ddp(ddp)
            if self.graphed:
                quiet_sampling(ddp)
                if self._ddp_stream is None:
                    self._ddp_stream = torch.cuda.Stream()
                why = rebuild_on_side_stream(ddp, self._ddp_stream)
                if why is not None:
                    self._say_once("ddp_stream", f"graphstash.graph_step({self._name}): the "
                                   f"DistributedDataParallel module was left as it was built "
                                   f"({why}); if it was built on the default stream, the "
                                   "capture will fail: construct it inside `with "
                                   "torch.cuda.stream(torch.cuda.Stream()):` (NOTE [DDP])")
        self._ddp = found
        if found and self._warmup_steps < DDP_WARMUP:
            self._warmup_steps = DDP_WARMUP
            self._say_once("ddp", f"graphstash.graph_step({self._name}): the optimizer's "
                           f"parameters belong to a DistributedDataParallel module, so "
                           f"{DDP_WARMUP} eager steps run before the capture (warmup="
                           f"{self.warmup} was given; NOTE [DDP])")

    def _distributed(self) -> bool:
        if self._distributed_arg is False:
            return False
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        if self._distributed_arg is True and not on:
            raise ValueError("distributed: True, but torch.distributed is not initialised")
        return on

    def _say_once(self, kind: str, message: str) -> None:
        """One RuntimeWarning per kind per step function."""
        if kind not in self._said:
            self._said.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ---- public -------------------------------------------------------------------------
    @property
    def stats(self) -> GraphStepStats:
        """A snapshot of the counters (see :class:`GraphStepStats`). Syncs for the stash peak."""
        st = dataclasses.replace(self._stats)
        st.graphs = len(self._graphs)
        st.graph_bytes = sum(g.nbytes for g in self._graphs.values())
        st.status_wait_us = (1e6 * self._status_wait_s / st.replays) if st.replays else 0.0
        if self._device is not None and self._device.type == "cuda":
            st.peak_memory_bytes = torch.cuda.max_memory_allocated(self._device)
        if self._manager is not None and not self._released:
            st.stash_pages_peak = self._manager.peak()
        return st

    @property
    def warmup_steps(self) -> int:
        """Eager steps before the first capture: ``warmup``, or 11 when the optimizer's
        parameters belong to a DistributedDataParallel module (NOTE [DDP]; known after the
        first call)."""
        return self._warmup_steps

    @property
    def data_parallel(self) -> tuple:
        """The ``DistributedDataParallel`` modules found holding the optimizer's parameters
        (after the first call; empty without ``torch.distributed``)."""
        return self._ddp

    @property
    def scheduled_lr(self) -> dict:
        """``{param group index: 0-dim float32 tensor}``: the groups whose lr reaches the graph
        as a device tensor and the tensors holding it (NOTE [scheduled hyperparameters]). The
        values are written before each replay (on the CPU, before each call that would replay)."""
        return {} if self._hyper is None else self._hyper.tensors

    def captured_graphs(self) -> list[GraphInfo]:
        """The graphs held now, least recently used first (:class:`GraphInfo`).

        Example::

            for info in train_step.captured_graphs():
                print(info.inputs, info.nbytes / 2**20, "MiB")
        """
        return [GraphInfo(inputs=g.described, nbytes=g.nbytes, graph=g.graph)
                for g in self._graphs.values()]

    @property
    def last_replay(self) -> ReplayInfo | None:
        """The last replay's flags, status wait and done event (:class:`ReplayInfo`); None
        before the first replay."""
        return self._last_replay

    def read_flags(self) -> tuple[int, int, int]:
        """Wait for the current stream and read the flags the last replay copied to the host:
        ``(overflow, host_spill, over_budget)``. This is what every replay does after launching
        its graph (NOTE [status readback]); tools time it (CUDA only, after a replay)."""
        if self._done_event is None:
            raise ValueError(f"{self._name}: read_flags() reads what a replay copied to the "
                             f"host; this step has not run on a CUDA device")
        self._done_event.record()
        self._done_event.synchronize()
        view = self._flags_view
        return int(view[0]), int(view[1]), int(view[2])

    def release(self) -> None:
        """Drop the graphs, their memory pools, static buffers, gradients and stash buffers.

        The status tensor (32 bytes) stays, so references to it remain valid. Call
        :meth:`reset` before the next call.

        Example::

            train_step.release()      # memory_allocated back to its pre-capture value
            train_step.reset()
            train_step(x, y)          # captures again
        """
        forbid_capture("GraphStep.release()")
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._forget_captures()
        if self._update is not None:
            self._update.release()
        if self._manager is not None:
            self._manager.release()
        self._released = True
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.empty_cache()

    def reset(self) -> None:
        """Reallocate what :meth:`release` dropped (stash buffers); the next call captures again."""
        forbid_capture("GraphStep.reset()")
        if not self._released:
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self._forget_captures()
        if self._manager is not None and self._released:
            self._manager.reallocate()
        self._released = False

    def _forget_captures(self) -> None:
        """Drop every graph and what the captures recorded (signature, baked values, state)."""
        self._drop_graphs()
        self._first_signature = None
        self._forget_bindings()

    def _forget_bindings(self) -> None:
        self._cpu_inputs.clear()
        self._baked = None
        if self._held is not None:
            self._held.close()
            self._held = None

    def _invalidate(self) -> None:
        """Drop the graphs because something they baked in changed; the next call recaptures."""
        self._drop_graphs()
        self._forget_bindings()
        self._stats.invalidations += 1

    def __call__(self, *args, **kwargs):
        if self._released:
            raise ReleasedError(f"{self._name}: the step was released; call .reset() first")
        forbid_capture(f"{self._name}()")
        self._refuse_nesting()
        self._setup()
        self._check_held_state()
        self._check_hyperparameters()
        self._check_budgets()
        if self._eager_done < self._warmup_steps or self._eager_pending:
            return self._eager_call(args, kwargs)
        if not self.graphed:
            return self._cpu_call(args, kwargs)
        leaves, spec = S.flatten_call(args, kwargs)
        sig = S.signature(leaves, spec)
        entry = self._graphs.get(sig)
        if entry is None:
            self._refuse_new_signature(sig, args, kwargs)
            if self._eager_signatures.needs_eager_call(sig):    # NOTE [compile and capture]
                return self._eager_call(args, kwargs, sig)
            entry = self._capture(sig, leaves, spec, args, kwargs)
        else:
            self._graphs[sig] = self._graphs.pop(sig)     # most recently used last
        out = self._replay(entry, leaves, args, kwargs)
        if isinstance(out, _RerunByCapture):
            del entry           # the flagged graph's memory goes first (NOTE [rerun by capture])
            return self._rerun_by_capture(sig, leaves, spec, args, kwargs, out)
        return out

    def _refuse_nesting(self) -> None:
        running = getattr(_RUNNING, "steps", None)
        if running:
            raise ValueError(
                f"fn: {running[-1]._name} called {self._name}, another graph_step step, from "
                "inside its step function; steps cannot nest (a capture cannot contain another "
                "capture, and the inner update would be the outer step's). Call the inner "
                "function undecorated (NOTE [steps that never ran])")

    def _eager_call(self, args, kwargs, sig=None):
        """A call run eagerly on purpose (warmup, the eager step after replaced state, the first
        call of a new signature once torch.compile is in use), counted when its update is
        applied; the signatures that ran eagerly are recorded (NOTE [compile and capture])."""
        if sig is None:
            try:
                sig = S.signature(*S.flatten_call(args, kwargs))
            except TypeError:       # warmup calls take what a capture would refuse (numpy, ...)
                sig = None
        steps = self._stats.steps
        try:
            return self._eager_step(args, kwargs, side_stream=self.graphed)
        finally:
            if self._stats.steps > steps:    # the update was applied (NOTE [transactional rerun])
                self._eager_done += 1
                self._stats.eager_steps += 1
                self._eager_pending = max(0, self._eager_pending - 1)
                if sig is not None:
                    self._eager_signatures.ran(sig)

    @contextlib.contextmanager
    def _compiles_refused(self, enabled: bool = True):
        """While set, the step function's non-dropless runs refuse torch.compile compiles
        (NOTE [compile and capture]); the dropless rerun may compile."""
        previous, self._refuse_compiles = self._refuse_compiles, enabled
        try:
            yield
        finally:
            self._refuse_compiles = previous

    # ---- between calls: replaced state, changed hyperparameters -------------------------
    def _check_held_state(self) -> None:
        """NOTE [checkpoint and resume]: refuse a replaced model Parameter; copy replaced
        optimizer state into the tensors the graphs hold, or drop the graphs."""
        held = self._held
        if held is None:
            return
        replaced = held.replaced_parameter()
        if replaced is not None:
            raise ValueError(f"{self._name}: {replaced}")
        reason, self._stale = self._stale, None
        if reason is None:
            reason, copied = held.reconcile()
            if copied:
                self._say_once("state-copied", f"graphstash.graph_step({self._name}): the "
                               f"optimizer state of {copied} parameter(s) was replaced after the "
                               "capture; the new values were copied into the tensors the graph "
                               "updates, which optimizer.state holds again "
                               "(NOTE [checkpoint and resume])")
        if reason is None:
            return
        self._say_once("state", f"graphstash.graph_step({self._name}): {reason}; the graphs are "
                       "dropped, one eager step runs and the next call recaptures (NOTE "
                       "[checkpoint and resume])")
        self._invalidate()
        self._eager_pending = 1

    # NOTE [budgets the step adapts]
    # The adaptive dispatch budgets (NOTE [adaptive budgets] in graphstash/moe/budgets.py)
    # measure their layers' needs as step peaks (NOTE [step peaks]); the step hands them over
    # after every step it read the flags of, and after an over-budget step (rerun dropless,
    # its update applied once, the stash grown) they grow. A graph bakes the budgets in, so a
    # call that finds an owner's version changed since the last one drops the graphs and runs
    # one eager step first: at the new sizes an expert-parallel exchange may need a larger
    # region, which is built by a collective at an eager forward, and a compiled model
    # recompiles there. The stash keeps its plan (NOTE [stash plan] says why). The next call
    # recaptures. ``on_overflow`` runs after the growth; returning False vetoes it
    # (the budgets are restored), and it may set budgets itself.
    def _check_budgets(self) -> None:
        if self._manager is not None and self._manager.take_grow_ahead():
            # NOTE [stash growth ahead]
            if self.graphed:
                self._drop_graphs()
            self._manager.grow(self._budget_growth)
            self._stats.stash_grown_ahead += 1
        changed = self._owners_changed()
        for key, (version, _) in self.step_status.owner_versions().items():
            self._versions_baked[key] = version
        if not changed:
            return
        if self._first_signature is not None:
            self._stats.budget_changes += 1
        if self.graphed:
            self._drop_graphs()
        # eager: a compiled model recompiles for the new sizes here, never inside a capture
        self._eager_pending = max(self._eager_pending, 1)

    def _owners_changed(self) -> bool:
        """Whether a peak owner's version moved since the graphs baked it in (NOTE [budgets
        the step adapts])."""
        return any(version != self._versions_baked.get(key, first)
                   for key, (version, first) in self.step_status.owner_versions().items())

    def _check_hyperparameters(self) -> None:
        """NOTE [scheduled hyperparameters]: adopt changed lrs as device tensors; a changed
        baked value drops the graphs (said once)."""
        hyper = self._hyper
        if hyper is None:
            return
        adopted = hyper.observe()
        if self._baked is None:
            return
        baked = hyper.baked()
        if baked == self._baked:
            return
        changes = hyper.changes(self._baked, baked)
        if changes:
            group, key, old, new = changes[0]
            self._say_once(f"baked-{key}", f"graphstash.graph_step({self._name}): param group "
                           f"{group}'s {key} changed from {old!r} to {new!r}; "
                           + self._why_baked(key))
        elif adopted:
            group, old, new = adopted[0]
            self._say_once("lr-adopted", f"graphstash.graph_step({self._name}): param group "
                           f"{group}'s lr changed from {old!r} to {new!r}; from now on the lr "
                           "reaches the graph as a float32 device tensor written before each "
                           "replay, so later changes cost no capture (this call recaptures once; "
                           "NOTE [scheduled hyperparameters])")
        self._invalidate()

    def _why_baked(self, key: str) -> str:
        name = type(self.optimizer).__name__
        if key == "lr":
            return (f"{name} reads lr as a number baked into the graph unless it is built with "
                    "fused=True, so every change recaptures; construct it with fused=True to "
                    "keep one graph (NOTE [scheduled hyperparameters])")
        if key in ("betas", "momentum"):
            return ("it is a number baked into the graph (torch's kernels take only lr as a "
                    "tensor), so every change recaptures; a scheduler that cycles it (OneCycleLR, "
                    "CyclicLR) keeps one graph with cycle_momentum=False "
                    "(NOTE [scheduled hyperparameters])")
        return ("it is a number baked into the graph, so every change recaptures (NOTE "
                "[scheduled hyperparameters])")

    def _refuse_new_signature(self, sig, args, kwargs) -> None:
        """ValueError naming the argument when ``sig`` differs from the first captured one
        (unless ``on_new_shape='recapture'``)."""
        if (self._first_signature is not None and sig != self._first_signature
                and self._on_new_shape == "error"):
            raise ValueError(
                f"{self._name}: " + S.describe_mismatch(self._first_signature, sig, args, kwargs)
                + ". Pass inputs of the captured shapes, or decorate with "
                "graph_step(..., on_new_shape='recapture') to keep a graph per shape")

    # NOTE [same contract on the CPU]
    # Without CUDA every call runs eagerly, but a step that a GPU run would refuse must not pass
    # silently here: CPU tests and CPU users would never learn of it. From the call that would
    # capture on, each call goes the way a replay goes: its arguments are flattened (what a graph
    # cannot take is refused), its tensors are staged into the static buffers of its signature,
    # and the step runs on the arguments rebuilt around those buffers, so a value the staging
    # missed would be seen stale here as on the GPU. A change of shapes (or of a non-tensor
    # argument) raises the same ValueError (``on_new_shape='recapture'`` keeps inputs per shape,
    # as there); only a call that completed fixes the signature, as only a capture that
    # succeeded does. Changed hyperparameters and replaced state are handled as for graphs, and
    # counted in stats.invalidations. An optimizer that cannot be captured only warns, once:
    # torch's CPU optimizers cannot be made capturable, so refusing would break legitimate CPU
    # training.
    def _cpu_call(self, args, kwargs):
        leaves, spec = S.flatten_call(args, kwargs)
        sig = S.signature(leaves, spec)
        inputs = self._cpu_inputs.get(sig)
        new = inputs is None
        if new:
            self._refuse_new_signature(sig, args, kwargs)
            self._warn_contract_once()
            inputs = S.StaticInputs(leaves, spec, (args, kwargs))
        else:
            self._cpu_inputs[sig] = self._cpu_inputs.pop(sig)
        inputs.stage(leaves)
        if self._hyper is not None:
            self._hyper.write()          # as before a replay: the bookkeeping, floats stay in use
        static_args, static_kwargs = inputs.args_kwargs()
        # where a GPU run would capture, a compile is refused as in the capture; a signature
        # that never ran eagerly runs once first, as there (NOTE [compile and capture])
        first = self._eager_signatures.needs_eager_call(sig)
        steps = self._stats.steps
        try:
            with self._compiles_refused(not first):
                out = self._eager_step(static_args, static_kwargs, by_capture=not first)
        except RuntimeError as exc:
            if not first and compile_guard.is_refusal(exc):
                raise capture_errors.capture_error(exc, self._name, eager=True) from exc
            raise
        finally:
            if self._stats.steps > steps:       # completed (NOTE [transactional rerun])
                self._stats.eager_steps += 1
                self._eager_signatures.ran(sig)
                if new:
                    self._cpu_inputs[sig] = inputs
                    self._evict(self._cpu_inputs, sig)
                    self._captured(sig)
        return S.clone_tree(out) if self._outputs_mode == "clone" else out

    def _warn_contract_once(self) -> None:
        if self._warned_contract:
            return
        self._warned_contract = True
        try:
            self._check_capturable()
        except ValueError as exc:
            warnings.warn(f"graphstash.graph_step({self._name}): on a CUDA device this step would "
                          f"be refused: {exc} (code that builds the optimizer capturable only on "
                          "CUDA may filter this warning)", RuntimeWarning, stacklevel=5)

    def _captured(self, sig) -> None:
        """Record what a completed capture fixes: the first signature, the hyperparameters it
        baked, the optimizer state it holds."""
        if self._first_signature is None:
            self._first_signature = sig
        if self._hyper is not None and self._baked is None:
            self._baked = self._hyper.baked()
        if self.optimizer is not None and self._held is None and has_state(self.optimizer):
            self._held = CapturedState(self.optimizer)

    # ---- eager --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _step_fn_running(self):
        """While the step function runs, ``optimizer.step()`` is refused (NOTE [step ownership])
        and so is another GraphStep (NOTE [steps that never ran])."""
        self._fn_running = True
        stack = getattr(_RUNNING, "steps", None)
        if stack is None:
            stack = _RUNNING.steps = []
        stack.append(self)
        try:
            with step_running():
                yield
        finally:
            stack.pop()
            self._fn_running = False

    def _call_fn(self, args, kwargs, *, is_dropless: bool):
        """The step function, refused if it did not run (NOTE [steps that never ran])."""
        with self._step_fn_running():
            out = self._run_fn(args, kwargs, is_dropless=is_dropless)
        _refuse_unrun_result(out, self._name)
        return out

    def _lr_tensors(self):
        """On CUDA, the scheduled lr tensors in the param groups while the update runs (NOTE
        [scheduled hyperparameters]); on the CPU the floats stay."""
        if self._hyper is None or not self.graphed:
            return contextlib.nullcontext()
        self._hyper.write()
        return self._hyper.in_groups()

    def _apply_update(self) -> None:
        """The eager update of a step, counted as it is applied (NOTE [transactional rerun])."""
        if self._update is not None:
            with self._lr_tensors():
                self._update.eager_step()
        self._stats.steps += 1

    def _clear_flags(self) -> None:
        self.step_status.clear_flags()

    def _reduced_flags(self) -> torch.Tensor:
        """int32 [3 + peaks]: indicators of overflow, host spill, over budget (summed over
        ranks: NOTE [flags across ranks] in graphstash/status.py), then the step's peaks
        (their maximum over ranks: NOTE [step peaks])."""
        return self.step_status.reduced_flags(distributed=self._distributed_arg,
                                              process_group=self._process_group)

    def _run_fn(self, args, kwargs, *, is_dropless: bool):
        manager = self._manager
        refuse = self._refuse_compiles and not is_dropless        # NOTE [compile and capture]
        with dropless(is_dropless), self.step_status.activate(), \
                compile_guard.refusing_compiles(refuse), \
                compile_guard.running_uncompiled(is_dropless):    # NOTE [current step]
            if manager is None:
                return self._fn(*args, **kwargs)
            with manager:
                manager.begin_step()
                out = self._fn(*args, **kwargs)
                manager.end_step(check=False)     # the flags are read by the caller
            return out

    def _rng_offsets(self) -> list:
        if self.device.type != "cuda":
            return [(torch.default_generator, torch.default_generator.get_state())]
        gens = [torch.cuda.default_generators[self.device.index], *self._generators]
        return [(g, g.get_offset()) for g in gens]

    @staticmethod
    def _restore_rng(saved: list) -> None:
        for gen, value in saved:
            if isinstance(value, torch.Tensor):
                gen.set_state(value)
            else:
                gen.set_offset(value)

    def _eager_step(self, args, kwargs, *, side_stream: bool = False, by_capture: bool = False):
        """One guarded eager step: run, read the flags, rerun dropless if flagged, update once.
        ``by_capture``: the step stands for a replay (NOTE [same contract on the CPU]), so a
        stash overflow runs it again with the grown stash instead (NOTE [rerun by capture])."""
        if side_stream:
            stream, current = self._capture_stream, torch.cuda.current_stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                out = self._eager_step(args, kwargs)
            current.wait_stream(stream)
            return out
        saved_rng = self._rng_offsets()
        self._zero_grad()
        self._clear_flags()
        out = self._call_fn(args, kwargs, is_dropless=False)
        reduced = self._reduced_flags().tolist()
        overflow, spill, over_budget = reduced[:3]
        self._count_flags(overflow, spill, over_budget)
        if overflow or over_budget:
            self._restore_rng(saved_rng)
            flags, peaks = (overflow, spill, over_budget), reduced[3:]
            if by_capture and self._reruns_by_capture(overflow, over_budget):
                if self._grow_for_rerun_by_capture(peaks):
                    return self._eager_step(args, kwargs)     # as the new graph's replay
                return self._rerun(args, kwargs, flags, regraph=False, peaks=peaks,
                                   delivered=True)
            return self._rerun(args, kwargs, flags, regraph=False, peaks=peaks)
        out = S.detach_tree(out)
        self._apply_update()
        self.step_status.deliver_peaks(reduced[3:], flagged=False)
        return out

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._grads_of = None

    def _bind_grads(self, entry: _Graph) -> None:
        """Point every ``p.grad`` at the gradient ``entry``'s graph writes (NOTE [gradients])."""
        if self._grads_of is entry:
            return
        for p, g in entry.grads:
            p.grad = g
        self._grads_of = entry

    def _grads_into(self, entry: _Graph) -> list:
        """Hooks that move each gradient an eager pass accumulates into ``entry``'s own tensor
        (NOTE [gradients]); the caller removes them."""
        if self._ddp:
            return []

        def into(param, g):
            if param.grad is not g:
                g.copy_(param.grad)
                param.grad = g

        return [p.register_post_accumulate_grad_hook(functools.partial(into, g=g))
                for p, g in entry.grads]

    def _count_flags(self, overflow: int, spill: int, over_budget: int) -> None:
        self._stats.overflows += bool(overflow)
        self._stats.host_spills += bool(spill)
        self._stats.over_budget += bool(over_budget)

    def _rerun(self, args, kwargs, flags: tuple, *, regraph: bool, peaks=(),
               finish=S.detach_tree, entry: _Graph | None = None, delivered: bool = False):
        """Rerun a flagged step eagerly in dropless mode, grow the budget, apply its update.

        ``finish`` turns the step's outputs into what the call returns; it runs before the
        update (NOTE [transactional rerun]). ``peaks`` are the flagged step's (NOTE [step
        peaks]): the adaptive budgets grow from them (NOTE [budgets the step adapts]).
        ``entry``: the replayed graph, whose gradient tensors the rerun writes (NOTE
        [gradients]). ``delivered``: the peaks were handed over already (NOTE [rerun by
        capture]), and there is no ``on_overflow`` to veto them.
        """
        self._stats.eager_reruns += 1
        self._zero_grad()
        self._clear_flags()
        freed = self._free_stash(flags)
        hooks = self._grads_into(entry) if entry is not None else []
        try:
            out = self._call_fn(args, kwargs, is_dropless=True)
        finally:
            for hook in hooks:
                hook.remove()
            if freed:
                self._manager.reallocate()
        self._clear_flags()
        status = self.step_status
        before = [] if delivered else [(owner, owner.state_dict())
                                       for owner, _ in status.raised_peaks(peaks)]
        if not delivered:
            status.deliver_peaks(peaks, flagged=True)   # the stash's fill, before it grows
        grown = self._grow_budget(overflowed=bool(flags[0] or flags[1]))
        out = finish(out)
        self._apply_update()
        if self._on_overflow is None:
            if grown and regraph:
                self._graphs.clear()        # the next call recaptures with the grown budget
            return out
        try:
            verdict = self._on_overflow({"overflow": bool(flags[0]),
                                         "host_spill": bool(flags[1]),
                                         "over_budget": bool(flags[2])})
            if verdict is False:            # a veto: the adaptive budgets stay as they were
                for owner, state in before:
                    owner.load_state_dict(state)
        except Exception as exc:
            raise UpdateAppliedError(
                f"on_overflow raised {type(exc).__name__}: {exc}. The step's update was already "
                f"applied (stats.steps counts it): do not run this batch again") from exc
        except BaseException as exc:        # KeyboardInterrupt, SystemExit: keep their type
            exc.add_note("graphstash: the step's update was already applied (stats.steps counts "
                         "it) when on_overflow was interrupted")
            raise
        finally:
            if regraph:
                self._graphs.clear()        # on_overflow may have grown a budget a graph baked
        return out

    # NOTE [rerun memory]: a dropless rerun does not stash (``stash_activations`` does nothing
    # in dropless mode), yet the stash's pages stayed allocated beside the rerun's own
    # activations. Under drifting routing on two H100s (qwen3-30b-a3b widths, capacity factor
    # 2.0, docs/exchange.md, "Rows the stash keeps") the stash row, which reran once, peaked at
    # 8565 MiB of activation against 4383 for the same row without the stash, which never reran.
    # Releasing the pages did not lower that peak (8560 MiB, docs/exchange.md, "A rerun by
    # capture"): the eager step's own memory set it, which NOTE [rerun by capture] avoids for a
    # stash overflow; the release stays for the eager reruns that remain, whose pages would
    # otherwise sit beside them. A step whose stash overflowed or spilled grows the stash after
    # its rerun (NOTE [stash growth]) and every graph is then recaptured, so nothing is lost by
    # freeing the pages before the rerun: the graphs that write them are dropped first (they
    # would be after the growth), the buffers are released, and they come back (``reallocate``)
    # when the rerun ends, raised or not, before the growth re-sizes them. A step only over a
    # dispatch budget keeps its stash and its graphs. The graphs go whether the flagged step was
    # replayed or eager: an eager step of a new signature may run while graphs of others exist,
    # and they wrote the old pages.
    def _free_stash(self, flags: tuple) -> bool:
        """Before a rerun (NOTE [rerun memory]): if the flagged step's stash overflowed or
        spilled, drop the graphs and release the stash's buffers; True if released."""
        manager = self._manager
        if manager is None or not (flags[0] or flags[1]) or manager.released:
            return False
        self._graphs.clear()
        manager.release()
        return True

    def _grow_budget(self, *, overflowed: bool) -> bool:
        """Grow the stash by ``budget_growth``, or to the rows the step asked for where its
        groups keep rows (NOTE [growth to the need] in ``graphstash/stash/plan.py``), after a
        step that overflowed or spilled on some rank (``grow``: NOTE [step protocol], a new
        config, never the user's); True if it grew.

        NOTE [stash growth]: only an overflow or a host spill says the stash was too small. A
        step that was only over a dispatch budget leaves it as it is: its budgets grow instead
        (NOTE [budgets the step adapts]), and if their larger rows then outgrow the stash, that
        step overflows and grows it. Growing on every rerun compounded: with budgets that could
        not grow (a transport's region at the capacity factor), every step of a skewed routing
        reran and multiplied ``device_factor`` by 1.5, to 460 after 15 steps on four gloo ranks
        (16 pages of demand, 8277 pages sized) and to an allocation of 27 GiB for a model of
        hidden 64 after 30 (``graphstash bench moe --ep 4 --device cpu --routing drift``)."""
        if self._manager is None or not overflowed:
            return False
        # NOTE [growth to the need] in graphstash/stash/plan.py
        self._manager.grow(self._manager.growth(self._budget_growth))
        self._stats.stash_growths += 1
        return True

    # NOTE [stash growth ahead]: under a live-row exchange a stashed group's experts compute on
    # the rows its pages hold, ``device_factor`` x the rows of the step the plan measured (NOTE
    # [rows the stash keeps] in graphstash/stash/plan.py), and a step whose routing asks for
    # more overflows and is rerun dropless: an eager step beside the captured one, whose
    # memory set the stash row's peak under skewed routing (docs/exchange.md, "Rows the stash
    # keeps"). While a router trains, the rows a rank's experts get move from step to step.
    # So each such group raises its fill (the rows asked for over the rows kept, in
    # thousandths) as a step peak (NOTE [step peaks]: reduced with the flags, the read the step
    # makes anyway); a step that was not rerun and filled ``GROW_AHEAD`` (0.97) of some group's
    # rows on some rank grows the stash by ``budget_growth`` at the next call, on every rank,
    # before any step overflows it, and recaptures (``stats.stash_grown_ahead``). A routing
    # that jumps past the rows kept in one step still overflows and is rerun, as before.

    # ---- capture ------------------------------------------------------------------------
    def _check_capturable(self) -> None:
        if self.optimizer is None:
            return
        check_optimizer(self.optimizer)
        if not has_state(self.optimizer) and self._eager_done == 0:
            raise ValueError(
                f"warmup: the optimizer has no state yet (it is created by its first step) and "
                f"cannot be created inside a CUDA graph; use warmup >= 1 (got {self.warmup})")

    def _captured_body(self, static_args, static_kwargs):
        self._clear_flags()
        out = self._call_fn(static_args, static_kwargs, is_dropless=False)
        flags = self._reduced_flags()
        self._flags_host[:flags.numel()].copy_(flags, non_blocking=True)
        if self._update is not None:
            flagged = (flags[0] + flags[2]) > 0
            with self._hyper.in_groups():         # NOTE [scheduled hyperparameters]
                self._update.step(flagged)
        return out

    def _capture(self, sig, leaves, spec, args, kwargs) -> _Graph:
        self._check_capturable()
        dev = self.device
        if self._manager is not None:
            self._manager.warmup()
        self._zero_grad()                    # NOTE [gradients]
        if self._hyper is not None:
            self._hyper.write()              # before the capture: the graph reads the tensors
        if self._release_warmup_cache:
            capture_memory.release_warmup_cache(dev)    # NOTE [capture memory]
        if self._stats.memory_before_capture is None:
            self._stats.memory_before_capture = torch.cuda.memory_allocated(dev)
        if self._update is not None:
            self._update.allocate()
        reserved0 = torch.cuda.memory_reserved(dev)
        inputs = S.StaticInputs(leaves, spec, (args, kwargs))
        static_args, static_kwargs = inputs.args_kwargs()
        graph = torch.cuda.CUDAGraph()
        for gen in self._generators:
            if not hasattr(graph, "register_generator_state"):
                raise CaptureError("generators: this torch cannot register extra generators with a "
                                   "CUDA graph (CUDAGraph.register_generator_state is missing); "
                                   "draw from the default CUDA generator instead")
            graph.register_generator_state(gen)
        stream, current = self._capture_stream, torch.cuda.current_stream(dev)
        stream.wait_stream(current)
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(stream):
                torch.cuda.current_blas_handle()        # NOTE [library handles before capture]
                pool = failed_capture.new_pool()        # NOTE [failed capture]
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    with self._compiles_refused():             # NOTE [compile and capture]
                        out = self._captured_body(static_args, static_kwargs)
                except BaseException:
                    failed_capture.abandon_capture(graph, pool, dev, self._generators)
                    raise
                failed_capture.end_capture(graph, pool, dev, self._generators)
        except BaseException as exc:
            del graph, inputs, static_args, static_kwargs
            self._zero_grad()
            try:
                torch.cuda.synchronize(dev)
            except Exception:
                pass
            torch.cuda.empty_cache()
            traceback.clear_frames(exc.__traceback__)   # drop the activations its frames hold
            if isinstance(exc, (_StepCalledError, _NeverRanError)):
                raise                                   # the same error as eagerly
            message, cause = capture_errors.describe(exc, self._name)
            if self._ddp and cause in ("host_sync", "legacy_stream"):
                message += " " + _DDP_HINT[0].upper() + _DDP_HINT[1:] + "."
            raise CaptureError(message, cause=cause) from exc
        current.wait_stream(stream)
        capture_s = time.perf_counter() - t0
        grads = []
        if self.optimizer is not None:
            grads = [(p, p.grad) for g in self.optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
        names = S.leaf_names(args, kwargs)
        described = "; ".join(f"{n}: {x.describe()}" for n, x in zip(names, sig[1]))
        entry = _Graph(signature=sig, graph=graph, inputs=inputs, outputs=S.detach_tree(out),
                       grads=grads, nbytes=max(0, torch.cuda.memory_reserved(dev) - reserved0),
                       described=described)
        _LIVE_GRAPHS.add(graph)
        self._stats.captures += 1
        self._stats.capture_ms += 1e3 * capture_s
        self._captured(sig)
        self._graphs[sig] = entry
        self._grads_of = entry                  # p.grad: what its capture wrote
        self._evict(self._graphs, sig)
        return entry

    def _evict(self, store: dict, keep) -> None:
        def over() -> bool:
            if len(store) > self._max_graphs:
                return True
            budget = self._graph_memory_budget
            return (store is self._graphs and budget is not None
                    and sum(g.nbytes for g in store.values()) > budget)

        while len(store) > 1 and over():
            victim = next(k for k in store if k != keep)
            del store[victim]

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._zero_grad()

    # ---- replay -------------------------------------------------------------------------
    def _replay(self, entry: _Graph, leaves, args, kwargs, *, by_capture: bool = True):
        """Replay ``entry`` on ``leaves``; a flagged replay is rerun eagerly, or, where NOTE
        [rerun by capture] applies and ``by_capture``, returns a :class:`_RerunByCapture` for
        the caller, which drops its own reference to ``entry`` first."""
        entry.inputs.stage(leaves)
        if self._hyper is not None:
            self._hyper.write()              # NOTE [scheduled hyperparameters]
        saved_rng = self._rng_offsets()
        entry.graph.replay()
        t0 = time.perf_counter()
        self._done_event.record()
        self._done_event.synchronize()
        view = self._flags_view
        overflow, spill, over_budget = (int(v) for v in view[:3])
        peaks = view[3:3 + MAX_STEP_PEAKS].tolist()
        waited = time.perf_counter() - t0
        self._status_wait_s += waited
        self._stats.replays += 1
        self._last_replay = ReplayInfo(
            flags={"overflow": bool(overflow), "host_spill": bool(spill),
                   "over_budget": bool(over_budget)},
            status_wait_us=1e6 * waited, done_event=self._done_event)
        self._count_flags(overflow, spill, over_budget)
        if overflow or over_budget:
            self._restore_rng(saved_rng)
            if by_capture and self._reruns_by_capture(overflow, over_budget):
                return _RerunByCapture((overflow, spill, over_budget), peaks)
            return self._rerun(args, kwargs, (overflow, spill, over_budget), regraph=True,
                               peaks=peaks, finish=functools.partial(self._rerun_outputs, entry),
                               entry=entry)
        self._stats.steps += 1                  # the graph applied the update
        self._bind_grads(entry)                 # NOTE [gradients]
        self.step_status.deliver_peaks(peaks, flagged=False)
        if self._outputs_mode == "static":
            return entry.outputs
        return S.clone_tree(entry.outputs)

    # NOTE [rerun by capture]: a replay whose stash overflowed (and whose dispatch kept every
    # row) is not rerun eagerly. The stash grows (or steps aside: NOTE [growth to the need] in
    # graphstash/stash/plan.py) and the graphs would be recaptured at the next call anyway; the
    # rerun is that capture, made now, on the same inputs, and its replay. An eager step holds
    # more than a captured one: under drifting routing on two H100s (qwen3-30b-a3b widths,
    # capacity factor 2.0) the stash row's one eager rerun peaked at 8560 MiB of activation, its
    # pages released, against 4383 for the same row without the stash, which never reran
    # (docs/exchange.md, "Rows the stash keeps"): the rerun, not the stash, set the row's peak.
    # The flagged graph and its gradients are dropped before the stash grows and the step is
    # captured again, so the rerun's peak is a capture's. The replay is the step's one update
    # (NOTE [transactional rerun]); the random state is the flagged replay's, restored. If that
    # replay overflows too, the eager dropless rerun follows as before (a count out of range,
    # which no stash fixes, shares the overflow flag). A step over a dispatch budget reruns
    # eagerly (dropless: no graph can hold its rows), and so does every flagged step with
    # ``on_overflow`` (it may change what a graph bakes), and a step whose peaks changed
    # something a graph bakes in (an adaptive budget that shrank as they were handed over):
    # those sizes first run one eager step (NOTE [budgets the step adapts]), which the eager
    # rerun is. Every rank reads the same reduced flags and peaks and takes the same branch.
    # Without CUDA, a call past the warmup stands for a replay (NOTE [same contract on the
    # CPU]): the stash grows the same way and the step runs again eagerly with it, not dropless,
    # counted in ``capture_reruns`` as on a GPU.
    def _reruns_by_capture(self, overflow: int, over_budget: int) -> bool:
        return (bool(overflow) and not over_budget and self._manager is not None
                and self._on_overflow is None)

    def _rerun_by_capture(self, sig, leaves, spec, args, kwargs, flagged: _RerunByCapture):
        """NOTE [rerun by capture]: grow the stash, capture the step again and replay it; or
        the eager rerun, where the peaks changed what a graph bakes in."""
        if not self._grow_for_rerun_by_capture(flagged.peaks):
            entry = self._graphs[sig]
            return self._rerun(args, kwargs, flagged.flags, regraph=True, peaks=flagged.peaks,
                               finish=functools.partial(self._rerun_outputs, entry),
                               entry=entry, delivered=True)
        entry = self._capture(sig, leaves, spec, args, kwargs)
        return self._replay(entry, leaves, args, kwargs, by_capture=False)

    def _grow_for_rerun_by_capture(self, peaks) -> bool:
        """Hand over a stash-overflowed step's peaks; unless they moved what a graph bakes in
        (then False: the eager rerun, with the peaks delivered), drop the graphs and grow the
        stash for the step to run again (NOTE [rerun by capture])."""
        self.step_status.deliver_peaks(peaks, flagged=True)   # the stash's fill, before it grows
        if self._owners_changed():
            return False
        self._stats.capture_reruns += 1
        self._drop_graphs()
        self._grow_budget(overflowed=True)
        return True

    def _rerun_outputs(self, entry: _Graph, out):
        """What a call returns after a rerun: the static outputs overwritten, or copies."""
        if self._outputs_mode == "static" and S.copy_tree_into(entry.outputs, out):
            return entry.outputs
        return S.clone_tree(out) if self._outputs_mode == "clone" else S.detach_tree(out)


GraphStep.__init__.__signature__ = keyword_signature([
    inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    inspect.Parameter("fn", inspect.Parameter.POSITIONAL_OR_KEYWORD)])


# NOTE [library handles before capture]
# cuBLAS creates its handle the first time a thread multiplies on a device, and cublasCreate
# cannot run while a stream captures (CUBLAS_STATUS_NOT_INITIALIZED, measured on an H200 with
# torch 2.11). A warmup step creates it; with warmup=0 a process whose first matmul is the
# captured one would fail. So the capture asks for the handle on its own stream first: that
# creates it, and binds the workspace for the capture stream outside the capture.


def _refuse_step(owner_ref, optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: refuse ``step()`` from inside the step function."""
    owner = owner_ref()
    if owner is not None and owner._fn_running:
        raise _StepCalledError(
            f"fn: {owner._name} called {type(optimizer).__name__}.step() itself; graph_step "
            "owns optimizer.step() and optimizer.zero_grad() (and a GradScaler's step() and "
            "update()) and applies the update once per call, so it would be applied twice. "
            "Remove the call from the step function (NOTE [step ownership])")


def _after_load(owner_ref, optimizer) -> None:
    """Optimizer load_state_dict post-hook: copy the loaded state into the tensors the graphs
    hold, or mark them stale (NOTE [checkpoint and resume])."""
    owner = owner_ref()
    if owner is not None and owner._held is not None:
        reason, _ = owner._held.reconcile()
        if reason is not None:
            owner._stale = reason


def _remove_hooks(hooks) -> None:
    for hook in hooks:
        hook.remove()


def graph_step(fn=None, **options):
    """Capture a whole training iteration (forward, backward, optimizer step) in a CUDA graph.

    The decorated function runs forward and backward (``loss.backward()`` or
    ``scaler.scale(loss).backward()``) and returns tensors (in any of the containers its
    arguments may use); the decorator owns ``optimizer.zero_grad()`` and ``optimizer.step()``
    (NOTE [gradients]). The first ``warmup`` calls run eagerly, the next one captures, later
    ones copy their tensors into the static buffers and replay. Each replay reads the step's
    device status once (NOTE [status readback]); when it says overflow or over budget, the
    update was skipped on the device (NOTE [update skipping]), the same inputs run again
    eagerly under :func:`graphstash.dropless`, the update is applied once, the stash budget
    grows by ``budget_growth`` and the next call recaptures; where only the stash overflowed,
    the stash grows and the same inputs run again through a new capture of the step (NOTE
    [rerun by capture]). Without CUDA every call runs eagerly (one warning says so) with the
    same ``stats``.

    Args:
        fn: the training step: a plain function (a generator or async function is refused:
            NOTE [steps that never ran]). Its arguments may be tensors, and lists, tuples, dicts,
            Mappings (transformers' ``BatchEncoding``), dataclasses and attrs classes holding
            tensors (for example one entry per microbatch): every tensor is staged, everything
            else is compared by value and baked into the graph; what cannot be compared (a numpy
            array, an arbitrary object) is refused naming its path (NOTE [what a step may take]).
        optimizer: a ``torch.optim`` Adam/AdamW (``capturable=True``; ``fused=True`` is
            fastest) or SGD; None for a step without an update. A float ``lr`` that a scheduler
            changes reaches the graph as a device tensor (NOTE [scheduled hyperparameters]);
            ``load_state_dict`` on it, or on the model, takes effect in the captured graph (NOTE
            [checkpoint and resume]).
        scaler: an optional ``torch.amp.GradScaler`` (fp16); the decorator calls its
            ``step``/``update`` (``unscale_`` inside the step is fine).
        warmup: eager calls before the first capture (>= 1 when the optimizer has no state;
            11 at least with DistributedDataParallel: NOTE [DDP]).
        stash: a :class:`graphstash.stash.StashConfig` or ``StashManager``; the step runs with
            it as the default manager, sized from the warmup's demand.
        outputs: ``"clone"`` returns detached copies; ``"static"`` returns the graph's own
            output tensors, overwritten by the next call.
        on_new_shape: ``"error"`` raises ValueError naming the argument; ``"recapture"`` keeps
            up to ``max_graphs`` graphs (and ``graph_memory_budget`` bytes), least recently
            used dropped first.
        budget_growth: finite factor > 1 the stash grows by after a rerun of a step that
            overflowed or spilled, not of one only over a dispatch budget (NOTE [stash growth];
            ``StashManager.grow``: a new config with ``device_factor x budget_growth``, or
            ``host_factor`` for a host-only stash; the config passed in is not changed).
        on_overflow: optional ``callable(flags: dict)`` called after a rerun applied its
            update and the adaptive dispatch budgets grew (NOTE [budgets the step adapts]; it
            may set budgets itself, ``model.budgets.set_factor(...)``); returning ``False``
            vetoes the growth (the budgets are restored as they were before the step); graphs
            are recaptured afterwards. With it, every flagged step reruns eagerly (NOTE [rerun
            by capture] says when one without it does not). If it raises, the call raises
            :class:`graphstash.UpdateAppliedError` (the update was applied: do not retry the
            batch).
        generators: extra CUDA ``torch.Generator`` objects the step draws from (a list or
            tuple, or one generator; the default one is always registered with the graph).
        process_group / distributed: flags are all-reduced over this group when
            ``torch.distributed`` is initialised (``distributed="auto"``).
        update_skip: ``"auto"``, ``"found_inf"`` or ``"mask"`` (NOTE [update skipping]).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` (default: the
            optimizer's parameters).
        release_warmup_cache: before a capture, synchronize the device and give the ordinary
            pool's free blocks back to it (NOTE [capture memory]). False skips both, for steps
            that share the device with other threads whose work waits on this step's kernels
            (expert-parallel ranks run as threads of one process: NOTE [in-process ranks]);
            the caller then frees the warmup's cache at a point where that is safe.

    The options are one frozen :class:`~graphstash.graph.StepOptions` (an unknown keyword or a
    bad value raises TypeError/ValueError naming it). The step function must not call
    ``optimizer.step()`` (ValueError, NOTE [step ownership]). Without CUDA, the call that would
    capture and every later one run as a replay would (NOTE [same contract on the CPU]).

    Example::

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)

        @graphstash.graph_step(optimizer=opt, warmup=2)
        def train_step(x, y):           # x: [B, D] float32 CUDA, y: [B] int64 CUDA
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        for x, y in loader:
            loss = train_step(x, y)     # eager, eager, capture + replay, replay, ...
        print(train_step.stats.replays, train_step.stats.overflows)
    """
    opts = StepOptions.from_keywords("graph_step", options)
    if fn is None:
        return lambda f: GraphStep(f, **opts.as_keywords())
    return GraphStep(fn, **opts.as_keywords())


graph_step.__signature__ = keyword_signature([
    inspect.Parameter("fn", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)])
