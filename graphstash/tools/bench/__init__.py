"""``graphstash bench``: benchmarks, each printed next to its baseline from the same run.

Every suite times GPU kernels and needs a CUDA GPU (and CuPy for graphstash's kernels); the
``moe`` and ``hf`` suites also run their loop on the CPU with ``--device cpu`` (eager, the host
clock, no memory figures: a smoke run, not a measurement). ``graphstash bench SUITE --help``
describes a suite and its options; the options are checked before the GPU is looked for or
anything runs. Each suite prints its rows as they are measured, with progress bars on stderr
(a terminal only); ``--format md`` prints Markdown tables with their source line, and
``--json`` writes the figures with a ``meta`` block (:mod:`graphstash.tools.provenance`).
``bench all`` runs every suite and hands each the flags it takes (:mod:`.forward`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os

from ...tables import FORMATS
from .. import options
from . import forward

SUITES = forward.SUITES
DEFAULT_SUITE = "kernels"
CPU_SUITES = ("moe", "hf")      # suites whose loop also runs on the CPU (--device cpu)
NEEDS_GPU = ("Needs a CUDA GPU (torch must see one) and CuPy for graphstash's kernels"
             "; moe and hf also run on the CPU with --device cpu.")


def suite_module(name: str):
    """The module of suite ``name`` (``graphstash.tools.bench.<name>``); importing it touches
    no GPU."""
    return importlib.import_module(f"{__name__}.{name}")


def _common(parser, default) -> None:
    """--json, --plot, --quick, --format and --device; on a suite's parser
    ``default=SUPPRESS``, so a value given before the suite name is not reset by the suite's
    parser."""
    parser.add_argument("--json", dest="json_path", default=default, metavar="FILE",
                        help="write the results as JSON to FILE, with a meta block (versions, "
                        "GPUs, command line, commit, time)")
    parser.add_argument("--plot", dest="plot_dir", default=default, metavar="DIR",
                        help="write one PNG figure per suite into DIR (made if missing; "
                        "matplotlib)")
    parser.add_argument("--quick", action="store_true", default=default,
                        help="fewer sizes (a smoke run)")
    parser.add_argument("--format", dest="format", choices=FORMATS,
                        default=default if default is argparse.SUPPRESS else "text",
                        help="text (default) or md: Markdown tables, each with the run's "
                        "source line under it")
    parser.add_argument("--device", choices=options.DEVICES,
                        default=default if default is argparse.SUPPRESS else "auto",
                        help="auto (default: the GPU), cuda, or cpu (the moe and hf suites' "
                        "loop, eagerly: a smoke run, not a measurement)")


def add_arguments(parser) -> None:
    """``graphstash bench [SUITE] [options]``: one sub-command per suite, ``all`` for every
    suite (default: ``kernels``)."""
    parser.description = ("Benchmarks, each printed next to its baseline from the same run. "
                          + NEEDS_GPU)
    _common(parser, None)
    sub = parser.add_subparsers(dest="suite", metavar="SUITE",
                                help=f"one of {', '.join(SUITES)} or all "
                                f"(default {DEFAULT_SUITE})")
    for name in SUITES + ("all",):
        if name == "all":
            summary = "every suite, one after the other"
            description = (f"Run every suite ({', '.join(SUITES)}), each with the flags it "
                           f"takes. {NEEDS_GPU}")
        else:
            module = suite_module(name)
            summary, description = module.SUMMARY, module.DESCRIPTION + " " + NEEDS_GPU
        p = sub.add_parser(name, help=summary, description=description)
        _common(p, argparse.SUPPRESS)
        if name == "moe":
            suite_module("moe").add_arguments(p)
        elif name == "hf":
            suite_module("hf").add_arguments(p)
        elif name == "all":
            forward.add_arguments(p)


def check_flags(args) -> tuple:
    """Every option checked (:class:`~graphstash.tools.options.FlagError` naming it) before
    anything runs; returns the suites to run."""
    suite = getattr(args, "suite", None) or DEFAULT_SUITE
    suites = SUITES if suite == "all" else (suite,)
    options.output_file("--json", args.json_path)
    options.plot_directory("--plot", args.plot_dir)
    if args.device == "cpu":
        gpu_only = [s for s in suites if s not in CPU_SUITES]
        if gpu_only:
            raise options.FlagError(
                f"--device: cpu runs the {' and '.join(CPU_SUITES)} suites only; "
                f"{', '.join(gpu_only)} time{'s' if len(gpu_only) == 1 else ''} GPU kernels "
                f"(got cpu with {suite})")
        if getattr(args, "profile", False):
            raise options.FlagError("--profile: the kernel-time shares are read from CUDA "
                                    "kernels, and --device cpu runs none")
    if suite == "all":
        forward.check(args)
    for s in suites:
        with forward.named(suite, s):
            own = forward.suite_args(args, s)
            if s == "moe":
                moe = suite_module("moe")
                moe.configs_from_args(own, args.quick)
                moe.modes_from_args(own)
            elif s == "hf":
                hf = suite_module("hf")
                hf.configs_from_args(own, args.quick)
                hf.runs_from_args(own)
    if args.device == "cuda":
        options.device("--device", args.device)      # refused where torch sees no GPU
    return suites


def main(args) -> int:
    """Run the suites ``args`` selects; returns the exit status (2 without a CUDA GPU, unless
    ``--device cpu``). Diagnostics go to stderr, results to stdout."""
    from .. import provenance
    from ..output import Output
    from ..parser import fail

    suites = check_flags(args)
    device = options.device("--device", args.device)
    if device.type != "cuda" and args.device == "auto":
        fail("bench", "benchmarks time GPU kernels and need a CUDA GPU; torch sees none "
             f"(--device cpu runs the {' and '.join(CPU_SUITES)} suites' loop on the CPU)")
    meta = provenance.collect(getattr(args, "argv", None))
    # under torchrun every process runs this; rank 0 prints (the suites print on it alone)
    out = Output(args.format, meta, source_first=os.environ.get("RANK", "0") == "0")
    results = {"meta": meta}
    for suite in suites:
        module = suite_module(suite)
        kwargs = {"quick": args.quick, "args": forward.suite_args(args, suite), "out": out}
        if suite in CPU_SUITES:
            kwargs["device"] = device
        results[suite] = module.run(**kwargs)
    out.end()
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot_dir:
        from .plots import write

        for path in write(results, args.plot_dir):
            out.line(f"wrote {path}")
    return 0
