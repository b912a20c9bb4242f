"""The optimizer update inside the graph: which optimizers capture, and skipping on the device.

# NOTE [update skipping]
A replayed step cannot ask the host whether to apply its update: the decision is made on the
device from the status flags, and a flagged step must leave parameters and optimizer state
(moments, step counts, momentum buffers, the GradScaler's scale) exactly as they were, because
the step is then rerun eagerly and applies its update there, once. Two mechanisms:

* ``found_inf`` (fused Adam, AdamW and SGD): the fused kernels take a 0-dim float32
  ``found_inf`` tensor and return without writing anything when it holds 1; Adam's step count
  is incremented and then decremented by ``found_inf``. We compute ``found_inf`` inside the
  graph from the flags and set it as ``optimizer.found_inf`` only while ``step()`` is captured.
  Costs nothing.
* masking (every other capturable optimizer, e.g. foreach Adam or SGD): inside the graph, the
  tensors the step writes (parameters that have a gradient and every tensor in their optimizer
  state) are gathered into one flat snapshot per (device, dtype) with ``torch.cat`` before
  ``step()``; after it, ``torch.where(skip, snapshot, current)`` selects per element and a
  multi-tensor copy writes the result back. ``where`` selects instead of blending, so NaN or
  inf written by a step that ran on overflowed (garbage) activations is discarded exactly.
  Costs a transient copy of parameters and state in the graph's pool and about three passes
  over them per step: prefer ``fused=True``.

With a ``torch.amp.GradScaler`` the skip condition is ``flags | scaler found inf`` (the
scaler's own skip, as ``scaler.step`` does), while the scaler's ``update()`` is undone only for
``flags``: an inf found by the scaler is a legitimate step that backs the scale off, a flagged
step is rerun and its rerun updates the scale once.
"""
from __future__ import annotations

import torch

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def check_optimizer(optimizer) -> None:
    """Raise TypeError/ValueError unless ``optimizer`` can be captured in a CUDA graph.

    Adam and AdamW need ``capturable=True`` in every parameter group (their step count then lives
    on the device); SGD captures as is. Other optimizers capture when every group has
    ``capturable=True``.

    Example::

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        check_optimizer(opt)        # passes
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ValueError(f"optimizer: {name} param group {i} has differentiable=True, which "
                             "cannot be captured; construct it with differentiable=False")
        if "capturable" in group:
            if not group["capturable"]:
                raise ValueError(
                    f"optimizer: {name} param group {i} has capturable=False; its step cannot be "
                    f"captured in a CUDA graph. Construct it as torch.optim.{name}(params, ..., "
                    "capturable=True)"
                    + (" (fused=True as well is fastest)" if isinstance(optimizer, SUPPORTED) else ""))
        elif not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(
                f"optimizer: {name} has no capturable option, so its step cannot be captured in a "
                "CUDA graph; use torch.optim.Adam or AdamW with capturable=True, or SGD")


def uses_found_inf(optimizer) -> bool:
    """True when every group of a supported optimizer is fused (skips through ``found_inf``)."""
    return (isinstance(optimizer, SUPPORTED)
            and all(group.get("fused", False) for group in optimizer.param_groups))


def has_state(optimizer) -> bool:
    """True when the optimizer's per-parameter state exists (it is created by the first step)."""
    return len(optimizer.state) > 0


def _written_tensors(optimizer) -> list[torch.Tensor]:
    """Tensors ``optimizer.step()`` may write: params with a grad and their state tensors."""
    out, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            for t in (p, *optimizer.state.get(p, {}).values()):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


class _Snapshot:
    """Flat copies of tensors, one per (device, dtype); see NOTE [update skipping]."""

    def __init__(self, tensors: list[torch.Tensor]):
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        self._groups = list(groups.values())
        with torch.no_grad():
            self._flat = [torch.cat([t.reshape(-1) for t in g]) for g in self._groups]

    def restore_where(self, skip: torch.Tensor) -> None:
        """Write the snapshot back into the tensors where ``skip`` (0-dim bool) is True."""
        with torch.no_grad():
            for group, flat in zip(self._groups, self._flat):
                current = torch.cat([t.reshape(-1) for t in group])
                chosen = torch.where(skip.to(flat.device), flat, current)
                parts = [c.view(t.shape) for c, t in zip(chosen.split([t.numel() for t in group]),
                                                         group)]
                torch._foreach_copy_(group, parts)
        self._flat = None


class DeviceUpdate:
    """``optimizer.step()`` (and the GradScaler's unscale/update) that a device flag can skip.

    Pure tensor work with no host read, so it runs inside a capture as well as eagerly (which
    is how the CPU tests exercise it).

    Args:
        optimizer: a torch optimizer (see :func:`check_optimizer` for what captures).
        scaler: an optional enabled ``torch.amp.GradScaler``; the step function calls
            ``scaler.scale(loss).backward()`` and may call ``scaler.unscale_(optimizer)``.
        mode: ``"auto"`` (``found_inf`` for fused Adam/AdamW/SGD, masking otherwise),
            ``"found_inf"`` or ``"mask"``.
        device: where the 0-dim ``found_inf`` tensor lives (the parameters' device).

    Example::

        update = DeviceUpdate(opt, device="cuda")
        skip = (status[0] != 0) | (status[2] != 0)     # 0-dim bool on the device
        update.step(skip)                              # no-op on the device when skip holds
    """

    def __init__(self, optimizer, *, scaler=None, mode: str = "auto", device="cuda"):
        if mode not in ("auto", "found_inf", "mask"):
            raise ValueError(f"update_skip: expected 'auto', 'found_inf' or 'mask', got {mode!r}")
        if mode == "found_inf" and not uses_found_inf(optimizer):
            raise ValueError("update_skip: 'found_inf' needs a fused torch.optim Adam, AdamW or "
                             f"SGD (fused=True in every group); got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.mode = ("found_inf" if uses_found_inf(optimizer) else "mask") if mode == "auto" else mode
        self.device = torch.device(device)
        self.found_inf: torch.Tensor | None = None

    def allocate(self) -> None:
        """Allocate the 0-dim float32 ``found_inf`` (outside any capture)."""
        if self.found_inf is None:
            self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)

    def release(self) -> None:
        self.found_inf = None

    # ---- eager ------------------------------------------------------------------------
    def eager_step(self) -> None:
        """The ordinary update: ``scaler.step(opt); scaler.update()`` or ``opt.step()``."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    # ---- device-skippable -------------------------------------------------------------
    def _scaler_found_inf(self) -> torch.Tensor:
        from torch.amp.grad_scaler import OptState

        scaler, opt = self.scaler, self.optimizer
        state = scaler._per_optimizer_states[id(opt)]
        if state["stage"] is OptState.READY:
            scaler.unscale_(opt)
        found = list(state["found_inf_per_device"].values())
        if not found:
            raise AssertionError("GradScaler recorded no inf checks for this optimizer")
        total = found[0].to(self.device, non_blocking=True)
        for f in found[1:]:
            total = total + f.to(self.device, non_blocking=True)
        return total > 0

    def step(self, flagged: torch.Tensor) -> None:
        """Apply the update unless ``flagged`` (0-dim bool tensor on the device) is True.

        See NOTE [update skipping]. With a scaler this replaces ``scaler.step(opt)`` and
        ``scaler.update()``.
        """
        opt = self.optimizer
        skip = flagged
        if self.scaler is not None:
            skip = flagged | self._scaler_found_inf()
        if self.mode == "found_inf":
            self.allocate()
            with torch.no_grad():
                self.found_inf.copy_(skip)
            had = hasattr(opt, "found_inf")
            previous = getattr(opt, "found_inf", None)
            opt.found_inf = self.found_inf
            try:
                opt.step()
            finally:
                if had:
                    opt.found_inf = previous
                else:
                    del opt.found_inf
        else:
            snapshot = _Snapshot(_written_tensors(opt))
            opt.step()
            snapshot.restore_where(skip)
        if self.scaler is not None:
            self._scaler_update(flagged)

    def _scaler_update(self, flagged: torch.Tensor) -> None:
        scaler = self.scaler
        kept = [scaler._scale.detach().clone(), scaler._growth_tracker.detach().clone()]
        scaler.update()
        with torch.no_grad():
            for live, old in zip((scaler._scale, scaler._growth_tracker), kept):
                live.copy_(torch.where(flagged.to(live.device), old, live))
