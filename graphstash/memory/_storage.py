"""Track the storages a step allocates and frees, op by op (any device; exact on the CPU).

NOTE [storage tracking]: a ``TorchDispatchMode`` sees every ATen op below autograd, forward,
backward (the engine carries the mode to its threads) and optimizer alike. A storage an op
returns that is not one of the op's inputs' storages and is not tracked yet was allocated by
that op: it is recorded with its ``nbytes()``, the op, the phase and the module running, and
a ``weakref.finalize`` on the storage records its free when the C++ storage dies (torch keeps
a storage's Python object alive as long as the storage, so the finalizer fires at the
storage's real end, not when a Python wrapper goes away). Known storages that exist before the
step (parameters, gradients, optimizer state, stash pool, inputs) are registered the same way,
so their frees during the step count too. What this does not see: scratch memory an op
allocates and frees inside itself, and a storage resized in place after it was first seen
(counted at its first size). On the CPU that is the whole byte count; on CUDA the allocator
history gives the bytes and this only says who allocated what (``_allocator.py``).

NOTE [phases]: an allocation is in the backward phase while an autograd graph task runs
(``torch._C._current_graph_task_id() != -1``), in the optimizer phase between the global
optimizer step pre- and post-hooks, and in the forward phase otherwise. A module forward that
runs during backward is a recomputation (activation checkpointing): its allocations count as
forward ones of that module.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
_STASH_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 name) for name in ("stash", "paging.py"))


@dataclasses.dataclass
class StorageRecord:
    """One storage seen by the recorder: its size and who allocated it."""

    key: tuple                 # (device, data_ptr)
    nbytes: int
    start: int                 # event index of its allocation (-1: it existed before)
    end: int | None = None     # event index of its free (None: alive when recording stopped)
    phase: str = FORWARD
    op: str = ""               # "aten.mm", or "" for storages that existed before
    module: str | None = None  # module path running at the allocation (None: outside modules)
    by_stash: bool = False     # allocated inside graphstash's stash or paging code
    t_alloc_us: int = 0        # wall clock (time.time_ns() // 1000) after the op returned
    t_free_us: int | None = None


class StorageRecorder(TorchDispatchMode):
    """Records storages on ``device`` allocated and freed while it is active.

    ``events`` is the ordered list of ``(record index, +1 | -1)``; ``marks`` holds ``(event
    index, label)`` where the phase or the step changes.
    """

    def __init__(self, device: torch.device, root=None):
        super().__init__()
        self.device = device
        self.records: list[StorageRecord] = []
        self.events: list[tuple[int, int]] = []
        self.marks: list[tuple[int, str, int]] = []     # (event index, label, time_us)
        self._live: dict = {}                          # key -> record index
        self._finalizers: list = []
        self._active = False
        self._optimizer_depth = 0
        self._modules: list = []                       # stack of running modules
        self._root = root
        self._names: dict = {}                         # id(module) -> path, per root
        self._last_mark = None
        self._step = 0
        self._handles: list = []

    # ---- lifecycle ----------------------------------------------------------------------
    def register_existing(self, key, nbytes: int, storage) -> None:
        """Count a storage that exists before the recording (``start=-1``)."""
        if key in self._live:
            return
        self._add(StorageRecord(key, nbytes, -1), storage, event=False)

    def start(self) -> None:
        from torch.nn.modules import module as _module
        from torch.optim import optimizer as _optimizer

        self._handles = [
            _module.register_module_forward_pre_hook(self._enter_module),
            _module.register_module_forward_hook(self._exit_module, always_call=True),
            _optimizer.register_optimizer_step_pre_hook(self._enter_optimizer),
            _optimizer.register_optimizer_step_post_hook(self._exit_optimizer),
        ]
        # NOTE [first dispatch]: the first call into a dispatch mode imports torch._dynamo
        # (torch._compile's disable wrapper), and that import leaves a reference cycle holding
        # the calling frames; with the cyclic collector off during the recording, the step's
        # locals would then outlive the step. One call outside the recording does the import.
        with self:
            torch.empty(0)
        self._active = True
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles = []
        for f in self._finalizers:
            f.detach()
        self._finalizers = []

    def begin_step(self) -> None:
        """Mark the start of a recorded step (a label on the timeline)."""
        self._step += 1
        self._mark(FORWARD)

    # ---- hooks --------------------------------------------------------------------------
    def _enter_module(self, module, args):
        self._modules.append(module)

    def _exit_module(self, module, args, output):
        if self._modules and self._modules[-1] is module:
            self._modules.pop()

    def _enter_optimizer(self, optimizer, args, kwargs):
        self._optimizer_depth += 1

    def _exit_optimizer(self, optimizer, args, kwargs):
        self._optimizer_depth = max(0, self._optimizer_depth - 1)

    # ---- the recording ------------------------------------------------------------------
    def _phase(self) -> str:
        if self._optimizer_depth:
            return OPTIMIZER
        if torch._C._current_graph_task_id() != -1 and not self._modules:
            return BACKWARD
        return FORWARD

    def _module_path(self) -> str | None:
        if not self._modules:
            return None
        module = self._modules[-1]
        root = self._root if self._root is not None else self._modules[0]
        names = self._names.get(id(root))
        if names is None:
            names = self._names[id(root)] = {id(m): n for n, m in root.named_modules()}
        return names.get(id(module), type(module).__name__)

    def _mark(self, phase: str) -> None:
        label = f"step {self._step}: {phase}"
        if label != self._last_mark:
            self._last_mark = label
            self.marks.append((len(self.events), label, time.time_ns() // 1000))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._active:
            return out
        outputs = [st for st in map(self._storage, tree_leaves(out)) if st is not None]
        if not outputs:
            return out
        inputs = {st.data_ptr() for st in map(self._storage, tree_leaves((args, kwargs)))
                  if st is not None}
        phase = None
        for st in outputs:
            nbytes = st.nbytes()
            ptr = st.data_ptr()
            key = (self.device, ptr)
            if nbytes == 0 or ptr in inputs or key in self._live:
                continue
            if phase is None:
                phase = self._phase()
                self._mark(phase)
            rec = StorageRecord(key, nbytes, len(self.events), phase=phase,
                                op=str(func.overloadpacket), module=self._module_path(),
                                by_stash=_called_from_stash(),
                                t_alloc_us=time.time_ns() // 1000)
            self._add(rec, st, event=True)
        return out

    def _storage(self, t):
        """The untyped storage of ``t`` if it is a tensor on the recorded device, else None."""
        if not isinstance(t, torch.Tensor) or t.device != self.device:
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):     # sparse or other storage-less layouts
            return None

    def _add(self, rec: StorageRecord, storage, event: bool) -> None:
        index = len(self.records)
        self.records.append(rec)
        self._live[rec.key] = index
        if event:
            self.events.append((index, +1))
        self._finalizers.append(weakref.finalize(storage, self._freed, rec.key, index))

    def _freed(self, key, index: int) -> None:
        if not self._active or self._live.get(key) != index:
            return
        del self._live[key]
        rec = self.records[index]
        rec.end = len(self.events)
        rec.t_free_us = time.time_ns() // 1000
        self.events.append((index, -1))


def _called_from_stash() -> bool:
    """True if a frame of graphstash's stash package or paging module is on the stack (of
    this thread: the autograd engine's device threads have short stacks)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_STASH_DIRS):
            return True
        frame = frame.f_back
    return False
