"""What a stash takes: which saved tensors of a group are budget-shaped, and whether stashing
pays at all (the stash plan).

NOTE [stash plan]: stashing lowers the peak only where the budget holds dead rows, and only
where the pages it adds are not what sets the peak. A stashed group's budget-sized tensors
leave the device between its forward and its backward, and its live rows sit in pages
(``device_factor x`` the live bytes). So with ``B`` a group's budget bytes and ``V`` its live
bytes, stashing lowers the memory of the step by ``B - device_factor * V`` while the group is
away. Where the pages are is ``StashConfig.pool``: with ``"per_group"`` (NOTE [pages per
group] in ``scheduler.py``) only while the group is away; with ``"shared"`` in one pool
created before the step and held for all of it, which raises the memory by ``device_factor *
V`` everywhere else: at the end of backward most of all, where a step holds every gradient.
Measured on two H100s (qwen3-30b-a3b widths, expert parallel, 8 layers, capacity factor
1.25; docs/exchange.md, "The stash at expert parallelism"): without the stash the peak came
early in backward (5.0 GiB of saved tensors, 0.6 GiB of gradients); with a shared pool and
every group but the last stashed, at the end of backward (the 3.2 GiB pool beside 4.5 GiB of
gradients), 2.8 GiB higher.

The first warmup step measures what the plan needs: its groups keep their tensors and note
their demand (``B`` and ``V``), and on a GPU the allocator's bytes in use are read at every
group's forward end (``F``), every group's backward start (``B``) and the end of each backward
pass (``E``), a host read with no sync. :func:`predicted_peak` replays those levels with a set
of groups stashed: a stashed group's ``B`` is gone from the event after its ``F`` until its
``B``, its pages are added from its ``F`` to its ``B`` (a shared pool: throughout), and one
group's ``B`` at each backward start as the reload's working set (a prefetch can bring it in
before the group before it is done; not with ``prefetch="on_demand"``). Under
``policy="auto"`` the plan stashes the first ``k`` groups in forward order (they are away the
longest) for the ``k`` with the lowest predicted peak, and none unless that is below the
step's own; each group's row says why. Without levels (the CPU) it stashes every group or
none, by the start of backward alone: the saving ``sum(B - device_factor * V)`` against the
largest ``B``. :meth:`StashManager.plan` shows the measurement and the choice.

The plan is made once. :meth:`StashManager.replan` makes it again from the next step, but
``graph_step`` does not call it when a dispatch budget grows. Measured on two H100s (the
expert-parallel bench, qwen3-30b-a3b widths, 8 layers, 200 steps), with the plan made again
after the budgets grew, the stash row under ``zipf:1.2`` and ``drift`` had one stash overflow
and one more dropless rerun than the same row without the stash, and a peak 4.4 and 8.4 GiB
higher (27360 and 31421 MiB against 22831); keeping the first plan, it has neither.

NOTE [on-demand plan]: the levels are read at group boundaries, so they miss what a group's
backward allocates inside it (its budget-shaped gradients): where the predicted peak is set by
the end of backward, stashing one more group does not change it, yet lowers the start of
backward, which holds the groups kept plus the first backward's temporaries. Measured on two
H200 (qwen3-30b-a3b widths, expert parallel, 8 layers, capacity factor 2.0, ``prefetch=
"on_demand"``; docs/exchange.md, "Reloads on demand"): with the first 6 of 7 groups stashed
(the fewest at the lowest predicted peak) the peak came at the start of backward, beside the
two groups kept, 1.21x the activation of the budget rows at capacity factor 1.25; with all 7,
1.08x. With ``prefetch="on_demand"`` (a memory-first choice: no reload beside another group's
backward) the plan therefore takes the most groups whose predicted peak is within ``TIE`` of
the lowest; with a prefetch it takes the fewest (each stashed group costs two copies).

NOTE [last group kept]: when the recorded schedule says a group's backward directly follows
its own forward (the last layer before the loss), stashing it would copy rows out and back
with nothing in between; the group keeps its tensors instead and takes no pages.

NOTE [rows the stash keeps]: a stashed group's pages hold ``device_factor`` (plus
``host_factor``) x its measured live rows; a step whose routing fills more overflows the
pool and is rerun dropless, and the stash grows (NOTE [stash growth] in
``graphstash/graph/_step.py``). Rows of the budget past what the pages hold can never reach a
gradient that is kept, yet the experts computed on the whole budget: their reloads and every
temporary of their backward were budget-sized, and with a generous budget those set the
step's peak (qwen3-30b-a3b widths, expert parallel, capacity factor 4.0: one group's reloaded
input and pre-activation, 1.8 GiB, and its output and activation gradients, 1.4 GiB, beside
the gradients late in backward; docs/exchange.md, "Rows the stash keeps"). So under a
live-row exchange the experts of such a group compute on the rows its pages hold
(:meth:`StashManager.next_group_rows`, ``dispatch(keep_rows=)``,
:meth:`~graphstash.moe.exchange.ExchangePlan.keep_rows`): the permuted buffer, the saved
tensors, the reloads and the backward's temporaries all shrink to them, and a routing that
fills more raises ``OVERFLOW_POOL``, as the pool itself would. The group the plan keeps only
because its backward follows its own forward computes on as many rows, when the plan stashes
any group: it holds as many rows as the pages would. A group the plan keeps by choice (its
stash would not lower the peak) computes on its whole budget, and a plan that stashes nothing
changes nothing. One device keeps the whole budget: its experts regather their input and keep
only the pre-activation (NOTE [regathered input] in ``graphstash/moe/mlp.py``).

NOTE [growth to the need]: under drifting routing (the favoured rank moves), a rank's rows
jump: on two H100s, qwen3-30b-a3b widths, capacity factor 2.0, `drift` with the stash, the
rank whose plan was made while its experts were not favoured got several times the rows it
kept once the favoured rank moved (on two gloo ranks, ``tests/test_rows_kept.py``, 2.5
times). The stash grew by ``budget_growth`` (1.5) per overflow, reran each time, and
sized its pages from ``device_factor`` x the pages the device had seen, which were already
``device_factor`` x the rows measured (a group never fills more than it keeps): the two
factors multiplied, and a capture asked for 8 GiB of pages and failed for want of memory
(docs/exchange.md, "Rows the stash keeps"). So, once a group computes on the rows its pages
hold: the pages are sized from the demand the plan measured, x ``device_factor``, not from
the device's marks (``StashBuffers.fold_device_demand``, for the manager's buffers as a whole:
groups of other layers in the same stash then grow by the factor alone); a step that overflowed grows
``device_factor`` to the rows it asked for, not by a fixed step: by the step's fill (the rows
asked for over the rows kept, the most over the groups and the ranks; NOTE [stash growth
ahead] in ``graphstash/graph/_step.py``) x ``NEED_HEADROOM`` (1.1, in ``manager.py``), or
by ``budget_growth`` if that is more (:meth:`StashManager.growth`); and where ``device_factor`` x the measured live
rows would hold as much as the budget rows the stash frees, summed over the stashed groups,
the plan steps aside (:meth:`StashPlan.step_aside`): it stashes nothing from then on, its
pages are freed, and every group computes on its budget, as without the stash. A rank steps
aside by its own plan; ranks whose rows were few keep stashing. One device, whose groups keep
their budgets, grows as before.
"""
from __future__ import annotations

import math

from .. import _layout as L
from ..tables import Column, Table
from ._group import Group
from ._schedule import Event, kept_last
from .config import StashConfig

MIB = 2 ** 20
TIE = 0.005         # NOTE [on-demand plan]: predicted peaks this close (of the step's) are equal


def classify(group: Group, page_size: int, per_group: bool = False) -> None:
    """Give every budget-shaped entry of ``group`` its layout, buffer key and record length;
    the key is ``(dtype, width)``, or ``(group id, dtype, width)`` with ``per_group`` (NOTE
    [pages per group] in ``scheduler.py``).

    NOTE [budget]: a saved tensor is stashed when its leading dimension (rows) or, with ``S``
    counts, its second dimension (rows per segment, after ``S``) is the budget: the
    ``max_tokens`` given to the context or, if none, the one that holds the most bytes among
    the context's candidates (ties: the larger). Row width is everything after.
    """
    for scope in group.all_scopes:
        entries = [e for e in group.entries if e.scope is scope]
        if not entries:
            continue
        S = scope.segments
        axis = 0 if S == 1 else 1
        budget = scope.max_tokens
        if budget is None:
            weight: dict[int, int] = {}
            for e in entries:
                lead = e.shape[axis]
                weight[lead] = weight.get(lead, 0) + e.tensor.numel() * e.tensor.element_size()
            budget = max(weight, key=lambda k: (weight[k], k))
        for e in entries:
            if e.shape[axis] == budget:
                width = e.tensor.numel() // (S * budget)
                e.layout = (S, budget, width)
                e.key = (group.gid, e.dtype, width) if per_group else (e.dtype, width)
                e.record_len = L.H_HEADER + S + S * (-(-budget // page_size))


def predicted_peak(timeline: list, stashed, budget: dict, live: dict, factor: float,
                   per_group: bool = False, prefetch: bool = True) -> float:
    """The highest level of a measured step's ``timeline`` with the groups ``stashed`` stashed
    (NOTE [stash plan]).

    Args:
        timeline: ``[(kind, gid, bytes), ...]`` in step order: ``"F"`` a group's forward
            ended, ``"B"`` its backward started, ``"E"`` a backward pass ended (gid unused),
            each with the bytes in use then, measured with nothing stashed.
        stashed: the gids stashed.
        budget, live: ``{gid: bytes}`` of each group's budget-sized tensors and of their live
            rows.
        factor: the pool's size over the live bytes it holds (``device_factor``).
        per_group: each stashed group's pages exist from its forward end until its backward
            start (``pool="per_group"``), not through the whole step (``"shared"``).
        prefetch: a reload may come in beside the backward of the group before it (``False``
            for ``StashConfig.prefetch="on_demand"``: a group's reload replaces it).
    """
    stashed = set(stashed)
    pool = 0.0 if per_group else factor * sum(live[g] for g in stashed)
    reload = max((budget[g] for g in stashed), default=0)
    away, leaving, lent = set(), set(), set()
    peak = 0.0
    for kind, gid, level in timeline:
        away |= leaving             # the originals go at the next schedule point
        leaving = set()
        if kind == "F" and gid in stashed:
            leaving.add(gid)
            if per_group:
                lent.add(gid)
        elif kind == "B":
            away.discard(gid)
        here = level + pool + factor * sum(live[g] for g in lent) - sum(
            budget[g] for g in away)
        if kind == "B":
            if stashed and prefetch:
                here += reload
            lent.discard(gid)       # its pages are given back once its reload is done
        peak = max(peak, here)
    return peak


class StashPlan:
    """The stash plan (NOTE [stash plan]): made once, from the first measured step.

    Attributes:
        rows: one dict per layer group of that step, ``{"group", "name", "budget_bytes",
            "live_bytes", "stashed", "why"}`` (empty before it is made).
        keep_all: True when no group is stashed (``policy="never"``, or the plan said so).
        predicted: ``(peak without stashing, peak with the plan)`` in bytes, from the
            measured levels (None without them).
    """

    def __init__(self, policy: str):
        self.rows: list[dict] = []
        self.made = False
        self.keep_all = policy == "never"
        self.predicted: tuple[float, float] | None = None
        self._stashed: set[int] = set()
        self._measured: set[int] = set()
        self._unseen = False              # what a group the measured step lacked gets
        self._rows: dict[int, int] = {}   # gid -> the most live rows measured
        self._bytes: dict[int, tuple[int, int]] = {}   # gid -> (budget, live) bytes measured
        self._last: set[int] = set()      # NOTE [last group kept]

    def stashes(self, gid: int) -> bool:
        """Whether group ``gid`` is stashed: every group until the plan is made (its demand is
        measured), then the plan's choice; a group the measured step did not have, as the
        plan decided for all (without levels) or not (a plan by levels stashes a prefix of
        the groups, and a group past them comes later still)."""
        if not self.made:
            return True
        if gid in self._measured:
            return gid in self._stashed
        return self._unseen

    def rows_kept(self, gid: int, factor: float, page_size: int) -> int | None:
        """The rows group ``gid``'s experts compute on (NOTE [rows the stash keeps]): what
        its pages hold, ``factor`` x its measured live rows in whole pages of ``page_size``
        rows, when the plan stashes it, or keeps it only because its backward follows its
        forward while it stashes others; None otherwise (its whole budget)."""
        if not self.made or self.keep_all or gid not in self._measured:
            return None
        if gid not in self._stashed and gid not in self._last:
            return None
        rows = self._rows.get(gid, 0)
        if rows <= 0:
            return None
        return page_size * math.ceil(factor * rows / page_size - 1e-9)

    def step_aside(self, device_factor: float) -> bool:
        """NOTE [growth to the need]: whether pages of ``device_factor`` x the measured live
        rows would hold at least the budget rows the stashed groups free (summed over them); if
        so the plan stashes nothing from now on (each row says why) and True."""
        if not self.made or self.keep_all or not self._stashed:
            return False
        budget = sum(self._bytes[g][0] for g in self._stashed)
        live = sum(self._bytes[g][1] for g in self._stashed)
        if device_factor * live < budget:
            return False
        why = (f"steps aside: device_factor {device_factor:.3g} x the live rows "
               f"({device_factor * live / MIB:.0f} MiB) holds at least the budget rows "
               f"stashing frees ({budget / MIB:.0f} MiB)")
        for row in self.rows:
            if row["stashed"]:
                row["stashed"], row["why"] = False, why
        self._stashed, self._last = set(), set()
        self._unseen = False
        self.keep_all = True
        return True

    def make(self, events: list[Event], groups: list[Group], config: StashConfig,
             timeline: list | None = None) -> None:
        """Decide from the step's events, its groups' measured bytes and, where measured, the
        bytes in use along the step (``timeline``, as :func:`predicted_peak` takes it) which
        groups are stashed."""
        last = kept_last(events)
        f = config.device_factor
        budget = {g.gid: sum(b for b, _ in g.plan_bytes.values()) for g in groups}
        live = {g.gid: sum(v for _, v in g.plan_bytes.values()) for g in groups}
        order = {gid: i for i, (kind, gid, _) in enumerate(events) if kind == "F"}
        candidates = sorted((g.gid for g in groups if g.gid not in last),
                            key=lambda gid: order.get(gid, gid))
        policy = config.policy
        usable = bool(timeline) and any(kind == "E" for kind, _, _ in timeline) and all(
            gid in order for gid in candidates)
        if policy != "auto":
            chosen = set(candidates) if policy == "always" else set()
            why = {gid: f"policy={policy!r}" for gid in candidates}
        elif usable:
            chosen, why = self._by_levels(timeline, candidates, budget, live, f,
                                          config.pool == "per_group",
                                          config.prefetch != "on_demand")
        else:
            saving = sum(budget[g] - f * live[g] for g in candidates)
            cost = max((budget[g] for g in candidates), default=0)
            chosen = set(candidates) if saving > cost else set()
            if saving >= 0:
                text = (f"saves {saving / MIB:.1f} MiB of budget rows, costs {cost / MIB:.1f} "
                        "MiB for a reload")
            else:                       # the pool would hold more than the rows it frees
                text = (f"its pool costs {-saving / MIB:.1f} MiB more than the budget rows it "
                        f"frees, and {cost / MIB:.1f} MiB for a reload")
            why = {gid: text for gid in candidates}
        self.rows = [{"group": g.gid, "name": g.name, "budget_bytes": budget[g.gid],
                      "live_bytes": live[g.gid], "stashed": g.gid in chosen,
                      "why": "last group before backward: kept" if g.gid in last
                      else why[g.gid]} for g in groups]
        self._stashed = chosen
        self._measured = {g.gid for g in groups}
        self._rows = {g.gid: g.rows_peak for g in groups}
        self._bytes = {g.gid: (budget[g.gid], live[g.gid]) for g in groups}
        self._last = set(last)
        self._unseen = bool(chosen) and (policy == "always" or not usable)
        self.made = True
        self.keep_all = not chosen

    def _by_levels(self, timeline, candidates, budget, live, f, per_group, prefetch):
        """The first ``k`` candidates whose stashing gives the lowest predicted peak (NOTE
        [stash plan]); ``(chosen gids, {gid: why})``."""
        peaks = [predicted_peak(timeline, candidates[:k], budget, live, f, per_group, prefetch)
                 for k in range(len(candidates) + 1)]
        k = min(range(len(peaks)), key=lambda i: (peaks[i], i))
        if k and not prefetch:      # NOTE [on-demand plan]: the most groups the levels allow
            k = max(i for i in range(len(peaks)) if peaks[i] <= peaks[k] + TIE * peaks[0])
        self.predicted = (peaks[0], peaks[k])
        chosen = set(candidates[:k])
        if k:
            text = (f"first {k} of {len(candidates)}: the measured step's peak "
                    f"{peaks[0] / MIB:.0f} -> {peaks[k] / MIB:.0f} MiB predicted")
        else:
            best = min(peaks[1:], default=peaks[0])
            text = (f"stashing would not lower the measured step's peak: {peaks[0] / MIB:.0f} "
                    f"-> {best / MIB:.0f} MiB predicted at best")
        why = {}
        for gid in candidates:
            if gid in chosen or not k:
                why[gid] = text
            else:
                why[gid] = (f"kept: stashing more than the first {k} would not lower the "
                            "predicted peak")
        return chosen, why

    def table(self, fmt: str = "text") -> str:
        """:attr:`rows` as a table (bytes in MiB) in ``fmt``: ``"text"`` or ``"md"``."""
        return Table(_PLAN, fmt).render([[r["group"], str(r["name"]), r["budget_bytes"] / MIB,
                              r["live_bytes"] / MIB, "yes" if r["stashed"] else "no",
                              r["why"]] for r in self.rows])


_PLAN = (Column("group"), Column("name"), Column("budget MiB", ".1f"), Column("live MiB", ".1f"),
         Column("stashed"), Column("why"))
