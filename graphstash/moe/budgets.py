"""Per-layer dispatch budgets that adapt to the rows each layer needs.

NOTE [adaptive budgets]: a static budget is a bet on the routing. Balanced routers keep it;
real ones do not (one rank's experts favoured early in training, popular experts, favourites
that move), and a budget that is too small for one layer makes every step over budget and
rerun. So each MoE layer has its own budget, a capacity factor (its rows over the average rows
a rank receives, :func:`~graphstash.moe.budget_rows`), and learns what it needs without a host
read of its own:

- **measure**: each dispatch raises its layer's need (the rows the routing asked of this
  rank, padding included) as a named peak of the step's status (NOTE [step peaks] in
  ``graphstash/status.py``); the step reduces the peaks across ranks (their maximum) in the
  exchange that already combines its flags, and hands them to :meth:`DispatchBudgets.observe`
  with the flags it reads anyway. Every rank sees the same values and takes the same
  decisions, so the budgets (and the exchange's headers that carry them) agree on every rank.
- **grow**: after an over-budget step (rerun dropless, its update applied once), every layer
  whose need passed its budget grows to ``need x headroom``, bounded by the worst case (every
  row on one rank: ``world_size``) and by ``max_capacity_factor``, the memory cap. A graph
  bakes the budgets in: a change bumps :attr:`DispatchBudgets.version`, and ``graph_step``
  runs one eager step at the new sizes and recaptures once.
- **shrink**, with hysteresis: a layer that grew may come back down after ``shrink_after``
  steps in which its need times ``headroom x shrink_margin`` stayed at or below its budget,
  to that window's peak need x headroom, never below the factor it started at. A layer that
  shrinks to ``need x headroom`` is again ``shrink_margin`` away from shrinking, and a need
  that fits it does not grow it: budgets do not oscillate.

What each layer needed, its budget, the capacity factor it needed, and the reruns and
recaptures it caused are in :meth:`DispatchBudgets.stats` (and :meth:`DispatchBudgets.table`);
:meth:`state_dict` / :meth:`load_state_dict` keep the budgets with a checkpoint (the reference
model saves them with its own state).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..status import StepStatus, claim_peak_slot, current, raise_peak

__all__ = ["DispatchBudgets", "LayerBudget"]


def _positive_float(name: str, value, *, above: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= above:
        raise ValueError(f"{name}: expected a finite float > {above:g}, got {value}")
    return float(value)


@dataclasses.dataclass
class _Layer:
    factor: float                 # the capacity factor in use
    start: float                  # the factor it started at (the floor of a shrink)
    sizing: tuple = ()            # budget_rows' arguments at the last dispatch, but the factor
    max_rows: int | None = None   # the most rows the exchange holds (a given transport)
    need: int = 0                 # the last step's need (rows, maximum over the ranks)
    peak: int = 0                 # the largest need seen
    window: int = 0               # the largest need since the last change or window start
    window_steps: int = 0
    over: int = 0                 # steps whose need passed the budget
    grows: int = 0
    shrinks: int = 0
    capped: int = 0               # over-budget steps whose growth the cap refused


def _rows_now(entry: _Layer) -> int | None:
    """The layer's budget in rows at its factor now, for the sizes of its last dispatch seen
    outside a trace (None before one: NOTE [budgets under torch.compile])."""
    if not entry.sizing:
        return None
    from ._dispatch import budget_rows

    num_tokens, topk, num_experts, pad, world = entry.sizing
    return budget_rows(num_tokens, topk, num_experts, capacity_factor=entry.factor,
                       pad_multiple=pad, world_size=world)


def _avg_rows(entry: _Layer) -> int:
    """The average rows a rank receives at the layer's last sizes: ``T x K / W`` over the
    group's tokens (at least 1)."""
    num_tokens, topk, _, _, world = entry.sizing
    return max(1, num_tokens * topk // world)


class DispatchBudgets:
    """The dispatch budgets of a model's MoE layers (NOTE [adaptive budgets]).

    Args:
        capacity_factor: every layer's starting budget, as a multiple of the average rows a
            rank receives (as for :func:`~graphstash.moe.budget_rows`).
        headroom: a grown or shrunk budget is the need times this (> 1).
        max_capacity_factor: the memory cap: no layer grows past this factor (default: the
            worst case, every row on one rank).
        shrink_after: steps a grown layer's need must stay well below its budget before it
            shrinks; 0 never shrinks.
        shrink_margin: how far below: ``need x headroom x shrink_margin <= budget`` (> 1).
        adapt: False keeps every budget where it is (the step still measures the needs).

    Example::

        budgets = DispatchBudgets(capacity_factor=1.25)
        out = moe_layer(x, idx, w, w1, w2, E, budget=budgets.layer("blocks.0"), ...)
        ...                           # graph_step grows a layer after an over-budget step
        print(budgets.table())        # each layer's budget, need, needed factor, reruns
    """

    def __init__(self, capacity_factor: float = 1.25, *, headroom: float = 1.25,
                 max_capacity_factor: float | None = None, shrink_after: int = 200,
                 shrink_margin: float = 2.0, adapt: bool = True):
        self.capacity_factor = _positive_float("capacity_factor", capacity_factor)
        self.headroom = _positive_float("headroom", headroom, above=1.0)
        self.max_capacity_factor = (None if max_capacity_factor is None else
                                    _positive_float("max_capacity_factor", max_capacity_factor))
        if self.max_capacity_factor is not None and \
                self.max_capacity_factor < self.capacity_factor:
            raise ValueError(f"max_capacity_factor: expected at least capacity_factor="
                             f"{self.capacity_factor:g}, got {self.max_capacity_factor:g}")
        if isinstance(shrink_after, bool) or not isinstance(shrink_after, int) or \
                shrink_after < 0:
            raise ValueError(f"shrink_after: expected an int >= 0, got {shrink_after!r}")
        self.shrink_after = shrink_after
        self.shrink_margin = _positive_float("shrink_margin", shrink_margin, above=1.0)
        if not isinstance(adapt, bool):
            raise TypeError(f"adapt: expected a bool, got {type(adapt).__name__}")
        self.adapt = adapt
        self.version = 0
        self.steps = 0                # steps observed
        self.reruns = 0               # flagged steps observed
        self.changes = 0              # steps after which some budget changed (recaptures)
        self._layers: dict[str, _Layer] = {}
        self._handles: dict[str, LayerBudget] = {}

    def __repr__(self) -> str:
        return (f"DispatchBudgets(layers={len(self._layers)}, capacity_factor="
                f"{self.capacity_factor:g}, version={self.version})")

    # ---- layers -------------------------------------------------------------------------
    def layer(self, key: str) -> "LayerBudget":
        """The budget of the layer named ``key`` (made at the first call, at the starting
        factor): what ``budget=`` of :func:`~graphstash.moe.moe_layer` takes."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"key: expected a non-empty str naming the layer, got {key!r}")
        handle = self._handles.get(key)
        if handle is None:
            if key not in self._layers:                 # a restored layer keeps its factor
                self._layers[key] = _Layer(factor=self.capacity_factor,
                                           start=self.capacity_factor)
            handle = self._handles[key] = LayerBudget(self, key)
        return handle

    @property
    def keys(self) -> list:
        """The layers' names, in the order they were made."""
        return list(self._layers)

    def factor(self, key: str) -> float:
        """The capacity factor layer ``key`` dispatches with now."""
        return self._entry(key).factor

    def set_factor(self, key: str, capacity_factor: float) -> None:
        """Set layer ``key``'s capacity factor (for example from ``on_overflow``); a captured
        step recaptures (the version changes)."""
        entry = self._entry(key)
        value = _positive_float("capacity_factor", capacity_factor)
        if value != entry.factor:
            entry.factor = value
            entry.window, entry.window_steps = 0, 0
            self.version += 1

    def largest_factor(self) -> float:
        """The largest factor of any layer (the starting one when there are none): what a
        receive region must hold (NOTE [exchange sizing] in
        ``graphstash/moe/exchange/factory.py``)."""
        return max([self.capacity_factor] + [e.factor for e in self._layers.values()])

    def factor_range(self) -> str:
        """The layers' capacity factors now, as ``"1.25"`` or ``"1.25-1.93"`` (the starting
        factor when no layer ran yet)."""
        factors = [e.factor for e in self._layers.values()] or [self.capacity_factor]
        lo, hi = min(factors), max(factors)
        return f"{lo:.3g}" if lo == hi else f"{lo:.3g}-{hi:.3g}"

    def _entry(self, key: str) -> _Layer:
        entry = self._layers.get(key)
        if entry is None:
            raise KeyError(f"key: no layer named {key!r} (layers: {self.keys})")
        return entry

    # ---- the step (NOTE [adaptive budgets]) ---------------------------------------------
    def observe(self, peaks: dict, *, flagged: bool) -> None:
        """Take one step's needs (``{key: rows}``, the maximum over the ranks) and whether it
        was flagged (rerun); grow after an over-budget step, shrink after a long quiet
        window. Called by the step that owns the status (``graph_step``), on every rank with
        the same values."""
        self.steps += 1
        self.reruns += bool(flagged)
        changed = False
        for key, need in peaks.items():
            entry = self._layers.get(key)
            if entry is None:
                continue
            entry.need = need
            entry.peak = max(entry.peak, need)
            entry.window = max(entry.window, need)
            entry.window_steps += 1
            rows = _rows_now(entry)
            if rows is None:                   # no dispatch seen outside a trace yet
                continue
            if need > rows:
                entry.over += 1
            if not self.adapt:
                continue
            if need > rows:
                changed |= self._grow(entry, need)
            elif self._may_shrink(entry):
                changed |= self._shrink(entry)
        if changed:
            self.version += 1
            self.changes += 1

    def _cap(self, entry: _Layer) -> float:
        worst = float(entry.sizing[4])                 # every row on one rank: world_size
        return worst if self.max_capacity_factor is None else min(worst,
                                                                  self.max_capacity_factor)

    def _grow(self, entry: _Layer, need: int) -> bool:
        wanted = min(self._cap(entry), need * self.headroom / _avg_rows(entry))
        wanted = self._fit(entry, wanted)
        if wanted <= entry.factor:
            entry.capped += 1
            return False
        entry.factor = wanted
        entry.grows += 1
        entry.window, entry.window_steps = 0, 0
        return True

    @staticmethod
    def _fit(entry: _Layer, factor: float) -> float:
        """``factor``, lowered until its rows fit the exchange's ``max_rows`` (if any)."""
        if entry.max_rows is None or not entry.sizing:
            return factor
        from ._dispatch import budget_rows

        num_tokens, topk, num_experts, pad, world = entry.sizing
        for _ in range(64):
            rows = budget_rows(num_tokens, topk, num_experts, capacity_factor=factor,
                               pad_multiple=pad, world_size=world)
            if rows <= entry.max_rows:
                return factor
            factor *= (entry.max_rows - 1) / rows
        return entry.factor

    def _may_shrink(self, entry: _Layer) -> bool:
        if not self.shrink_after or entry.factor <= entry.start:
            return False
        if entry.window_steps < self.shrink_after:
            return False
        quiet = entry.window * self.headroom * self.shrink_margin <= _rows_now(entry)
        if not quiet:                                    # start the next window
            entry.window, entry.window_steps = 0, 0
        return quiet

    def _shrink(self, entry: _Layer) -> bool:
        target = max(entry.start, entry.window * self.headroom / _avg_rows(entry))
        entry.window, entry.window_steps = 0, 0
        if target >= entry.factor:
            return False
        entry.factor = target
        entry.shrinks += 1
        return True

    # ---- what it did --------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """One dict per layer: ``layer``, ``budget_rows`` (at its factor now; None before a
        dispatch was seen outside a trace),
        ``capacity_factor`` (now), ``need_rows`` (last step) and ``peak_rows`` (the most seen),
        ``needed_factor`` (the peak over the average rows), ``over_budget`` (steps whose need
        passed the budget: the reruns it caused), ``grows`` and ``shrinks`` (the recaptures it
        caused) and ``capped`` (growths the cap refused)."""
        out = []
        for key, e in self._layers.items():
            out.append({"layer": key, "budget_rows": _rows_now(e), "capacity_factor": e.factor,
                        "need_rows": e.need, "peak_rows": e.peak,
                        "needed_factor": e.peak / _avg_rows(e) if e.sizing else 0.0,
                        "over_budget": e.over, "grows": e.grows, "shrinks": e.shrinks,
                        "capped": e.capped})
        return out

    def table(self, fmt: str = "text") -> str:
        """:meth:`stats` as a table (``fmt``: ``"text"`` or ``"md"``, :mod:`graphstash.tables`),
        with the steps, reruns and recaptures seen."""
        from ..tables import Column, format_table

        columns = [Column("layer"), Column("budget rows", "d"), Column("factor", ".3g"),
                   Column("need", "d"), Column("peak need", "d"), Column("needed factor", ".3g"),
                   Column("over budget", "d"), Column("grows", "d"), Column("shrinks", "d"),
                   Column("capped", "d")]
        keys = ("layer", "budget_rows", "capacity_factor", "need_rows", "peak_rows",
                "needed_factor", "over_budget", "grows", "shrinks", "capped")
        rows = [[s[k] for k in keys] for s in self.stats()]
        title = (f"dispatch budgets: {self.steps} steps, {self.reruns} rerun, "
                 f"{self.changes} recaptured")
        return format_table(columns, rows, fmt, title=title)

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The layers' factors and counters (plain Python values)."""
        return {"version": 1, "steps": self.steps, "reruns": self.reruns,
                "changes": self.changes,
                "layers": {k: dataclasses.asdict(e) for k, e in self._layers.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a captured step recaptures with the restored budgets."""
        if not isinstance(state, dict) or state.get("version") != 1 or \
                not isinstance(state.get("layers"), dict):
            raise ValueError(f"state: expected a DispatchBudgets.state_dict(), got {state!r}")
        layers = {}
        for key, fields in state["layers"].items():
            try:
                layers[key] = _Layer(**fields)
            except TypeError as exc:
                raise ValueError(f"state: layer {key!r}: {exc}") from None
            _positive_float(f"state['layers'][{key!r}]['factor']", layers[key].factor)
        for key, handle in self._handles.items():    # layers made here keep their slots
            layers.setdefault(key, _Layer(factor=self.capacity_factor,
                                          start=self.capacity_factor))
        self._layers = layers
        self.steps, self.reruns = int(state["steps"]), int(state["reruns"])
        self.changes = int(state["changes"])
        self.version += 1


class LayerBudget:
    """One layer's adaptive budget (:meth:`DispatchBudgets.layer`): what ``budget=`` of
    :func:`~graphstash.moe.moe_layer` takes in place of a number of rows."""

    def __init__(self, owner: DispatchBudgets, key: str):
        self.owner = owner
        self.key = key
        self.slot = claim_peak_slot(owner, key)      # NOTE [step peaks]

    def __repr__(self) -> str:
        return f"LayerBudget({self.key!r}, factor={self.owner.factor(self.key):.3g})"

    def rows(self, num_tokens: int, topk: int, num_experts: int, *,
             pad_multiple: int | None, world_size: int) -> int:
        """The budget in rows for ``num_tokens`` tokens over the whole group (as
        :func:`~graphstash.moe.budget_rows` takes them) at the layer's factor now. Reads the
        factor and nothing else (NOTE [budgets under torch.compile])."""
        from ._dispatch import budget_rows

        return budget_rows(num_tokens, topk, num_experts,
                           capacity_factor=self.owner._entry(self.key).factor,
                           pad_multiple=pad_multiple, world_size=world_size)

    # NOTE [budgets under torch.compile]: torch.compile traces the model's forward whole
    # (fullgraph in budget mode), and a value read there becomes a guard: a guard that flips
    # between the warmup and the capture would recompile inside the capture, which graph_step
    # refuses. So the traced part reads a layer's factor (it changes only after a step, and
    # the eager step graph_step then runs recompiles) and raises the need into a slot claimed
    # when the layer was made (a constant index into the current status's peaks); the host's
    # bookkeeping of the sizes runs only where the forward is not traced (an uncompiled model,
    # or the dropless rerun, which runs uncompiled): the budgets adapt from the first rerun.
    def record(self, demand_rows: torch.Tensor, status, *, num_tokens: int, topk: int,
               num_experts: int, pad_multiple: int | None, world_size: int,
               max_rows: int | None = None) -> None:
        """After a dispatch sized by :meth:`rows` from the same arguments, raise this layer's
        need on the running step's status (NOTE [step peaks]): ``demand_rows`` is the int64
        ``[1]`` rows it asked for, on the tokens' device; ``status`` as dispatch takes it
        (None: the running step's; with none running nothing observes the need and it is not
        raised). ``max_rows``: the most rows the exchange can
        receive (a transport that cannot be rebuilt larger), which no growth passes.
        Capturable, and traced whole by torch.compile (NOTE [budgets under torch.compile])."""
        if not torch.compiler.is_compiling():
            entry = self.owner._entry(self.key)
            entry.sizing = (num_tokens, topk, num_experts, pad_multiple, world_size)
            entry.max_rows = max_rows
        owner = _status_owner(status, demand_rows.device)
        if owner is not None:
            raise_peak(owner.peaks, self.slot, demand_rows)


def _status_owner(status, device: torch.device) -> StepStatus | None:
    """The StepStatus a layer's need goes to: ``status``'s owner, else the current step's;
    None where nobody reads it (no step running, or a bare status tensor under torch.compile,
    whose owner is found by identity: not traceable)."""
    if status is None:
        return current(device)
    if isinstance(status, StepStatus):
        return status
    if torch.compiler.is_compiling():
        return None
    return StepStatus.of(status)
