"""The graph manager: :class:`GraphStep` and the :func:`graph_step` decorator.

One call of a decorated training step runs one of three ways:

1. eagerly (the first ``warmup`` calls, every call on a machine without CUDA, and the rerun of
   an overflowed step), with the usual ``zero_grad`` / step / ``optimizer.step()`` order;
2. by capture and replay: the tensors of the call are copied into static buffers and one CUDA
   graph runs forward, backward and the optimizer update;
3. by replay then recovery: when the step's device status says *overflow* or *over budget*,
   the replayed update was skipped on the device (NOTE [update skipping]) and the same inputs
   run again eagerly in dropless mode, applying the update once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import traceback
import warnings
import weakref

import torch

from .._checks import forbid_capture
from .._mode import dropless
from ..errors import CaptureError, ReleasedError, UpdateAppliedError
from ..status import StepStatus
from . import _staging as S
from . import capture_errors, capture_memory, compile_guard, failed_capture
from ._update import DeviceUpdate, check_optimizer, has_state, hyperparameters
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
    reruns after a flagged step, ``overflows`` / ``over_budget`` / ``host_spills`` steps whose
    status carried that flag, ``captures`` graphs captured and ``capture_ms`` their total
    capture time. ``status_wait_us`` is the mean host time per replay between launching the
    graph and holding its flags (it includes waiting for the GPU to finish the step).
    ``peak_memory_bytes`` is ``torch.cuda.max_memory_allocated`` of the device,
    ``stash_pages_peak`` the stash manager's device-page high-water mark (0 without one),
    ``memory_before_capture`` ``torch.cuda.memory_allocated`` just before the first capture.
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

    def as_dict(self) -> dict:
        """The counters as a plain ``dict`` (for logging or JSON)."""
        return dataclasses.asdict(self)


class _StepCalledError(ValueError):
    """``optimizer.step()`` called by the step function (NOTE [step ownership])."""


def _check_device_arg(device) -> torch.device | None:
    """``device=`` of :class:`GraphStep` parsed, or ValueError/TypeError naming it."""
    if device is None:
        return None
    expected = "'cpu', 'cuda', 'cuda:N', a torch.device or None"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device: expected {expected}, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device: expected {expected}, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected {expected} (graph_step runs on CUDA, or eagerly on "
                         f"the CPU), got {device!r}")
    return dev


@dataclasses.dataclass
class _Graph:
    """One captured graph and what it must keep alive."""

    signature: tuple
    graph: object
    inputs: S.StaticInputs
    outputs: object                 # the pytree the captured call returned (static tensors)
    grads: list                     # gradient tensors the graph writes (its pool)
    hyper: tuple                    # optimizer hyperparameters baked in
    nbytes: int                     # pool growth during capture + static inputs


# NOTE [gradients]
# Right before a capture the gradients are set to None, so the first backward inside the graph
# *writes* them (in the graph's pool) and later microbatches accumulate: every replay starts
# from zero gradients exactly as ``optimizer.zero_grad()`` would, with no memset. Eager steps
# (warmup, reruns) call ``zero_grad(set_to_none=True)`` first, which is what an eager loop does;
# after a rerun ``p.grad`` holds the rerun's gradients while the graph keeps (and keeps alive)
# its own. A step function therefore must not call ``optimizer.step()`` itself (it is refused:
# NOTE [step ownership]); calling ``zero_grad()`` is harmless.

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

# NOTE [status readback]
# Inside the graph, after backward, the flags (overflow, host spill, over budget) are reduced
# to indicators and, under torch.distributed, summed over ranks in one all_reduce, so every
# rank skips, reruns and recaptures together. The reduced int32 [3] vector is copied into a
# pinned host buffer by the graph itself; after the replay the host waits on one event and
# reads it. This is one sync per step: the next step must not start before the host knows
# whether this one is rerun (a rerun applies the update that the next step builds on).


class GraphStep:
    """A training step captured whole into a CUDA graph and replayed; see :func:`graph_step`."""

    def __init__(self, fn, *, optimizer=None, scaler=None, warmup: int = 2, stash=None,
                 outputs: str = "clone", on_new_shape: str = "error", max_graphs: int = 4,
                 graph_memory_budget: int | None = None, budget_growth: float = 1.5,
                 on_overflow=None, generators=(), process_group=None, distributed="auto",
                 update_skip: str = "auto", device=None):
        if not callable(fn):
            raise TypeError(f"fn: expected a callable training step, got {type(fn).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        if scaler is not None and optimizer is None:
            raise ValueError("scaler: a GradScaler needs the optimizer it scales; pass optimizer=")
        if scaler is not None and not hasattr(scaler, "unscale_"):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {warmup!r}")
        if outputs not in ("clone", "static"):
            raise ValueError(f"outputs: expected 'clone' (detached copies) or 'static' (the "
                             f"graph's own tensors, overwritten by the next call), got {outputs!r}")
        if on_new_shape not in ("error", "recapture"):
            raise ValueError(f"on_new_shape: expected 'error' or 'recapture', got {on_new_shape!r}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs: expected an int >= 1, got {max_graphs!r}")
        if graph_memory_budget is not None and (not isinstance(graph_memory_budget, int)
                                                or graph_memory_budget <= 0):
            raise ValueError(f"graph_memory_budget: expected a positive int (bytes) or None, "
                             f"got {graph_memory_budget!r}")
        if isinstance(budget_growth, bool) or not isinstance(budget_growth, (int, float)):
            raise TypeError(f"budget_growth: expected a finite number > 1, got "
                            f"{type(budget_growth).__name__}")
        if not math.isfinite(budget_growth) or budget_growth <= 1.0:
            raise ValueError(f"budget_growth: expected a finite number > 1, got {budget_growth!r}")
        if on_overflow is not None and not callable(on_overflow):
            raise TypeError(f"on_overflow: expected a callable or None, got {type(on_overflow).__name__}")
        if distributed not in ("auto", True, False):
            raise ValueError(f"distributed: expected 'auto', True or False, got {distributed!r}")
        if update_skip not in ("auto", "found_inf", "mask"):
            raise ValueError(f"update_skip: expected 'auto', 'found_inf' or 'mask', got {update_skip!r}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("optimizer: LBFGS re-evaluates the loss through a closure several "
                             "times per step; graph_step calls optimizer.step() once, without a "
                             "closure. Use a first-order optimizer (AdamW, Adam or SGD)")
        device = _check_device_arg(device)
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._name = getattr(fn, "__qualname__", getattr(fn, "__name__", "step"))
        self.optimizer = optimizer
        self.scaler = scaler
        self.warmup = warmup
        self._stash_arg = stash
        self._outputs_mode = outputs
        self._on_new_shape = on_new_shape
        self._max_graphs = max_graphs
        self._graph_memory_budget = graph_memory_budget
        self._budget_growth = float(budget_growth)
        self._on_overflow = on_overflow
        self._generators = tuple(generators)
        self._process_group = process_group
        self._distributed_arg = distributed
        self._update_skip = update_skip
        self._device_arg = device

        self._device: torch.device | None = None
        self._status: StepStatus | None = None
        self._manager = None
        self._update: DeviceUpdate | None = None
        self._graphs: dict[tuple, _Graph] = {}   # insertion order = least recently used first
        self._first_signature = None
        self._eager_done = 0
        self._released = False
        self._ready = False
        self._warned_eager = False
        self._flags_host: torch.Tensor | None = None
        self._flags_view = None
        self._done_event = None
        self._capture_stream = None
        self._stats = GraphStepStats()
        self._status_wait_s = 0.0
        self._fn_running = False
        self._warned_contract = False
        self._eager_signatures = compile_guard.EagerSignatures()   # NOTE [compile and capture]
        self._refuse_compiles = False
        if optimizer is not None:           # NOTE [step ownership]
            hook = optimizer.register_step_pre_hook(functools.partial(_refuse_step, weakref.ref(self)))
            weakref.finalize(self, hook.remove)

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
        self._stats.mode = "graph" if self.graphed else "eager"
        if dev.type == "cuda" and self.optimizer is not None:
            check_optimizer(self.optimizer)       # before any step runs, not at capture time
        if dev.type == "cuda":
            self._flags_host = torch.zeros(3, dtype=torch.int32, pin_memory=True)
            self._flags_view = self._flags_host.numpy()
            self._done_event = torch.cuda.Event()
            self._capture_stream = torch.cuda.Stream(device=dev)
        else:
            self._flags_host = torch.zeros(3, dtype=torch.int32)
            self._flags_view = self._flags_host.numpy()
            if not self._warned_eager:
                self._warned_eager = True
                why = ("CUDA is not available" if not torch.cuda.is_available()
                       else f"the step runs on {dev}")
                warnings.warn(f"graphstash.graph_step({self._name}): {why}, so the step runs "
                              "eagerly without a CUDA graph; stats still count its steps",
                              RuntimeWarning, stacklevel=4)
        self._ready = True

    def _distributed(self) -> bool:
        if self._distributed_arg is False:
            return False
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        if self._distributed_arg is True and not on:
            raise ValueError("distributed: True, but torch.distributed is not initialised")
        return on

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
        self._drop_graphs()
        self._first_signature = None
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
            self._drop_graphs()
            self._first_signature = None
        if self._manager is not None and self._released:
            self._manager.reallocate()
        self._released = False

    def __call__(self, *args, **kwargs):
        if self._released:
            raise ReleasedError(f"{self._name}: the step was released; call .reset() first")
        forbid_capture(f"{self._name}()")
        self._setup()
        if not self.graphed or self._eager_done < self.warmup:
            sig = None
            if not self.graphed and self._eager_done >= self.warmup:
                sig = self._check_cpu_contract(args, kwargs)
            return self._eager_call(args, kwargs, sig)
        leaves, spec = S.flatten_call(args, kwargs)
        sig = S.signature(leaves, spec)
        entry = self._graphs.get(sig)
        if entry is not None and self.optimizer is not None and \
                entry.hyper != hyperparameters(self.optimizer):
            self._drop_graphs()          # a scheduler changed a float lr: every graph baked it
            entry = None
        if entry is None:
            self._refuse_new_signature(sig, args, kwargs)
            if self._eager_signatures.needs_eager_call(sig):    # NOTE [compile and capture]
                return self._eager_call(args, kwargs, sig)
            entry = self._capture(sig, leaves, spec)
        else:
            self._graphs[sig] = self._graphs.pop(sig)     # most recently used last
        return self._replay(entry, leaves, args, kwargs)

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
    # capture on, a change of argument shapes (or of a non-tensor argument) raises the same
    # ValueError as on the GPU (``on_new_shape='recapture'`` allows it, as there). An optimizer
    # that cannot be captured only warns, once: torch's CPU optimizers cannot be made
    # capturable, so refusing would break legitimate CPU training.
    def _check_cpu_contract(self, args, kwargs) -> tuple:
        leaves, spec = S.flatten_call(args, kwargs)
        sig = S.signature(leaves, spec)
        self._refuse_new_signature(sig, args, kwargs)
        if self._first_signature is None:
            self._first_signature = sig
        if self._warned_contract:
            return sig
        self._warned_contract = True
        try:
            self._check_capturable()
        except ValueError as exc:
            warnings.warn(f"graphstash.graph_step({self._name}): on a CUDA device this step would "
                          f"be refused: {exc} (code that builds the optimizer capturable only on "
                          "CUDA may filter this warning)", RuntimeWarning, stacklevel=4)
        return sig

    # ---- eager --------------------------------------------------------------------------
    def _eager_call(self, args, kwargs, sig=None):
        """A call run eagerly on purpose (warmup, the first call of a new signature once
        torch.compile is in use, every call without CUDA), counted when its update is applied.

        Without CUDA, a call of a signature that already ran (``sig`` given) is where a GPU run
        would capture: a compile there is refused as it would be in the capture (NOTE [compile
        and capture], NOTE [same contract on the CPU])."""
        if sig is None:
            sig = S.signature(*S.flatten_call(args, kwargs))
        refuse = not self.graphed and not self._eager_signatures.needs_eager_call(sig) and \
            self._eager_done >= self.warmup
        steps = self._stats.steps
        try:
            with self._compiles_refused(refuse):
                return self._eager_step(args, kwargs, side_stream=self.graphed)
        except RuntimeError as exc:
            if refuse and compile_guard.is_refusal(exc):
                raise capture_errors.capture_error(exc, self._name, eager=True) from exc
            raise
        finally:
            if self._stats.steps > steps:    # the update was applied (NOTE [transactional rerun])
                self._eager_done += 1
                self._stats.eager_steps += 1
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

    @contextlib.contextmanager
    def _step_fn_running(self):
        """While the step function runs, ``optimizer.step()`` is refused (NOTE [step ownership])."""
        self._fn_running = True
        try:
            yield
        finally:
            self._fn_running = False

    def _apply_update(self) -> None:
        """The eager update of a step, counted as it is applied (NOTE [transactional rerun])."""
        if self._update is not None:
            self._update.eager_step()
        self._stats.steps += 1

    def _clear_flags(self) -> None:
        self.step_status.clear_flags()

    def _reduced_flags(self) -> torch.Tensor:
        """int32 [3]: indicators of overflow, host spill, over budget (summed over ranks:
        NOTE [flags across ranks] in graphstash/status.py)."""
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

    def _eager_step(self, args, kwargs, *, side_stream: bool = False):
        """One guarded eager step: run, read the flags, rerun dropless if flagged, update once."""
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
        with self._step_fn_running():
            out = self._run_fn(args, kwargs, is_dropless=False)
        overflow, spill, over_budget = (int(v) for v in self._reduced_flags().tolist())
        self._count_flags(overflow, spill, over_budget)
        if overflow or over_budget:
            self._restore_rng(saved_rng)
            return self._rerun(args, kwargs, (overflow, spill, over_budget), regraph=False)
        out = S.detach_tree(out)
        self._apply_update()
        return out

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _count_flags(self, overflow: int, spill: int, over_budget: int) -> None:
        self._stats.overflows += bool(overflow)
        self._stats.host_spills += bool(spill)
        self._stats.over_budget += bool(over_budget)

    def _rerun(self, args, kwargs, flags: tuple, *, regraph: bool, finish=S.detach_tree):
        """Rerun a flagged step eagerly in dropless mode, grow the budget, apply its update.

        ``finish`` turns the step's outputs into what the call returns; it runs before the
        update (NOTE [transactional rerun]).
        """
        self._stats.eager_reruns += 1
        self._zero_grad()
        self._clear_flags()
        with self._step_fn_running():
            out = self._run_fn(args, kwargs, is_dropless=True)
        self._clear_flags()
        grown = self._grow_budget()
        out = finish(out)
        self._apply_update()
        if self._on_overflow is None:
            if grown and regraph:
                self._drop_graphs()         # the next call recaptures with the grown budget
            return out
        try:
            self._on_overflow({"overflow": bool(flags[0]), "host_spill": bool(flags[1]),
                               "over_budget": bool(flags[2])})
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
                self._drop_graphs()         # on_overflow may have grown a budget a graph baked
        return out

    def _grow_budget(self) -> bool:
        """Grow the stash by ``budget_growth`` (``grow``: NOTE [step protocol], a new config,
        never the user's); True if there is a stash."""
        if self._manager is None:
            return False
        self._manager.grow(self._budget_growth)
        return True

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
        with self._step_fn_running():
            out = self._run_fn(static_args, static_kwargs, is_dropless=False)
        flags = self._reduced_flags()
        self._flags_host.copy_(flags, non_blocking=True)
        if self._update is not None:
            flagged = (flags[0] + flags[2]) > 0
            self._update.step(flagged)
        return out

    def _capture(self, sig, leaves, spec) -> _Graph:
        self._check_capturable()
        dev = self.device
        if self._manager is not None:
            self._manager.warmup()
        self._zero_grad()                    # NOTE [gradients]
        capture_memory.release_warmup_cache(dev)    # NOTE [capture memory]
        if self._stats.memory_before_capture is None:
            self._stats.memory_before_capture = torch.cuda.memory_allocated(dev)
        if self._update is not None:
            self._update.allocate()
        reserved0 = torch.cuda.memory_reserved(dev)
        inputs = S.StaticInputs(leaves, spec)
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
            if isinstance(exc, _StepCalledError):
                raise                                   # the same error as eagerly
            raise capture_errors.capture_error(exc, self._name) from exc
        current.wait_stream(stream)
        capture_s = time.perf_counter() - t0
        grads = []
        if self.optimizer is not None:
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
        entry = _Graph(signature=sig, graph=graph, inputs=inputs, outputs=S.detach_tree(out),
                       grads=grads,
                       hyper=hyperparameters(self.optimizer) if self.optimizer is not None else (),
                       nbytes=max(0, torch.cuda.memory_reserved(dev) - reserved0))
        _LIVE_GRAPHS.add(graph)
        self._stats.captures += 1
        self._stats.capture_ms += 1e3 * capture_s
        if self._first_signature is None:
            self._first_signature = sig
        self._graphs[sig] = entry
        self._evict(keep=sig)
        return entry

    def _evict(self, keep) -> None:
        def over() -> bool:
            if len(self._graphs) > self._max_graphs:
                return True
            budget = self._graph_memory_budget
            return budget is not None and sum(g.nbytes for g in self._graphs.values()) > budget

        while len(self._graphs) > 1 and over():
            victim = next(k for k in self._graphs if k != keep)
            del self._graphs[victim]

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._zero_grad()

    # ---- replay -------------------------------------------------------------------------
    def _replay(self, entry: _Graph, leaves, args, kwargs):
        entry.inputs.stage(leaves)
        saved_rng = self._rng_offsets()
        entry.graph.replay()
        t0 = time.perf_counter()
        self._done_event.record()
        self._done_event.synchronize()
        overflow, spill, over_budget = (int(v) for v in self._flags_view)
        self._status_wait_s += time.perf_counter() - t0
        self._stats.replays += 1
        self._count_flags(overflow, spill, over_budget)
        if overflow or over_budget:
            self._restore_rng(saved_rng)
            return self._rerun(args, kwargs, (overflow, spill, over_budget), regraph=True,
                               finish=functools.partial(self._rerun_outputs, entry))
        self._stats.steps += 1                  # the graph applied the update
        if self._outputs_mode == "static":
            return entry.outputs
        return S.clone_tree(entry.outputs)

    def _rerun_outputs(self, entry: _Graph, out):
        """What a call returns after a rerun: the static outputs overwritten, or copies."""
        if self._outputs_mode == "static" and S.copy_tree_into(entry.outputs, out):
            return entry.outputs
        return S.clone_tree(out) if self._outputs_mode == "clone" else S.detach_tree(out)


def _refuse_step(owner_ref, optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: refuse ``step()`` from inside the step function."""
    owner = owner_ref()
    if owner is not None and owner._fn_running:
        raise _StepCalledError(
            f"fn: {owner._name} called {type(optimizer).__name__}.step() itself; graph_step "
            "owns optimizer.step() and optimizer.zero_grad() (and a GradScaler's step() and "
            "update()) and applies the update once per call, so it would be applied twice. "
            "Remove the call from the step function (NOTE [step ownership])")


def graph_step(fn=None, *, optimizer=None, scaler=None, warmup: int = 2, stash=None,
               outputs: str = "clone", on_new_shape: str = "error", max_graphs: int = 4,
               graph_memory_budget: int | None = None, budget_growth: float = 1.5,
               on_overflow=None, generators=(), process_group=None, distributed="auto",
               update_skip: str = "auto", device=None):
    """Capture a whole training iteration (forward, backward, optimizer step) in a CUDA graph.

    The decorated function runs forward and backward (``loss.backward()`` or
    ``scaler.scale(loss).backward()``) and returns any pytree of tensors; the decorator owns
    ``optimizer.zero_grad()`` and ``optimizer.step()`` (NOTE [gradients]). The first ``warmup``
    calls run eagerly, the next one captures, later ones copy their tensors into the static
    buffers and replay. Each replay reads the step's device status once (NOTE [status
    readback]); when it says overflow or over budget, the update was skipped on the device
    (NOTE [update skipping]), the same inputs run again eagerly under
    :func:`graphstash.dropless`, the update is applied once, the stash budget grows by
    ``budget_growth`` and the next call recaptures. Without CUDA every call runs eagerly (one
    warning says so) with the same ``stats``.

    Args:
        fn: the training step. Tensor arguments may be nested in lists, tuples and dicts (for
            example one entry per microbatch); every tensor is staged, other values are baked
            into the graph.
        optimizer: a ``torch.optim`` Adam/AdamW (``capturable=True``; ``fused=True`` is
            fastest) or SGD; None for a step without an update.
        scaler: an optional ``torch.amp.GradScaler`` (fp16); the decorator calls its
            ``step``/``update`` (``unscale_`` inside the step is fine).
        warmup: eager calls before the first capture (>= 1 when the optimizer has no state).
        stash: a :class:`graphstash.stash.StashConfig` or ``StashManager``; the step runs with
            it as the default manager, sized from the warmup's demand.
        outputs: ``"clone"`` returns detached copies; ``"static"`` returns the graph's own
            output tensors, overwritten by the next call.
        on_new_shape: ``"error"`` raises ValueError naming the argument; ``"recapture"`` keeps
            up to ``max_graphs`` graphs (and ``graph_memory_budget`` bytes), least recently
            used dropped first.
        budget_growth: finite factor > 1 the stash grows by after an overflow
            (``StashManager.grow``: a new config with ``device_factor x budget_growth``, or
            ``host_factor`` for a host-only stash; the config passed in is not changed).
        on_overflow: optional ``callable(flags: dict)`` called after a rerun applied its
            update (for example to grow an MoE dispatch budget); graphs are recaptured
            afterwards. If it raises, the call raises :class:`graphstash.UpdateAppliedError`
            (the update was applied: do not retry the batch).
        generators: extra CUDA ``torch.Generator`` objects the step draws from (the default
            one is always registered with the graph).
        process_group / distributed: flags are all-reduced over this group when
            ``torch.distributed`` is initialised (``distributed="auto"``).
        update_skip: ``"auto"``, ``"found_inf"`` or ``"mask"`` (NOTE [update skipping]).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` (default: the
            optimizer's parameters).

    The step function must not call ``optimizer.step()`` (ValueError, NOTE [step
    ownership]). Without CUDA, shapes that change after the warmup raise as on the GPU and an
    optimizer a GPU run would refuse warns (NOTE [same contract on the CPU]).

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
    kwargs = dict(optimizer=optimizer, scaler=scaler, warmup=warmup, stash=stash, outputs=outputs,
                  on_new_shape=on_new_shape, max_graphs=max_graphs,
                  graph_memory_budget=graph_memory_budget, budget_growth=budget_growth,
                  on_overflow=on_overflow, generators=generators, process_group=process_group,
                  distributed=distributed, update_skip=update_skip, device=device)
    if fn is None:
        return lambda f: GraphStep(f, **kwargs)
    return GraphStep(fn, **kwargs)
