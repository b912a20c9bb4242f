"""What a captured step holds of its model and optimizer, and what happens when it is replaced.

# NOTE [checkpoint and resume]
A captured graph reads and writes fixed addresses: the parameters' storages and the optimizer's
state tensors (moments, step counts, momentum buffers) as they were at capture. Anything that
puts *other* tensors in their place afterwards would leave the graph updating the old ones
while the optimizer and the model show the new ones: a resumed run silently 4.8 % off was
measured that way. ``CapturedState`` records, when a graph is captured (and on the CPU at the
call that would capture), what the graph holds, and graph_step reconciles every replacement:

* ``optimizer.load_state_dict(...)`` (a post-hook, so at once) and direct replacement
  (``optimizer.state[p] = {...}``, ``optimizer.state[p]["exp_avg"] = t``; found at the next
  call): new state tensors of the same shape, dtype and device are *copied into* the tensors
  the graph holds, which are put back in ``optimizer.state``. Exact, and no recapture.
* State that cannot be copied (another shape or dtype, keys added or missing, e.g. a checkpoint
  saved before the first step): the graphs are dropped, the next call runs one eager step (it
  creates whatever state is missing, as an eager loop would) and the one after recaptures. A
  one-line warning says so.
* A parameter whose storage changed (``p.data = ...``, ``model.to(...)``), or a param group
  holding other parameters: the graphs are dropped and the next call recaptures (warned once).
* ``model.load_state_dict(sd)`` copies into the parameters and buffers in place: the graph
  sees the new values with nothing to do. ``load_state_dict(sd, assign=True)`` (or
  ``setattr(module, name, new_parameter)``) replaces a Parameter the optimizer holds: the model
  then computes with a tensor nothing updates, in eager training as well. A process-wide
  parameter-registration hook (``torch.nn.modules.module.
  register_module_parameter_registration_hook``, installed with the first capture) notes such a
  replacement made between calls, and the next call raises ValueError saying what to do.
  Replacements made *while* a step runs (FSDP2 swaps sharded and unsharded parameters inside
  forward and backward) are not replacements between calls and are ignored; one that is still in
  place at the next call is refused.

The per-call check compares object identities and storage pointers only (no device work).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

import torch

_LIVE: "weakref.WeakSet[CapturedState]" = weakref.WeakSet()
_HOOK = None
_running = threading.local()


@contextlib.contextmanager
def step_running():
    """While a step function runs, parameter registrations are not replacements between calls
    (NOTE [checkpoint and resume])."""
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        yield
    finally:
        _running.depth -= 1


def _on_parameter_registered(module, name, param):
    """Global registration hook: note a Parameter a captured step holds being replaced."""
    if not _LIVE or getattr(_running, "depth", 0):
        return None
    old = getattr(module, name, None)
    if old is None or old is param:
        return None
    for state in list(_LIVE):
        if id(old) in state.param_ids:
            state.suspects.append((weakref.ref(module), name, old))
    return None


def _install_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.nn.modules.module import register_module_parameter_registration_hook

        _HOOK = register_module_parameter_registration_hook(_on_parameter_registered)


def _pointer(t: torch.Tensor) -> int:
    """The address of ``t``'s data; for a wrapper subclass without storage of its own (an FSDP2
    DTensor parameter), that of its local tensor."""
    try:
        return t.data_ptr()
    except RuntimeError:
        to_local = getattr(t, "to_local", None)
        if to_local is None:
            return id(t)
        with torch.no_grad():
            return to_local().data_ptr()


def _plain(params) -> bool:
    return all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in params)


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


class CapturedState:
    """The optimizer's parameters and state tensors as captured graphs hold them.

    Args:
        optimizer: the ``torch.optim`` optimizer of the step (its state exists).

    Example::

        held = CapturedState(opt)          # right after a capture
        ...
        held.reconcile()                   # None: nothing replaced, or replacements copied in
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.suspects: list = []
        self._record()
        _LIVE.add(self)
        _install_hook()

    def _record(self) -> None:
        opt = self.optimizer
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.param_ids = {id(p) for p in self.params}
        self.plain = _plain(self.params)
        self.state = opt.state
        self.entries = [opt.state.get(p) for p in self.params]
        self.held = [dict(e) if e is not None else None for e in self.entries]
        self._dicts = [e for e in self.entries if e is not None]
        self.fingerprint = self._fingerprint(self.params)

    def _fingerprint(self, params: list) -> tuple:
        """Identities and storage pointers of what the graphs hold, as of now: the parameters,
        their storages, the state's per-parameter dicts (in the state's own order, so no tensor
        is hashed) and the tensors in the dicts recorded at capture."""
        state = self.optimizer.state
        return (list(map(id, params)),
                list(map(torch.Tensor.data_ptr if self.plain else _pointer, params)),
                list(map(id, state.values())),
                list(map(id, itertools.chain.from_iterable(map(dict.values, self._dicts)))))

    def _name(self, index: int) -> str:
        for g, group in enumerate(self.optimizer.param_groups):
            if index < len(group["params"]):
                return f"param group {g} parameter {index}"
            index -= len(group["params"])
        return f"parameter {index}"

    def intact(self) -> bool:
        """True when nothing the graphs hold was replaced: identities and pointers only, about
        0.1 us of host time per parameter and per state tensor."""
        if self.optimizer.state is not self.state:
            return False
        params = list(itertools.chain.from_iterable(g["params"]
                                                    for g in self.optimizer.param_groups))
        try:
            return self._fingerprint(params) == self.fingerprint
        except RuntimeError:              # a parameter of another kind took a place
            return False

    def reconcile(self) -> tuple[str | None, int]:
        """Bring replaced optimizer state back into the tensors the graphs hold.

        Returns ``(reason, copied)``: ``reason`` is None when nothing was replaced or every
        replacement was copied in (exact; ``copied`` parameters had some), else a one-line
        reason the graphs must be dropped (NOTE [checkpoint and resume]).
        """
        if self.intact():
            return None, 0
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
            return "the optimizer's param groups hold other parameters than at the capture", 0
        for i, (p, ptr) in enumerate(zip(self.params, self.fingerprint[1])):
            if _pointer(p) != ptr:
                return (f"the storage of {self._name(i)} changed since the capture (p.data = ..., "
                        f"or the model moved or cast), so the graph would update the old one"), 0
        copies = []
        for i, (p, held) in enumerate(zip(self.params, self.held)):
            current = opt.state.get(p)
            if held is None:
                if current:
                    return (f"{self._name(i)} has optimizer state it had no room for at the "
                            f"capture"), 0
                continue
            if current is None or set(current) != set(held):
                got = sorted(current) if current else []
                return (f"the optimizer state of {self._name(i)} has the keys {got}, the graph "
                        f"holds {sorted(held)}"), 0
            for key, mine in held.items():
                new = current[key]
                if new is mine:
                    continue
                if not isinstance(mine, torch.Tensor) or not isinstance(new, torch.Tensor) or \
                        new.shape != mine.shape or new.dtype != mine.dtype or \
                        new.device != mine.device:
                    return (f"the optimizer state {key!r} of {self._name(i)} is now a "
                            f"{_describe(new)}, the graph holds a {_describe(mine)}"), 0
                copies.append((p, key, mine, new))
        with torch.no_grad():
            for _, _, mine, new in copies:
                mine.copy_(new)
        for p, key, mine, _ in copies:
            opt.state[p][key] = mine
        self._record()
        return None, len({id(p) for p, _, _, _ in copies})

    def replaced_parameter(self) -> str | None:
        """A message naming a Parameter of a model that was replaced between calls and still
        is (NOTE [checkpoint and resume]), or None."""
        kept = []
        found = None
        for ref, name, old in self.suspects:
            module = ref()
            if module is None:
                continue
            current = getattr(module, name, None)
            if current is old:
                continue                       # put back (or swapped there and back)
            kept.append((ref, name, old))
            if found is None:
                found = (f"{type(module).__name__}.{name} was replaced by a new Parameter after "
                         f"graph_step captured it (load_state_dict(..., assign=True) or "
                         f"assignment); the optimizer and the captured graph still hold the old "
                         f"one, so training would update a tensor the model no longer uses (in "
                         f"eager training too). Load checkpoints without assign=True (it copies "
                         f"into the parameters in place), or build a new optimizer and graph_step "
                         f"for the new parameters")
        self.suspects = kept
        return found

    def close(self) -> None:
        """Stop watching (the graphs it described are gone)."""
        _LIVE.discard(self)
        self.suspects = []


__all__ = ["CapturedState", "step_running"]
