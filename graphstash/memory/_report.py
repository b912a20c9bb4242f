"""``MemoryReport``: the peak, the blocks alive at it by owner, and the timeline."""
from __future__ import annotations

import dataclasses
import re

from ..tables import Column, Table
from ._static import GRADIENTS, INPUTS, OPTIMIZER_STATE, PARAMETERS, STASH_POOL
from ._storage import BACKWARD, FORWARD

GRAPH_POOL = "CUDA-graph pool"
SAVED_ACTIVATIONS = "saved activations"
TEMPORARIES = "temporaries"
OTHER = "other"
# Every owner a block can have, in the order tables and plots list them.
OWNERS = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, GRAPH_POOL, STASH_POOL, SAVED_ACTIVATIONS,
          TEMPORARIES, INPUTS, OTHER)
MIB = float(2 ** 20)
_OWNER_TOTALS = (Column("owner"), Column("bytes", align="right"), Column("share", align="right"))
_BLOCKS = (Column("owner"), Column("detail"), Column("bytes", align="right"), Column("blocks"))


@dataclasses.dataclass
class Block:
    """A block of memory as the report sees it: bytes, life span, owner and detail."""

    nbytes: int
    start: int                 # event index of its allocation (-1: allocated before)
    end: int | None            # event index of its free (None: alive at the end)
    owner: str
    detail: str = ""
    in_graph_pool: bool = False


def layer_group(module: str | None) -> str:
    """The layer group of a module path: up to its first list index (``blocks.3.norm`` ->
    ``blocks.3``), else its first name; ``""`` (the model itself) and ``None`` (no module)
    have their own labels."""
    if module is None:
        return "outside modules"
    if module == "":
        return "model (top level)"
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def classify(rec, end_owners: dict, backward_starts: list) -> tuple[str, str]:
    """``(owner, detail)`` of a storage the recorder saw allocated during the recording.

    NOTE [owners]: a storage alive at the end that the model, optimizer or stash manager
    holds then (a gradient or optimizer state created in the step, a new stash pool) has
    that owner for its whole life. Otherwise, by phase (NOTE [phases] in ``_storage.py``):
    a forward allocation still alive when the next backward phase starts (or at the end, if
    none follows) is a saved activation, grouped by the layer (``layer_group``) that made it;
    one freed before is a forward temporary. A backward allocation made by graphstash's stash
    is a saved activation reloaded from the pool. Everything else is a temporary, labelled by
    the op that produced it and its phase.
    """
    if rec.end is None and rec.key in end_owners:
        return end_owners[rec.key][0], ""
    if rec.phase == FORWARD:
        limit = next((e for e in backward_starts if e > rec.start), None)
        if rec.end is None or (limit is not None and rec.end > limit):
            return SAVED_ACTIVATIONS, layer_group(rec.module)
        return TEMPORARIES, f"{rec.op} (forward)"
    if rec.phase == BACKWARD and rec.by_stash:
        return SAVED_ACTIVATIONS, "reloaded from the stash pool"
    return TEMPORARIES, f"{rec.op} ({rec.phase})"


def backward_starts(marks: list) -> list:
    """Event indices where a backward phase starts (from the recorder's marks)."""
    return [event for event, label, _ in marks if label.endswith(": " + BACKWARD)]


def _mib(n: int) -> str:
    """Bytes in the largest binary unit that keeps at least one whole unit."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass
class MemoryReport:
    """Where the memory of a step is: the peak, the blocks alive at it by owner, a timeline.

    ``peak`` is the most bytes allocated on ``device`` at one moment of the recorded steps,
    counting blocks that existed before them (on the CPU: the storages of the model,
    optimizer, stash manager and inputs; on CUDA: everything the allocator held). The
    ``owner_totals`` of the blocks alive at that moment add up to ``peak`` exactly.
    ``static_bytes`` is :func:`static_footprint` (parameters + gradients + optimizer state)
    after the steps, and ``activation_peak = peak - static_bytes``.
    """

    device: str
    peak: int
    peak_event: int | None
    blocks: list = dataclasses.field(repr=False)
    events: list = dataclasses.field(repr=False)    # (index into blocks, +1 | -1)
    static_bytes: int = 0
    allocator_peak: int | None = None
    marks: list = dataclasses.field(default_factory=list, repr=False)  # (event, label)
    notes: list = dataclasses.field(default_factory=list, repr=False)
    snapshot: dict | None = dataclasses.field(default=None, repr=False)  # profile(snapshot=)

    @property
    def activation_peak(self) -> int:
        """Bytes of the peak above the static footprint."""
        return self.peak - self.static_bytes

    @property
    def live_at_peak(self) -> list:
        """The blocks alive at the peak."""
        p = self.peak_event
        return [b for b in self.blocks if _alive(b, p)]

    @property
    def owner_totals(self) -> dict:
        """``{owner: bytes}`` of the blocks alive at the peak (every owner in :data:`OWNERS`)."""
        totals = dict.fromkeys(OWNERS, 0)
        for b in self.live_at_peak:
            totals[b.owner] += b.nbytes
        return totals

    @property
    def rows(self) -> list:
        """``[(owner, detail, bytes, blocks)]`` alive at the peak, by owner then size."""
        acc: dict = {}
        for b in self.live_at_peak:
            n, count = acc.get((b.owner, b.detail), (0, 0))
            acc[(b.owner, b.detail)] = (n + b.nbytes, count + 1)
        order = {o: i for i, o in enumerate(OWNERS)}
        return sorted(((o, d, n, c) for (o, d), (n, c) in acc.items()),
                      key=lambda r: (order[r[0]], -r[2], r[1]))

    @property
    def graph_pool_bytes_at_peak(self) -> int:
        """Bytes of the blocks alive at the peak that lie in CUDA-graph pools."""
        return sum(b.nbytes for b in self.live_at_peak if b.in_graph_pool)

    def timeline(self) -> tuple[list, dict]:
        """``(event indices, {owner: bytes after each event})``, starting before event 0."""
        current = dict.fromkeys(OWNERS, 0)
        for b in self.blocks:
            if b.start < 0:
                current[b.owner] += b.nbytes
        xs = [0]
        series = {o: [current[o]] for o in OWNERS}
        for i, (index, delta) in enumerate(self.events):
            b = self.blocks[index]
            current[b.owner] += delta * b.nbytes
            xs.append(i + 1)
            for o in OWNERS:
                series[o].append(current[o])
        return xs, series

    def table(self, top: int = 12, min_bytes: int = 0, fmt: str = "text") -> str:
        """The report as text: peak, owner totals, then the largest rows per owner; ``fmt``:
        ``"text"`` or ``"md"`` (Markdown tables, :mod:`graphstash.tables`)."""
        totals = self.owner_totals
        lines = [f"peak: {_mib(self.peak)} on {self.device}"
                 + (f" (the allocator counts {_mib(self.allocator_peak)}: whole blocks)"
                    if self.allocator_peak is not None else ""),
                 f"static (parameters + gradients + optimizer state): {_mib(self.static_bytes)};"
                 f" activation peak: {_mib(self.activation_peak)}"]
        where = self._where_peak()
        if where:
            lines.append(f"the peak is reached in {where}")
        pool = self.graph_pool_bytes_at_peak
        if pool:
            lines.append(f"of the peak, {_mib(pool)} lie in CUDA-graph pools")
        lines += ["", Table(_OWNER_TOTALS, fmt).render(
            [[o, _mib(n), f"{n / max(self.peak, 1):.1%}"] for o, n in totals.items() if n])]
        lines += ["", "blocks alive at the peak, by owner and detail:"] + \
            ([""] if fmt == "md" else [])
        rows = []
        shown: dict = {}
        for owner, detail, n, count in self.rows:
            if shown.get(owner, 0) >= top or n < min_bytes:
                continue
            shown[owner] = shown.get(owner, 0) + 1
            rows.append([owner, detail or "-", _mib(n), count])
        lines.append(Table(_BLOCKS, fmt).render(rows))
        lines += ([""] if fmt == "md" else []) + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _where_peak(self) -> str:
        if self.peak_event is None:
            return ""
        label = ""
        for event, text in self.marks:
            if event <= self.peak_event:
                label = text
        return label

    def write_snapshot(self, path) -> str:
        """Write torch's memory snapshot of the recording (``profile(snapshot=True)``, CUDA) to
        ``path`` as a pickle, the file PyTorch's memory_viz page
        (https://pytorch.org/memory_viz) loads; returns the path."""
        import pickle

        if self.snapshot is None:
            raise ValueError("snapshot: this report holds none (profile(..., snapshot=True) "
                             "on a CUDA device keeps it)")
        with open(path, "wb") as f:
            pickle.dump(self.snapshot, f)
        return str(path)

    def plot(self, path) -> str:
        """Write the memory timeline (bytes by owner over the allocation events) to ``path``
        (any format matplotlib writes, by its suffix); returns the path."""
        # A bare Figure (no pyplot): the caller's backend and open figures stay as they are.
        from matplotlib.figure import Figure

        xs, series = self.timeline()
        owners = [o for o in OWNERS if any(series[o])]
        fig = Figure(figsize=(10, 5))
        ax = fig.subplots()
        ax.stackplot(xs, *[[v / MIB for v in series[o]] for o in owners], labels=owners,
                     colors=[f"C{OWNERS.index(o)}" for o in owners], step="post")
        if self.peak_event is not None:
            ax.axvline(self.peak_event + 1, color="black", lw=0.8, ls="--")
            ax.annotate(f"peak {self.peak / MIB:,.1f} MiB", (self.peak_event + 1, self.peak / MIB),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.axhline(self.static_bytes / MIB, color="grey", lw=0.8, ls=":",
                   label="static (params + grads + optimizer)")
        for event, text in self.marks:
            ax.axvline(event, color="grey", lw=0.3)
            ax.text(event, 0, re.sub(r"^step ", "", text), rotation=90, fontsize=6,
                    va="bottom", color="grey")
        ax.set_xlabel("allocation events")
        ax.set_ylabel("MiB allocated")
        ax.set_title(f"memory of the step on {self.device}")
        ax.legend(loc="upper left", fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return str(path)


def _alive(b: Block, event: int | None) -> bool:
    """Alive after event ``event`` (``None``: before any event)."""
    if event is None:
        return b.start < 0 and (b.end is None or b.end >= 0)
    return b.start <= event and (b.end is None or b.end > event)


def peak_of(blocks: list, events: list) -> tuple[int, int | None]:
    """``(peak bytes, event index reaching it)``; ``None`` if no event rises above the start."""
    current = sum(b.nbytes for b in blocks if b.start < 0)
    peak, peak_event = current, None
    for i, (index, delta) in enumerate(events):
        current += delta * blocks[index].nbytes
        if current > peak:
            peak, peak_event = current, i
    return peak, peak_event


__all__ = ["Block", "MemoryReport", "OWNERS", "classify", "layer_group", "peak_of"]
