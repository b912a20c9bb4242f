"""Hyperparameters that change between steps: lr as a device tensor, the rest baked in.

# NOTE [scheduled hyperparameters]
A captured optimizer step bakes the float hyperparameters of its param groups into the graph:
torch's fused kernels take lr, betas, eps, weight decay and momentum as launch arguments, and
the capturable foreach and for-loop paths as scalar operands. A scheduler that writes a new float
lr every step would cost a capture every step (38 in 40 steps measured with a cosine schedule,
slower than eager). But torch's fused Adam, AdamW and SGD and its capturable Adam and AdamW also
accept ``lr`` as a tensor on the parameters' device, read by the kernels when they run. So:

* graph_step keeps one float32 device tensor per such param group (``ScheduledHyperparameters``)
  and, while the update runs (captured, and on CUDA also the eager warmup and rerun steps, so
  every update of a run uses the same arithmetic), puts it in the group in place of the float,
  restoring the float right after. Before each replay, outside the graph, it writes the group's
  current float into the tensor (one small host-to-device copy, only when a value changed). The
  user's ``param_groups`` keep their floats: schedulers, logging and ``state_dict()`` see
  nothing.
* It does so from the first call when a torch LR scheduler is attached (every scheduler records
  ``initial_lr`` in the groups it drives), else from the first call that finds the float changed;
  if a graph had baked the old value, that call recaptures once, and a one-line warning says so.
* The kernels read a tensor lr as float32, so an update uses the lr rounded to float32 (relative
  difference at most 6e-8 from the double): bit for bit what eager training does when handed
  that float32 value, not what it does with the double.
* Nothing else becomes a tensor: fused kernels take betas, eps, weight decay and momentum only as
  numbers, and the capturable foreach Adam raises beta1 to the step count with a host-side scalar
  (a tensor beta would be read back to the host, which a capture cannot do). SGD takes lr as a
  tensor only with ``fused=True``. A change of a baked value drops the graphs and the next call
  recaptures, exactly as before; a one-line warning says so once per step function (OneCycleLR
  and CyclicLR cycle Adam's beta1 or SGD's momentum unless ``cycle_momentum=False``).
"""
from __future__ import annotations

import contextlib

import torch

_SCHEDULER_KEY = "initial_lr"      # set in every group a torch LR scheduler drives


def lr_takes_tensor(optimizer, group: dict) -> bool:
    """True when ``optimizer.step()`` reads ``group["lr"]`` as a device tensor inside a CUDA
    graph (NOTE [scheduled hyperparameters]) and the group's lr is a Python number now."""
    lr = group.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or group.get("differentiable"):
        return False
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return bool(group.get("fused") or group.get("capturable"))
    if isinstance(optimizer, torch.optim.SGD):
        return bool(group.get("fused"))
    return False


def _baked_value(value) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, tuple):
        return all(_baked_value(v) for v in value)
    return isinstance(value, (int, float, bool, str, type(None)))


class ScheduledHyperparameters:
    """Device tensors standing in for the float ``lr`` of an optimizer's param groups.

    Args:
        optimizer: the ``torch.optim`` optimizer of the step.
        device: where the 0-dim float32 lr tensors live (the parameters' device).

    Example::

        hyper = ScheduledHyperparameters(opt, torch.device("cuda"))
        hyper.observe()                  # each call: adopt groups whose lr changed
        hyper.write()                    # before a replay: floats -> device tensors
        with hyper.in_groups():          # while the update is captured or runs on CUDA
            opt.step()
    """

    def __init__(self, optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.tensor_groups: set[int] = set()
        self._values: torch.Tensor | None = None        # float32 [groups] on device
        self._host: torch.Tensor | None = None
        self._copied = None                             # event after the last async write
        self._written: list | None = None
        self._last_seen: list | None = None
        if any(_SCHEDULER_KEY in g for g in optimizer.param_groups):
            self._adopt(i for i, g in enumerate(optimizer.param_groups)
                        if _SCHEDULER_KEY in g and lr_takes_tensor(optimizer, g))

    # ---- which groups ---------------------------------------------------------------------
    def _adopt(self, groups) -> list[int]:
        new = [i for i in groups if i not in self.tensor_groups]
        self.tensor_groups.update(new)
        return new

    def observe(self) -> list[tuple[int, float, float]]:
        """Adopt every group whose float lr changed since the last call and can be a tensor;
        returns ``(group, old, new)`` for the groups adopted now."""
        groups = self.optimizer.param_groups
        seen = [g.get("lr") for g in groups]
        adopted = []
        if self._last_seen is not None and len(self._last_seen) == len(seen):
            for i, (old, new) in enumerate(zip(self._last_seen, seen)):
                if i in self.tensor_groups or not lr_takes_tensor(self.optimizer, groups[i]):
                    continue
                if isinstance(old, (int, float)) and old != new:
                    self.tensor_groups.add(i)
                    adopted.append((i, old, new))
        self._last_seen = seen
        return adopted

    def _active(self) -> list[int]:
        """The adopted groups whose lr is (still) a number a tensor can stand in for."""
        groups = self.optimizer.param_groups
        return [i for i in sorted(self.tensor_groups)
                if i < len(groups) and lr_takes_tensor(self.optimizer, groups[i])]

    # ---- what a graph bakes in ----------------------------------------------------------------
    def baked(self) -> tuple:
        """The hyperparameters a captured step bakes in: per group, every number, bool, string
        or tuple of them the optimizer reads (its ``defaults`` keys), except a tensor lr."""
        keys = sorted(k for k in self.optimizer.defaults if k != "params")
        active = set(self._active())
        out = []
        for i, group in enumerate(self.optimizer.param_groups):
            out.append(tuple((k, group[k]) for k in keys
                             if k in group and _baked_value(group[k])
                             and not (k == "lr" and i in active)))
        return tuple(out)

    @staticmethod
    def changes(before: tuple, after: tuple) -> list[tuple[int, str, object, object]]:
        """``(group, key, old, new)`` for every value present in both and different."""
        found = []
        for i, (a, b) in enumerate(zip(before, after)):
            new = dict(b)
            for key, old in a:
                if key in new and new[key] != old:
                    found.append((i, key, old, new[key]))
        if len(before) != len(after):
            found.append((min(len(before), len(after)), "param_groups", len(before), len(after)))
        return found

    # ---- the tensors ------------------------------------------------------------------------
    @property
    def tensors(self) -> dict[int, torch.Tensor]:
        """``{group index: 0-dim float32 lr tensor}`` of the adopted groups (after
        :meth:`write`)."""
        if self._values is None:
            return {}
        return {i: self._values[i] for i in self._active() if i < self._values.numel()}

    def allocate(self) -> None:
        """Make the device tensors (outside any capture); one per param group."""
        n = len(self.optimizer.param_groups)
        if self._values is not None and self._values.numel() >= n:
            return
        self._values = torch.zeros(n, dtype=torch.float32, device=self.device)
        self._written = None
        if self.device.type == "cuda":
            self._host = torch.zeros(n, dtype=torch.float32, pin_memory=True)
            self._copied = torch.cuda.Event()

    def write(self) -> None:
        """Copy the adopted groups' float lr into their device tensors (on the current stream,
        outside any capture; nothing when no value changed since the last write)."""
        active = self._active()
        if not active:
            return
        self.allocate()
        groups = self.optimizer.param_groups
        values = [float(groups[i]["lr"]) if i in active else 0.0 for i in range(len(groups))]
        if values == self._written:
            return
        if self._host is None:
            with torch.no_grad():
                self._values[: len(values)].copy_(torch.tensor(values, dtype=torch.float32))
        else:
            self._copied.synchronize()        # the previous copy has read the host buffer
            self._host[: len(values)].copy_(torch.tensor(values, dtype=torch.float32))
            with torch.no_grad():
                self._values[: len(values)].copy_(self._host[: len(values)], non_blocking=True)
            self._copied.record()
        self._written = values

    @contextlib.contextmanager
    def in_groups(self):
        """Inside the block the adopted groups hold their device tensor as ``lr``; their floats
        are put back on exit (NOTE [scheduled hyperparameters])."""
        active = self._active()
        if not active or self._values is None:
            yield
            return
        groups = self.optimizer.param_groups
        saved = [(i, groups[i]["lr"]) for i in active]
        try:
            for i in active:
                groups[i]["lr"] = self._values[i]
            yield
        finally:
            for i, lr in saved:
                groups[i]["lr"] = lr


__all__ = ["ScheduledHyperparameters", "lr_takes_tensor"]
