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


def test_spread_workers_take_the_gpus_in_turn():
    from _spread import spread_gpu

    assert [spread_gpu(f"gw{k}", 4) for k in range(6)] == ["0", "1", "2", "3", "0", "1"]
    assert [spread_gpu(f"gw{k}", 2, "5, 7") for k in range(3)] == ["5", "7", "5"]
    assert spread_gpu("gw3", 2, "5,7,9") == "7"             # the first two of those listed
    assert spread_gpu("", 4) is None and spread_gpu("master", 4) is None


@pytest.mark.parametrize("gpus, visible, message", [
    (0, None, "GS_SPREAD_GPUS: expected a number of GPUs >= 1, got 0"),
    (3, "0,1", r"GS_SPREAD_GPUS: 3 GPUs, but CUDA_VISIBLE_DEVICES lists 2 \(0,1\)"),
])
def test_spread_refuses_what_the_machine_cannot_give(gpus, visible, message):
    from _spread import spread_gpu

    with pytest.raises(ValueError, match=message):
        spread_gpu("gw0", gpus, visible)
