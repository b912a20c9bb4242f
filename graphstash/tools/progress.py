"""Progress of the ``graphstash`` command's long work: bars on stderr, results on stdout.

A :func:`bar` is a tqdm bar on stderr with its rate and ETA; it draws itself only when stderr is
a terminal (tqdm's ``disable=None``), and is a silent stand-in where tqdm is not installed (it
comes with the ``tools`` extra). :func:`write` prints a line of results on stdout at once
(flushed, so a pipe or a file sees each row as soon as it is measured) without tearing the
bars drawn on the terminal.

Example::

    with progress.bar(len(modes), "bench moe", unit="mode") as outer:
        for mode in modes:
            with progress.bar(calls, f"  {mode}", unit="step") as inner:
                figures = run_mode(..., on_call=inner.update)
            progress.write(table.row(...))
            outer.update()
"""
from __future__ import annotations

import sys


class Bar:
    """A progress bar (tqdm on stderr, or nothing): ``update(n)``, ``close()``, a context
    manager; ``total`` steps, ``desc`` before it, ``unit`` after its counts; ``show=False``:
    nothing (a rank that does not print, say)."""

    def __init__(self, total: int | None, desc: str, unit: str = "step", leave: bool = False,
                 show: bool = True):
        tqdm = None
        if show:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
        self._bar = None if tqdm is None else tqdm(
            total=total, desc=desc, unit=unit, leave=leave, disable=None, file=sys.stderr,
            dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.update(n)
        # the finished state is always drawn: tqdm skips the redraws that come within its
        # minimum interval of the last one, which on a loaded machine can be every one left
        if bar.total is not None and bar.n >= bar.total:
            bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: int | None, desc: str, unit: str = "step", leave: bool = False,
        show: bool = True) -> Bar:
    """A :class:`Bar` of ``total`` ``unit`` s (None: unknown) labelled ``desc``; ``leave``: keep
    it on the terminal when it closes; ``show=False``: a bar that draws nothing."""
    return Bar(total, desc, unit, leave, show)


def write(line: str = "") -> None:
    """Print ``line`` on stdout now (flushed), around any bar on the terminal."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(line, flush=True)
        return
    with tqdm.external_write_mode(file=sys.stdout):
        print(line, flush=True)
