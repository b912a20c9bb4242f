"""Functions the spawned ranks of ``graphstash.tools.bench.ep_ranks.spawn_processes`` run in
the tests (module-level, so that a spawned process can import them)."""
from __future__ import annotations


def one_rank_fails(ranks) -> str:
    """Rank 1 raises at once; the others wait for it in a collective that never completes."""
    if ranks.rank == 1:
        raise KeyError("rank one's own error")
    ranks.sync()
    return "unreachable"


def every_rank_answers(ranks) -> dict:
    """Each rank's number and the largest over the ranks."""
    return {"rank": ranks.rank, "largest": ranks.largest([ranks.rank])[0],
            "gathered": ranks.gather(ranks.rank * 10)}
