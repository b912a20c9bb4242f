"""What the ``graphstash`` command prints: titles, tables whose rows appear as they are
measured, notes under them, and the source line, as plain text or as Markdown (``--format``).

Tables are :class:`graphstash.tables.Table` s; every line goes through
:func:`graphstash.tools.progress.write` (stdout, flushed, around the progress bars). In
Markdown each table stands between blank lines and is followed by its source line (the run's
``meta``, :func:`graphstash.tools.provenance.line`), so a table pasted into ``docs/`` says
where it came from; in plain text the source line comes once, first.

Example::

    out = Output("md", meta)
    out.title("MoE quick: 4 layers, ...")
    rows = out.table([Column("mode", width=25), Column("step ms", ".2f", width=9)])
    rows.row(["plain eager", 12.3])        # printed now
    out.note("/best: time over the best peer")
"""
from __future__ import annotations

from ..tables import FORMATS, Table
from . import progress, provenance


class StreamedTable:
    """A table printed row by row (its header when made): :meth:`row`, :meth:`span`."""

    def __init__(self, output: "Output", table: Table):
        self._output = output
        self.table = table
        for line in table.header():
            progress.write(line)

    def row(self, values) -> None:
        """Print one row now (``values``: one per column)."""
        progress.write(self.table.row(values))

    def span(self, first, text: str) -> None:
        """Print a row of ``first`` and ``text`` across the other columns (a failed run)."""
        progress.write(self.table.span(first, text))


class Output:
    """The printed results of one command run in ``fmt`` (one of
    :data:`graphstash.tables.FORMATS`), with the run's ``meta`` (None: no source line);
    ``source_first=False``: no source line first in plain text (another ``Output`` of the
    same run, in a process of its own, printed it)."""

    def __init__(self, fmt: str = "text", meta: dict | None = None, *,
                 source_first: bool = True):
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.meta = meta
        self._open: StreamedTable | None = None     # the table notes and sources follow
        if meta is not None and fmt == "text" and source_first:
            progress.write(f"source: {provenance.line(meta)}")

    @property
    def markdown(self) -> bool:
        return self.fmt == "md"

    def _close_table(self) -> None:
        if self._open is not None and self.markdown:
            progress.write()
            if self.meta is not None:
                progress.write(f"source: {provenance.line(self.meta)}")
                progress.write()
        self._open = None

    def title(self, text: str) -> None:
        """A heading line before a table (a blank line before it)."""
        self._close_table()
        progress.write()
        progress.write(text)
        if self.markdown:
            progress.write()

    def table(self, columns) -> StreamedTable:
        """A table of ``columns`` (:class:`graphstash.tables.Column` s) whose header is printed
        now and whose rows are printed by the returned object as they come."""
        self._close_table()
        self._open = StreamedTable(self, Table(columns, self.fmt))
        return self._open

    def whole(self, columns, rows) -> None:
        """A table printed at once (its rows all known)."""
        self._close_table()
        self._open = StreamedTable(self, Table(columns, self.fmt))
        for r in rows:
            self._open.row(r)

    def note(self, text: str) -> None:
        """A line under the table (in Markdown a paragraph after the table and its source)."""
        self._close_table()
        progress.write(text)

    def line(self, text: str = "") -> None:
        """A line of its own."""
        self.note(text)

    def end(self) -> None:
        """Close the last table (its source line, in Markdown)."""
        self._close_table()
