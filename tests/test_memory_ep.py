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
