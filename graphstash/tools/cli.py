"""The ``graphstash`` command: ``info``, ``demo``, ``bench`` and ``memory``.

Run it as ``graphstash ...`` (the installed script), ``python -m graphstash ...`` or
``python -m graphstash.tools.cli ...``; ``graphstash --version`` prints the version. A flag with
a value the command cannot use, of the wrong type or unknown stops it before any work, with
one line naming the flag on stderr and exit status 2 (:mod:`graphstash.tools.options`,
:mod:`graphstash.tools.parser`); notes and errors go to stderr, results to stdout.
"""
from __future__ import annotations

import platform
import sys

import torch

from . import options
from .parser import CommandParser, fail, parse

SUMMARY = "a CUDA-graph-first GPU memory runtime for PyTorch training"
COMMANDS = {
    "info": ("versions, GPUs, and which backend would run", None),
    "demo": ("train the reference MoE model with graph_step and stashing (on the CPU: "
             "eagerly, small)",
             "Trains the reference MoE model for a few steps in each mode (eager dropless, "
             "graph + budget, graph + budget + stash) from the same initialisation and prints "
             "what each cost; --mode paging exercises a bare paged stash buffer. Without a GPU "
             "it runs eagerly on the CPU, small."),
    "bench": ("benchmarks, each next to its baseline in the same run (a CUDA GPU; moe and hf "
              "also on the CPU with --device cpu)", None),
    "memory": ("where the memory of a training step is: the peak, the blocks alive at it by "
               "owner, a timeline (on the CPU: reduced)",
               "Builds the reference MoE model, runs warmup steps, records one step and prints "
               "its peak, the static footprint, the activation peak, the owner totals and the "
               "blocks alive at the peak; --plot writes the timeline, --snapshot torch's memory "
               "snapshot (CUDA). On the CPU the sizes are reduced."),
}


def _info(args) -> int:
    import numpy

    import graphstash
    from graphstash import runtime

    print(f"graphstash {graphstash.__version__}")
    print(f"python     {platform.python_version()} ({sys.executable})")
    print(f"torch      {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})")
    print(f"numpy      {numpy.__version__}")
    ok, why = runtime.kernels_available()
    cupy = sys.modules.get("cupy")
    if ok and cupy is not None:
        print(f"cupy       {cupy.__version__}")
    else:
        print(f"cupy       not usable: {why}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"gpu {i}      {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                  f"{p.multi_processor_count} SMs, compute capability {p.major}.{p.minor}")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("gpu        none visible to torch")
        device = torch.device("cpu")
    backend, why = runtime.backend_for(device)
    print(f"backend    {backend} for {device} tensors: {why}")
    from graphstash.moe.exchange import describe_exchange

    print(f"exchange   {describe_exchange()}")
    return 0


def _demo(args) -> int:
    from . import demo

    return demo.main(args)


def _bench(args) -> int:
    from . import bench

    return bench.main(args)


def _memory(args) -> int:
    from . import memory_command

    return memory_command.run(args)


def version() -> str:
    import graphstash

    return graphstash.__version__


def build_parser() -> CommandParser:
    """The command's parser: one sub-command per entry of :data:`COMMANDS`, each with a short
    plain description (the modules' docstrings are for the documentation)."""
    from . import bench, demo, memory_command

    parser = CommandParser(prog="graphstash", description=f"graphstash: {SUMMARY}.")
    parser.add_argument("--version", action="version", version=f"graphstash {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help=", ".join(COMMANDS))
    funcs = {"info": _info, "demo": _demo, "bench": _bench, "memory": _memory}
    adders = {"demo": demo.add_arguments, "bench": bench.add_arguments,
              "memory": memory_command.add_arguments}
    for name, (summary, description) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=description or summary[:1].upper()
                           + summary[1:] + ".")
        if name in adders:
            adders[name](p)
        p.set_defaults(func=funcs[name])
    return parser


def main(argv=None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``); returns the exit status. A bad
    flag value exits with status 2 after one line on stderr naming the flag."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(build_parser(), argv)
    args.argv = argv                  # the command line, for the results' provenance
    try:
        return args.func(args)
    except options.FlagError as exc:
        fail(args.command, str(exc))


if __name__ == "__main__":
    raise SystemExit(main())
