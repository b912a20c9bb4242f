"""``graphstash memory --ep N`` (NOTE [memory over ranks] in graphstash/tools/memory_command.py):
every rank of the launch records its own step of ``MoEModel(config, group=g)``, rank 0 prints
its report and every rank's peaks. Two gloo ranks on the CPU, as torchrun would start them."""
from __future__ import annotations

import ast

from _ranks import run_ranks


def _memory(rank: int, world: int, argv: list) -> str:
    import contextlib
    import io
    import os

    from graphstash.tools import cli

    os.environ["WORLD_SIZE"] = str(world)          # what torchrun sets
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv)
    assert rc == 0
    return out.getvalue()


def test_memory_over_two_ranks_reports_every_rank():
    argv = ["memory", "--ep", "2", "--mode", "stash", "--layers", "3", "--capacity-factor",
            "3.0", "--routing", "skew:1.5", "--device", "cpu"]
    out, other = (ast.literal_eval(r) for r in run_ranks(_memory, 2, argv))
    assert other == "", other                      # only rank 0 prints
    assert "expert parallel: 2 ranks (MoEModel(config, group=g)), 4 experts each" in out
    assert "routing skew:1.5" in out and "stash plan" in out
    table = out[out.index("every rank"):].splitlines()
    assert table[1].split()[:2] == ["rank", "peak"]
    rows = [line.split() for line in table[3:5]]
    assert [r[0] for r in rows] == ["0", "1"]
    assert all(float(r[1]) > float(r[2]) > 0 for r in rows)      # peak above activations
    assert "exchange: live rows over gloo" in out                # top-2 over two ranks


def test_memory_over_two_ranks_at_a_top_k_above_them_gathers_the_tokens():
    """README's default at top-4 over two ranks (NOTE [auto exchange]), stashed and skewed:
    the gathered tokens run, and the report says so."""
    argv = ["memory", "--ep", "2", "--mode", "stash", "--layers", "3", "--topk", "4",
            "--capacity-factor", "3.0", "--routing", "skew:1.5", "--device", "cpu"]
    out, other = (ast.literal_eval(r) for r in run_ranks(_memory, 2, argv))
    assert other == "", other
    assert "exchange: gathered tokens" in out and "stash plan" in out, out
    # --exchange chooses instead
    out, _ = (ast.literal_eval(r) for r in run_ranks(_memory, 2, argv + ["--exchange",
                                                                         "live rows"]))
    assert "exchange: live rows over gloo" in out, out


def _memory_in_own_group(rank: int, world: int, store: str, argv: list) -> bool:
    """``memory --ep`` as torchrun starts it, with no group yet: the command initialises the
    group itself (through a file store here, not a port) and must destroy it before it
    returns (NOTE [leaving the group]). Returns whether a group is left."""
    import functools

    import torch.distributed as dist

    dist.destroy_process_group()                   # run_ranks' group: not there under torchrun
    real = dist.init_process_group
    dist.init_process_group = functools.partial(real, init_method=f"file://{store}",
                                                rank=rank, world_size=world)
    try:
        _memory(rank, world, argv)
    finally:
        dist.init_process_group = real
    left = dist.is_initialized()
    if not left:                                   # run_ranks destroys its group at the end
        real("gloo", init_method=f"file://{store}.after", rank=rank, world_size=world)
        # both ranks connected before either tears the group down and leaves: a rank whose
        # own side of gloo's mesh was up could exit while its peer still connected to it
        # ("Connection closed by peer" on the other rank, once in a run of the CPU suite)
        dist.barrier()
    return left


def test_memory_destroys_the_group_it_initialised(tmp_path):
    argv = ["memory", "--ep", "2", "--mode", "budget", "--layers", "1", "--device", "cpu"]
    left = [ast.literal_eval(r) for r in run_ranks(_memory_in_own_group, 2,
                                                   str(tmp_path / "store"), argv)]
    assert left == [False, False]
