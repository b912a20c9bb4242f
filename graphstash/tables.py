"""Tables as plain text or Markdown: the one table printer of graphstash and its command.

A :class:`Table` has :class:`Column` s; it renders whole (:meth:`Table.render`: every column as
wide as its widest cell) or row by row (:meth:`Table.header`, then :meth:`Table.row` for each
row as soon as it is known: every column as wide as its ``width``, so the rows stay aligned).
Plain text separates columns by two spaces and underlines the header with dashes; numbers
are right-aligned, text left-aligned. Markdown (``fmt="md"``) is a pipe table, numbers
right-aligned too, ready to paste into a document.

Example::

    table = Table([Column("mode", width=20), Column("step ms", ".2f", width=8)])
    print(table.render([["eager", 12.345], ["graph", None]]))
    # mode   step ms
    # -----  -------
    # eager    12.35
    # graph        -
"""
from __future__ import annotations

import dataclasses
import numbers

FORMATS = ("text", "md")
ALIGNMENTS = ("auto", "left", "right")


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: its ``name`` (the header), the format ``spec`` of its numbers (``".2f"``;
    empty: ``str``), the least ``width`` of its text cells (streamed rows keep it), its
    ``align`` ment (``"auto"``: right for numbers, left for text; a streamed column is right
    when it has a ``spec``) and the text of a ``missing`` (None) value."""

    name: str
    spec: str = ""
    width: int = 0
    align: str = "auto"
    missing: str = "-"

    def __post_init__(self):
        if self.align not in ALIGNMENTS:
            raise ValueError(f"align: expected one of {', '.join(ALIGNMENTS)}, got "
                             f"{self.align!r}")

    def text(self, value) -> str:
        """``value`` as this column's cell: None is :attr:`missing`, a number takes
        :attr:`spec`, anything else ``str``."""
        if value is None:
            return self.missing
        if self.spec and isinstance(value, numbers.Number) and not isinstance(value, bool):
            return format(value, self.spec)
        return str(value)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


class Table:
    """A table of ``columns`` (:class:`Column` s, or names for columns with defaults) in
    ``fmt`` (one of :data:`FORMATS`)."""

    def __init__(self, columns, fmt: str = "text"):
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {', '.join(FORMATS)}, got {fmt!r}")
        self.columns = [c if isinstance(c, Column) else Column(str(c)) for c in columns]
        if not self.columns:
            raise ValueError("columns: expected at least one column, got none")
        self.fmt = fmt

    # -- row by row --------------------------------------------------------------------------
    def _streamed(self) -> tuple[list, list]:
        widths = [max(c.width, len(c.name)) for c in self.columns]
        right = [c.align == "right" or (c.align == "auto" and bool(c.spec))
                 for c in self.columns]
        return widths, right

    def header(self) -> list[str]:
        """The header's lines (text: names and dashes; Markdown: names and the alignment row)
        for rows printed one at a time with :meth:`row`."""
        widths, right = self._streamed()
        return self._header_lines(widths, right)

    def row(self, values) -> str:
        """One row's line (``values``: one per column; fewer leave the last cells empty)."""
        widths, right = self._streamed()
        return self._line(self._cells(values), widths, right)

    def span(self, first, text: str) -> str:
        """A line whose first cell is ``first`` and whose other cells hold ``text`` (a row that
        failed, say, with its reason)."""
        widths, right = self._streamed()
        if self.fmt == "md":
            return self._line([str(first), text] + [""] * (len(self.columns) - 2), widths,
                              right)
        return f"{str(first).ljust(widths[0])}  {text}".rstrip()

    # -- whole -------------------------------------------------------------------------------
    def render(self, rows, *, title: str | None = None) -> str:
        """Every row (lists of values, one per column) at once, under ``title`` if given;
        every column as wide as its widest cell."""
        cells = [self._cells(r) for r in rows]
        widths = [max([len(c.name)] + [len(r[i]) for r in cells])
                  for i, c in enumerate(self.columns)]
        right = []
        for i, c in enumerate(self.columns):
            values = [r[i] if i < len(r) else None for r in rows]
            present = [v for v in values if v is not None]
            right.append(c.align == "right" or (c.align == "auto" and bool(present)
                                                and all(map(_is_number, present))))
        lines = [title] if title else []
        lines += self._header_lines(widths, right)
        lines += [self._line(r, widths, right) for r in cells]
        return "\n".join(lines)

    # -- the two formats ---------------------------------------------------------------------
    def _cells(self, values) -> list[str]:
        values = list(values)
        if len(values) > len(self.columns):
            raise ValueError(f"values: expected at most {len(self.columns)} (one per column), "
                             f"got {len(values)}")
        return [c.text(v) for c, v in zip(self.columns, values)] + \
            [""] * (len(self.columns) - len(values))

    def _header_lines(self, widths, right) -> list[str]:
        names = [c.name for c in self.columns]
        if self.fmt == "md":
            rule = ["---:" if r else "---" for r in right]
            return ["| " + " | ".join(names) + " |", "|" + "|".join(rule) + "|"]
        return [self._line(names, widths, right), "  ".join("-" * w for w in widths)]

    def _line(self, cells, widths, right) -> str:
        if self.fmt == "md":
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
        return "  ".join(c.rjust(w) if r else c.ljust(w)
                         for c, w, r in zip(cells, widths, right)).rstrip()


def format_table(columns, rows, fmt: str = "text", *, title: str | None = None) -> str:
    """``Table(columns, fmt).render(rows, title=title)``: a whole table in one call."""
    return Table(columns, fmt).render(rows, title=title)


__all__ = ["ALIGNMENTS", "Column", "FORMATS", "Table", "format_table"]
