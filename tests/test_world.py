"""The world size the multi-GPU tests run (``_world.py``): the launcher's, else the machine's
GPUs, else two ranks."""
from __future__ import annotations

import pytest
import torch

from _world import CPU_WORLD, world_size


def test_a_launchers_world_size_wins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert world_size({"WORLD_SIZE": "4"}) == 4
    assert world_size({"WORLD_SIZE": " 2 "}) == 2
    assert world_size({"WORLD_SIZE": "1"}) == 8            # one process: not a launch of ranks
    assert world_size({}) == 8
    with pytest.raises(ValueError, match="WORLD_SIZE: expected an int, got 'four'"):
        world_size({"WORLD_SIZE": "four"})


@pytest.mark.parametrize("gpus, cuda, want", [(4, True, 4), (2, True, 2), (1, True, CPU_WORLD),
                                              (0, False, CPU_WORLD)])
def test_the_machines_gpus_else_two_ranks(monkeypatch, gpus, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert world_size({}) == want
