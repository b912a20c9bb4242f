"""``graphstash.tables``: the one table printer of the library and the command, plain text and
Markdown, whole or row by row."""
from __future__ import annotations

import pytest

from graphstash.tables import Column, Table, format_table

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
