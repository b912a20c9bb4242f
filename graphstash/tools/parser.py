"""The ``graphstash`` command's argument parser: one error format for every mistake.

argparse reports a value of the wrong type or an unknown option with a usage block and its own
wording, and names the sub-command's full path (``graphstash bench all: error: ...``). Every
``graphstash`` parser is a :class:`CommandParser`, which prints what
:class:`graphstash.tools.options.FlagError` prints instead: one line on stderr,
``graphstash <command>: error: <flag>: <what was expected>, got <what was given>``, and exit
status 2 (:func:`fail`).

Example::

    parser = CommandParser(prog="graphstash")
    ...
    args = parse(parser, ["bench", "moe", "--steps", "abc"])
    # stderr: graphstash bench: error: --steps: expected an int, got 'abc'   (exit status 2)
"""
from __future__ import annotations

import argparse
import re
import sys

PROGRAM = "graphstash"
_TYPES = {"int": "an int", "float": "a number"}


def fail(command: str | None, message: str) -> None:
    """Print ``graphstash <command>: error: <message>`` (``graphstash: error: ...`` without a
    command) on stderr and exit with status 2."""
    prefix = PROGRAM if not command else f"{PROGRAM} {command}"
    print(f"{prefix}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _choices(text: str) -> str:
    return ", ".join(c.strip().strip("'\"") for c in text.split(","))


def flag_message(message: str) -> str:
    """argparse's ``message`` in the command's words: ``<flag>: expected ..., got ...``."""
    m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)$", message, re.DOTALL)
    if not m:
        m2 = re.match(r"the following arguments are required: (.*)$", message)
        if m2:
            what = m2.group(1)
            return f"{what.lower() if what.isupper() else what}: expected a value, got none"
        return message
    flag, what = m.group(1), m.group(2)
    if flag in ("command", "suite", "SUITE", "COMMAND"):
        flag = flag.lower()
    m = re.match(r"invalid (\w+) value: (.*)$", what)
    if m:
        kind = _TYPES.get(m.group(1), f"a {m.group(1)}")
        return f"{flag}: expected {kind}, got {m.group(2)}"
    m = re.match(r"invalid choice: (.*?) \(choose from (.*)\)$", what)
    if m:
        return f"{flag}: expected one of {_choices(m.group(2))}, got {m.group(1)}"
    if what == "expected one argument":
        return f"{flag}: expected a value, got none"
    return f"{flag}: {what}"


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line naming the flag (:func:`fail`); its
    sub-command parsers are of the same class."""

    def command(self) -> str | None:
        """The ``graphstash`` command this parser belongs to (``bench`` for ``graphstash bench
        all``), None for the top-level parser."""
        parts = self.prog.split()
        return parts[1] if len(parts) > 1 else None

    def error(self, message: str):
        fail(self.command(), flag_message(message))


def parse(parser: CommandParser, argv) -> argparse.Namespace:
    """``parser.parse_args(argv)``, an unknown option reported as one line naming it and the
    command it was given to."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(args, "command", None)
        where = " ".join(p for p in (PROGRAM, command, getattr(args, "suite", None)) if p)
        fail(command, f"{extra[0]}: not an option of {where} ({where} --help lists them)")
    return args
