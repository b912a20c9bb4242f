"""``graphstash bench``: benchmarks, each printed next to its baseline from the same run.

Every suite times GPU kernels and needs a CUDA GPU (and CuPy for graphstash's kernels).
``graphstash bench SUITE --help`` describes a suite and its options; the options are checked
before the GPU is looked for or anything runs.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json

from .. import options

SUITES = ("kernels", "stash", "graph", "moe", "offload", "hf")
DEFAULT_SUITE = "kernels"
NEEDS_GPU = "Needs a CUDA GPU (torch must see one) and CuPy for graphstash's kernels."


def suite_module(name: str):
    """The module of suite ``name`` (``graphstash.tools.bench.<name>``); importing it touches
    no GPU."""
    return importlib.import_module(f"{__name__}.{name}")


def _common(parser, default) -> None:
    """--json, --plot and --quick; on a suite's parser ``default=SUPPRESS``, so a value given
    before the suite name is not reset by the suite's parser."""
    parser.add_argument("--json", dest="json_path", default=default, metavar="FILE",
                        help="write the results as JSON to FILE")
    parser.add_argument("--plot", dest="plot_dir", default=default, metavar="DIR",
                        help="write one PNG figure per suite into DIR (made if missing; "
                        "matplotlib)")
    parser.add_argument("--quick", action="store_true", default=default,
                        help="fewer sizes (a smoke run)")


def add_arguments(parser) -> None:
    """``graphstash bench [SUITE] [options]``: one sub-command per suite, ``all`` for every
    suite (default: ``kernels``)."""
    parser.description = (__doc__.split("\n\n")[0].strip() + " " + NEEDS_GPU)
    _common(parser, None)
    sub = parser.add_subparsers(dest="suite", metavar="SUITE",
                                help=f"one of {', '.join(SUITES)} or all "
                                f"(default {DEFAULT_SUITE})")
    for name in SUITES + ("all",):
        if name == "all":
            summary = "every suite, one after the other"
            description = f"Run every suite ({', '.join(SUITES)}). {NEEDS_GPU}"
        else:
            doc = inspect.getdoc(suite_module(name)) or name
            summary = doc.split("\n\n")[0].replace("\n", " ")
            summary = summary.replace(f"``graphstash bench {name}``: ", "")
            description = doc + "\n\n" + NEEDS_GPU
        p = sub.add_parser(name, help=summary, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _common(p, argparse.SUPPRESS)
        if name in ("moe", "all"):
            suite_module("moe").add_arguments(p)
        if name == "hf":
            suite_module("hf").add_arguments(p)


def check_flags(args) -> tuple:
    """Every option checked (:class:`~graphstash.tools.options.FlagError` naming it) before
    anything runs; returns the suites to run."""
    suite = getattr(args, "suite", None) or DEFAULT_SUITE
    suites = SUITES if suite == "all" else (suite,)
    options.output_file("--json", args.json_path)
    options.plot_directory("--plot", args.plot_dir)
    if "moe" in suites:
        moe = suite_module("moe")
        moe.configs_from_args(args, args.quick)
        moe.modes_from_args(args)
    if "hf" in suites:
        hf = suite_module("hf")
        hf.configs_from_args(args, args.quick)
        hf.runs_from_args(args)
    return suites


def main(args) -> int:
    """Run the suites ``args`` selects; returns the exit status (2 without a CUDA GPU)."""
    import torch

    suites = check_flags(args)
    if not torch.cuda.is_available():
        print("graphstash bench: benchmarks time GPU kernels and need a CUDA GPU; torch sees "
              "none")
        return 2
    results = {}
    for suite in suites:
        module = suite_module(suite)
        if "args" in inspect.signature(module.run).parameters:
            results[suite] = module.run(quick=args.quick, args=args)
        else:
            results[suite] = module.run(quick=args.quick)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot_dir:
        from .plots import write

        for path in write(results, args.plot_dir):
            print(f"wrote {path}")
    return 0
