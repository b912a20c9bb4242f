"""``graphstash bench``: benchmarks, each printed next to its baseline from the same run."""
from __future__ import annotations

import inspect
import json

SUITES = ("kernels", "stash", "graph", "moe", "offload", "hf")


def add_arguments(parser) -> None:
    parser.add_argument("suite", nargs="?", default="kernels", choices=SUITES + ("all",))
    parser.add_argument("--json", dest="json_path", default=None, help="write results as JSON")
    parser.add_argument("--plot", dest="plot_dir", default=None,
                        help="write one PNG figure per suite into this directory (matplotlib)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    from . import moe

    moe.add_arguments(parser)


def main(args) -> int:
    import torch

    suites = SUITES if args.suite == "all" else (args.suite,)
    if "moe" in suites:
        from . import moe

        try:                         # bad options fail before any suite runs
            moe.configs_from_args(args, args.quick)
            moe.modes_from_args(args)
        except ValueError as exc:
            print(f"graphstash bench: {exc}")
            return 2
    if not torch.cuda.is_available():
        print("graphstash bench: benchmarks time GPU kernels and need a CUDA GPU; none is visible")
        return 2
    results = {}
    for suite in suites:
        module = __import__(f"graphstash.tools.bench.{suite}", fromlist=["run"])
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
