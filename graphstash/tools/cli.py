"""The ``graphstash`` command: ``info``, ``demo``, ``bench`` and ``memory``.

Run it as ``graphstash ...`` (the installed script) or ``python -m graphstash.tools.cli ...``.
A flag with a value the command cannot use stops it before any work, with one line naming
the flag on stderr and exit status 2 (:mod:`graphstash.tools.options`).
"""
from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import options


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


def build_parser() -> argparse.ArgumentParser:
    from . import bench, demo, memory_command

    parser = argparse.ArgumentParser(prog="graphstash", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, GPUs, and which backend would run")
    p.set_defaults(func=_info)
    p = sub.add_parser("demo", help="train the reference MoE model with graph_step and stashing "
                       "(on the CPU: eagerly, small)", description=demo.__doc__.split("\n\n")[0])
    demo.add_arguments(p)
    p.set_defaults(func=_demo)
    p = sub.add_parser("bench", help="benchmarks, each next to its baseline in the same run "
                       "(needs a CUDA GPU)")
    bench.add_arguments(p)
    p.set_defaults(func=_bench)
    p = sub.add_parser("memory", help="where the memory of a training step is: the peak, the "
                       "blocks alive at it by owner, a timeline (on the CPU: reduced)",
                       description=memory_command.__doc__.split("\n\n")[0])
    memory_command.add_arguments(p)
    p.set_defaults(func=_memory)
    return parser


def main(argv=None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``); returns the exit status. A bad
    flag value exits with status 2 after one line on stderr naming the flag."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except options.FlagError as exc:
        print(f"graphstash {args.command}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    raise SystemExit(main())
