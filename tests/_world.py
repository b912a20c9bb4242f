"""How many ranks a multi-process test runs.

The multi-GPU tests run one rank per GPU of the machine, so the same test runs 2 ranks on two
GPUs and 4 on four: :data:`WORLD_SIZE` is the launcher's ``WORLD_SIZE`` where one set it (2
or more), else the number of CUDA GPUs where there are at least two, else
:data:`CPU_WORLD`. The CPU (gloo) variants run :data:`CPU_WORLD` ranks whatever the machine
has, and name any other count themselves (``run_ranks(fn, 4)``). Every shape a multi-rank
test uses must divide over 2, 4 and 8 ranks (experts, tokens, sharded widths).

Example::

    from _world import WORLD_SIZE, require_gpus

    def test_on_every_gpu():
        require_gpus(WORLD_SIZE)
        mp.spawn(_rank_main, args=(WORLD_SIZE,), nprocs=WORLD_SIZE)
"""
from __future__ import annotations

import os

import torch

CPU_WORLD = 2


def world_size(environ=None) -> int:
    """The launcher's ``WORLD_SIZE`` (an int >= 2; ValueError naming it otherwise, 0 or 1:
    ignored), else the CUDA GPUs where there are two or more, else :data:`CPU_WORLD`."""
    environ = os.environ if environ is None else environ
    text = environ.get("WORLD_SIZE", "").strip()
    if text:
        try:
            world = int(text)
        except ValueError:
            raise ValueError(f"WORLD_SIZE: expected an int, got {text!r}") from None
        if world >= 2:
            return world
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus if gpus >= 2 else CPU_WORLD


WORLD_SIZE = world_size()


def require_gpus(world: int) -> None:
    """Skip, with the reason, where fewer than ``world`` CUDA GPUs are visible (a launcher's
    ``WORLD_SIZE`` larger than the machine)."""
    import pytest

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < world:
        pytest.skip(f"needs {world} CUDA GPUs (one per rank), torch sees {gpus}")
