"""``graphstash.tables``: the one table printer of the library and the command, plain text and
Markdown, whole or row by row; and no other module lays out a table by hand."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphstash.tables import Column, Table, format_table

ROOT = Path(__file__).resolve().parent.parent


def test_a_whole_table_aligns_text_left_and_numbers_right():
    text = format_table([Column("mode"), Column("step ms", ".2f"), Column("note")],
                        [["eager", 12.345, "first"], ["graph + budget", None, ""]],
                        title="a title")
    assert text.splitlines() == ["a title",
                                 "mode            step ms  note",
                                 "--------------  -------  -----",
                                 "eager             12.35  first",
                                 "graph + budget        -"]


def test_rows_printed_one_at_a_time_keep_their_columns():
    table = Table([Column("row", width=10), Column("ms", ".1f", width=6),
                   Column("flags")])
    lines = table.header() + [table.row(["a", 1.25, "0, 0"]), table.row(["bb", 100.0, "1, 0"]),
                              table.span("cc", "failed: why")]
    assert lines == ["row             ms  flags",
                     "----------  ------  -----",
                     "a              1.2  0, 0",
                     "bb           100.0  1, 0",
                     "cc          failed: why"]


def test_markdown_is_a_pipe_table_with_numbers_right_aligned():
    table = Table([Column("mode"), Column("step ms", ".2f"), Column("x|y")], "md")
    assert table.render([["eager", 1.0, "a|b"]]).splitlines() == [
        "| mode | step ms | x|y |", "|---|---:|---|", "| eager | 1.00 | a\\|b |"]
    assert table.header() == ["| mode | step ms | x|y |", "|---|---:|---|"]
    assert table.span("graph", "failed") == "| graph | failed |  |"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="fmt: expected one of text, md, got 'html'"):
        Table(["a"], "html")
    with pytest.raises(ValueError, match="align: expected one of auto, left, right"):
        Column("a", align="centre")
    with pytest.raises(ValueError, match="values: expected at most 1"):
        Table(["a"]).row([1, 2])


# Hand-made layout: a dashed underline, padding to a width, a width in a format spec.
HAND_MADE = re.compile(r"\{[^}]*:[<>^]\d+|\.rjust\(|\.ljust\(|[\"']-[\"'] \* ")


def test_no_module_lays_out_a_table_by_hand():
    """Every table of the library and the command goes through graphstash.tables (the memory
    report, the stash plan, the offload summary, the demo, the memory command and every bench
    suite print with it)."""
    found = []
    for path in sorted((ROOT / "graphstash").rglob("*.py")):
        if path.name == "tables.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HAND_MADE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)
