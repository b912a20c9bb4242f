"""The command-line flags shared by ``graphstash demo``, ``memory`` and ``bench``, checked one way.

Every command checks its flags with these functions before any work starts. A bad value
raises :class:`FlagError` (a ``ValueError``) whose message names the flag, the expected and
the actual value (``--hidden: expected a positive multiple of 8, got -8``); the command
prints that one line and exits with status 2, as argparse does for a value of the wrong
type. Values that are allowed but likely a mistake produce a one-line note (:func:`note`).

Example::

    hidden = options.hidden_width("--hidden", args.hidden)        # None stays None
    device = options.device("--device", args.device)              # torch.device
    plot = options.plot_file("--plot", args.plot)                 # checked path or None
"""
from __future__ import annotations

import math
import os
import sys

import torch

DEVICES = ("auto", "cpu", "cuda")
HIDDEN_MULTIPLE = 8          # bf16 rows in whole 16-byte vectors: what the kernels and the
                             # grouped GEMM's aligned strides take on a GPU


class FlagError(ValueError):
    """A command-line flag with a value the command cannot use (the message names it)."""


def positive_int(flag: str, value, *, minimum: int = 1):
    """``value`` (an int, or None for "not given") checked to be ``>= minimum``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise FlagError(f"{flag}: expected {what}, got {value!r}")
    return value


def hidden_width(flag: str, value):
    """A hidden width: a positive multiple of :data:`HIDDEN_MULTIPLE` (None: not given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 \
            or value % HIDDEN_MULTIPLE:
        raise FlagError(f"{flag}: expected a positive multiple of {HIDDEN_MULTIPLE}, "
                        f"got {value!r}")
    return value


def capacity_factor(flag: str, value, *, command: str | None):
    """A capacity factor: a finite float > 0 (None: not given). Below 1 a note says that
    rows will be over budget (every such step is flagged and rerun dropless), unless
    ``command`` is None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise FlagError(f"{flag}: expected a finite number > 0, got {value!r}")
    if value < 1 and command is not None:
        note(command, f"{flag} {value} is below 1: rows will be over budget (each flagged "
                      "step is rerun dropless)")
    return float(value)


def device(flag: str, value: str) -> torch.device:
    """``auto`` (the GPU if torch sees one), ``cpu`` or ``cuda`` as a torch.device."""
    if value not in DEVICES:
        raise FlagError(f"{flag}: expected one of {', '.join(DEVICES)}, got {value!r}")
    if value == "cuda" and not torch.cuda.is_available():
        raise FlagError(f"{flag}: expected a device torch can use, got cuda but torch sees "
                        "no CUDA GPU")
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _plot_formats() -> dict:
    try:
        import matplotlib
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return {}
    del matplotlib
    return FigureCanvasBase.get_supported_filetypes()


def plot_file(flag: str, path):
    """A file matplotlib can write a figure to: its directory exists and its extension is a
    format matplotlib knows (None: not given)."""
    if path is None:
        return None
    formats = _plot_formats()
    if not formats:
        raise FlagError(f"{flag}: writing a figure needs matplotlib (pip install matplotlib), "
                        "which cannot be imported")
    output_file(flag, path)
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        raise FlagError(f"{flag}: expected a file ending in one of "
                        f"{', '.join('.' + e for e in sorted(formats))}, got {path!r}")
    return path


def plot_directory(flag: str, path):
    """A directory for figures (made if missing): not an existing file, matplotlib present."""
    if path is None:
        return None
    if not _plot_formats():
        raise FlagError(f"{flag}: writing figures needs matplotlib (pip install matplotlib), "
                        "which cannot be imported")
    if os.path.exists(path) and not os.path.isdir(path):
        raise FlagError(f"{flag}: expected a directory, got the file {path!r}")
    return path


def output_file(flag: str, path):
    """A file to write (JSON, say) whose directory exists (None: not given)."""
    if path is None:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FlagError(f"{flag}: expected a file in an existing directory, got {path!r} "
                        f"({directory} does not exist)")
    if os.path.isdir(path):
        raise FlagError(f"{flag}: expected a file name, got the directory {path!r}")
    return path


def note(command: str, text: str) -> None:
    """Print a one-line note about a flag on stderr (``graphstash memory: note: ...``)."""
    print(f"graphstash {command}: note: {text}", file=sys.stderr)


def names(flag: str, text, allowed: tuple, *, context: str = "") -> tuple:
    """The comma-separated names ``text`` gives for ``flag`` (``allowed`` where it is empty or
    None); :class:`FlagError` listing ``allowed`` (and ``context``, e.g. " with --ep") for a
    name not among them."""
    if not text:
        return allowed
    chosen = tuple(m.strip() for m in text.split(","))
    bad = [m for m in chosen if m not in allowed]
    if bad:
        raise FlagError(f"{flag}: expected names from {', '.join(allowed)}{context}, "
                        f"got {', '.join(map(repr, bad))}")
    return chosen
