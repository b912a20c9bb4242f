"""What a stash takes: which saved tensors of a group are budget-shaped, and whether stashing
pays at all (the stash plan).

NOTE [stash plan]: stashing lowers the peak only where the budget holds dead rows. At the
start of backward a plain step holds every group's budget-sized tensors; a stashing step holds
the pool (``device_factor x`` the live rows of the stashed groups), the last group (kept) and
one reloaded group at budget size. So with ``B`` a group's budget bytes and ``V`` its live
bytes, stashing saves ``sum(B - device_factor * V)`` over the stashed groups and costs the
largest ``B`` as the reload's working set. The first warmup step measures both (its groups
keep their tensors and note their demand anyway); under ``policy="auto"`` the manager stashes
from then on only if the saving exceeds the cost, else it leaves every group to autograd and
creates no pool (on one GPU a dropless budget of exactly ``T x K`` rows has no dead rows, so
there the stash steps aside). :meth:`StashManager.plan` shows the measurement and the choice.

NOTE [last group kept]: when the recorded schedule says a group's backward directly follows
its own forward (the last layer before the loss), stashing it would copy rows out and back
with nothing in between; the group keeps its tensors instead and takes no pages.
"""
from __future__ import annotations

from .. import _layout as L
from ..tables import Column, Table
from ._group import Group
from ._schedule import Event, kept_last
from .config import StashConfig


def classify(group: Group, page_size: int) -> None:
    """Give every budget-shaped entry of ``group`` its layout, buffer key and record length.

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
                e.key = (e.dtype, width)
                e.record_len = L.H_HEADER + S + S * (-(-budget // page_size))


class StashPlan:
    """The stash plan (NOTE [stash plan]): made once, from the first measured step.

    Attributes:
        rows: one dict per layer group of that step, ``{"group", "name", "budget_bytes",
            "live_bytes", "stashed", "why"}`` (empty before it is made).
        keep_all: True when no group is stashed (``policy="never"``, or the plan said so).
    """

    def __init__(self, policy: str):
        self.rows: list[dict] = []
        self.made = False
        self.keep_all = policy == "never"

    def make(self, events: list[Event], groups: list[Group], config: StashConfig) -> None:
        """Decide from the step's events and its groups' measured bytes whether stashing pays."""
        last = kept_last(events)
        f = config.device_factor
        rows, saving, cost = [], 0.0, 0
        for g in groups:
            budget = sum(b for b, _ in g.plan_bytes.values())
            live = sum(v for _, v in g.plan_bytes.values())
            rows.append({"group": g.gid, "name": g.name, "budget_bytes": budget,
                         "live_bytes": live, "stashed": False})
            if g.gid not in last:
                saving += budget - f * live
                cost = max(cost, budget)
        policy = config.policy
        stash = policy == "always" or (policy == "auto" and saving > cost)
        if policy == "auto" and saving >= 0:
            why = (f"saves {saving / 2**20:.1f} MiB of budget rows, costs {cost / 2**20:.1f} "
                   "MiB for a reload")
        elif policy == "auto":          # the pool would hold more than the rows it frees
            why = (f"its pool costs {-saving / 2**20:.1f} MiB more than the budget rows it "
                   f"frees, and {cost / 2**20:.1f} MiB for a reload")
        else:
            why = f"policy={policy!r}"
        for r in rows:
            last_group = r["group"] in last
            r["stashed"] = stash and not last_group
            r["why"] = "last group before backward: kept" if last_group else why
        self.rows = rows
        self.made = True
        self.keep_all = not stash

    def table(self, fmt: str = "text") -> str:
        """:attr:`rows` as a table (bytes in MiB) in ``fmt``: ``"text"`` or ``"md"``."""
        return Table(_PLAN, fmt).render([[r["group"], str(r["name"]), r["budget_bytes"] / 2**20,
                              r["live_bytes"] / 2**20, "yes" if r["stashed"] else "no",
                              r["why"]] for r in self.rows])


_PLAN = (Column("group"), Column("name"), Column("budget MiB", ".1f"), Column("live MiB", ".1f"),
         Column("stashed"), Column("why"))
