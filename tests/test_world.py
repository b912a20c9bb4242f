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


def test_shards_split_the_suite_into_disjoint_parts_that_cover_it():
    from _spread import in_shard

    ids = [f"tests/test_x.py::test_{i}[case{j}]" for i in range(40) for j in range(5)]
    parts = [[t for t in ids if in_shard(t, k, 3)] for k in (1, 2, 3)]
    assert sorted(sum(parts, [])) == sorted(ids)               # each test in exactly one part
    assert all(len(p) > len(ids) // 6 for p in parts), [len(p) for p in parts]


@pytest.mark.parametrize("text, message", [
    ("2", r"GS_SHARD: expected 'k/n' \(the k-th of n parts\), got '2'"),
    ("0/3", r"GS_SHARD: expected 1 <= k <= n in 'k/n', got '0/3'"),
    ("4/3", r"GS_SHARD: expected 1 <= k <= n in 'k/n', got '4/3'"),
])
def test_a_shard_that_is_not_a_part_is_refused(text, message):
    from _spread import parse_shard

    assert parse_shard(" 2/3 ") == (2, 3)
    with pytest.raises(ValueError, match=message):
        parse_shard(text)


def test_a_shard_runs_its_part_of_the_collected_tests(tmp_path):
    """``GS_SHARD=k/n`` in a pytest run: the tests three runs collect are disjoint, cover the
    file's, and run."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(30))\ndef test_one(i):\n    pass\n")
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])

    def run(shard: str, *args):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *args, "test_many.py"], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "GS_SHARD": shard, "PYTHONPATH": path})

    parts = []
    for k in (1, 2, 3):
        proc = run(f"{k}/3", "--collect-only")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        parts.append({line for line in proc.stdout.splitlines() if "::test_one[" in line})
        proc = run(f"{k}/3")
        assert proc.returncode == 0 and f"{len(parts[-1])} passed" in proc.stdout, proc.stdout
    assert all(parts) and sum(map(len, parts)) == 30, [len(p) for p in parts]
    assert len(set.union(*parts)) == 30                          # disjoint, and every test
    proc = run("3")
    assert proc.returncode != 0 and "GS_SHARD: expected 'k/n'" in proc.stdout + proc.stderr
