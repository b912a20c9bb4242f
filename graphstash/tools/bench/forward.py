"""``graphstash bench all``: which suite takes which flag, and each suite's own flags.

``bench all`` takes the union of the suites' flags. ``--preset`` goes to the suite whose model
it names (the moe suite's presets or the hf suite's), ``--layers`` and ``--steps`` to both
suites that take them, every other flag to the one suite that takes it; the suites without
flags run as they are. A flag no suite can take inside ``bench all`` is refused with the name
of the suite that takes it: ``--ep`` and ``--transport`` start expert-parallel ranks of their
own (``graphstash bench moe --ep N``). A bad value is refused naming the flag and the suite it
was handed to.
"""
from __future__ import annotations

import argparse
import contextlib

from ...models import PRESETS
from .. import options

SUITES = ("kernels", "stash", "graph", "moe", "offload", "hf")
ALONE = {"--ep": "moe", "--transport": "moe"}      # flags a suite takes only when run alone


def _hf():
    from . import hf

    return hf


def add_arguments(parser) -> None:
    """The flags of ``bench all``: the moe suite's (``--preset`` naming either suite's
    models) and the hf suite's others."""
    from . import moe

    hf = _hf()
    moe.add_arguments(parser, presets=set(PRESETS) | set(hf.CONFIGS))
    hf.add_arguments(parser, skip=hf.SHARED_FLAGS)


def check(args) -> None:
    """Refuse a flag ``bench all`` cannot hand to any suite (FlagError naming the suite that
    takes it)."""
    for flag, suite in ALONE.items():
        if getattr(args, flag.lstrip("-").replace("-", "_"), None) is not None:
            raise options.FlagError(f"{flag}: only the {suite} suite takes it, run alone: "
                                    f"graphstash bench {suite} {flag} ... (bench all does not "
                                    "start expert-parallel ranks)")


def suite_args(args, suite: str):
    """The flags of ``suite`` as its own parser would give them: ``args`` itself unless
    ``args`` is ``bench all``'s."""
    if getattr(args, "suite", None) != "all":
        return args
    own = argparse.Namespace(**vars(args))
    preset = getattr(args, "preset", None)
    if suite == "moe":
        own.preset = preset if preset in PRESETS else None
    elif suite == "hf":
        own.hf_preset = preset if preset in _hf().CONFIGS else None
        own.hf_layers, own.hf_steps = args.layers, args.steps
    return own


@contextlib.contextmanager
def named(command_suite: str, suite: str):
    """Within it, a FlagError raised for ``suite`` under ``bench all`` (``command_suite``)
    also names the suite the flag was handed to."""
    try:
        yield
    except options.FlagError as exc:
        if command_suite != "all":
            raise
        raise options.FlagError(f"{exc} (bench all hands it to the {suite} suite)") from None
