"""The ``graphstash`` command: ``info``, ``demo``, ``bench`` and ``memory``."""
from __future__ import annotations

import argparse
import platform
import sys

import torch


def _info(args) -> int:
    import numpy

    import graphstash
    from graphstash import _backend, _kernels

    print(f"graphstash {graphstash.__version__}")
    print(f"python     {platform.python_version()} ({sys.executable})")
    print(f"torch      {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})")
    print(f"numpy      {numpy.__version__}")
    try:
        cupy = _kernels._import_cupy()
        print(f"cupy       {cupy.__version__}")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        print(f"cupy       not usable: {exc}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"gpu {i}      {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                  f"{p.multi_processor_count} SMs, compute capability {p.major}.{p.minor}")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("gpu        none visible to torch")
        device = torch.device("cpu")
    backend, why = _backend.resolve("auto", device)
    print(f"backend    {backend} for {device} tensors: {why}")
    from graphstash.moe.exchange import describe_exchange

    print(f"exchange   {describe_exchange()}")
    return 0


def _demo(args) -> int:
    from graphstash import demo

    return demo.run(device=args.device, steps=args.steps, hidden=args.hidden, seed=args.seed,
                    size=args.size, mode=args.mode)


def _bench(args) -> int:
    from graphstash import bench

    return bench.main(args)


def _memory(args) -> int:
    from graphstash import memory_command

    try:
        return memory_command.run(args)
    except ValueError as exc:           # a bad flag value: say which, as argparse would
        args.parser.error(str(exc))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphstash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, GPUs, and which backend would run")
    p.set_defaults(func=_info)
    p = sub.add_parser("demo", help="train the reference MoE model with graph_step and stashing "
                       "(on the CPU: eagerly, small)")
    from graphstash import demo as _demo_module

    p.add_argument("--mode", default="all", choices=_demo_module.MODES,
                   help="all (eager dropless, graph + budget, graph + budget + stash; default), "
                   "one of them, or paging (the bare paged stash buffer demo)")
    p.add_argument("--size", default="auto", choices=("auto", "tiny", "small", "medium", "large"),
                   help="model size (default: medium on a GPU, tiny on the CPU)")
    p.add_argument("--steps", type=int, default=20, help="training steps per mode")
    p.add_argument("--device", default="auto", help="auto (GPU if there is one), cuda or cpu")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden width (default: by size; for paging, the row width)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo)
    p = sub.add_parser("bench", help="benchmarks, each next to its baseline in the same run")
    from graphstash import bench

    bench.add_arguments(p)
    p.set_defaults(func=_bench)
    p = sub.add_parser("memory", help="where the memory of a training step is: the peak, the "
                       "blocks alive at it by owner, a timeline (on the CPU: reduced)")
    from graphstash import memory_command

    memory_command.add_arguments(p)
    p.set_defaults(func=_memory, parser=p)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
