"""Run a test function as several ranks, one process each, and report the failing rank's own
error.

Each rank initialises ``torch.distributed`` (gloo, through a file store in a fresh temporary
directory: no ports to race for), takes its share of the CPU cores for torch's threads (ranks
that outnumber the cores, each spinning as many threads as there are cores, slow every
collective down several times), runs ``fn(rank, world_size, *args)``, and writes ``ok`` or
its traceback to ``<dir>/rank<r>.txt``. The parent waits for every process (a generous
deadline, never part of what is checked) and fails with the text of each rank that failed or
never finished. Nothing depends on timing: a rank's result is what it wrote.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch.multiprocessing as mp

DEADLINE_S = 600.0


def end_process(code: int = 0) -> None:
    """End this rank's process now, after its group was torn down and its result written.

    NOTE [ending a rank's process]: a spawned rank that returned let the interpreter finalize
    beside gloo's worker threads, and now and then that aborted the process after its work was
    done and checked ("terminate called without an active exception", SIGABRT: two of the
    gloo tests in one run of the whole CPU suite, each passing again alone). Nothing a test
    checks happens after the result is written, so the rank leaves without finalizing."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _entry(rank: int, world_size: int, tmp: str, fn, args, env: dict) -> None:
    os.environ.update(env)
    path = os.path.join(tmp, f"rank{rank}.txt")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=300))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        with open(path, "w") as f:
            f.write("ok\n" + ("" if result is None else repr(result)))
    except BaseException:
        with open(path, "w") as f:
            f.write(f"rank {rank} failed:\n{traceback.format_exc()}")
        os._exit(1)
    end_process()            # NOTE [ending a rank's process]


def run_ranks(fn, world_size: int, *args, env: dict | None = None,
              deadline_s: float = DEADLINE_S, missing_ok=()) -> list[str]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; returns what
    each returned (``repr``, '' for None) or raises AssertionError with the failing ranks'
    tracebacks. ``fn`` must be a module-level function of an importable module. The ranks in
    ``missing_ok`` may end without a result (a test that kills them), with exit code 0."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(r, world_size, tmp, fn, args, env or {}))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(deadline_s)
        failures, results = [], []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            path = os.path.join(tmp, f"rank{r}.txt")
            text = open(path).read() if os.path.exists(path) else None
            if text is None and r in missing_ok and p.exitcode == 0:
                results.append("(ended without a result, as the test asked)")
            elif text is None:
                failures.append(f"rank {r} wrote no result (exit code {p.exitcode})")
            elif not text.startswith("ok\n"):
                failures.append(text)
            else:
                results.append(text[3:])
        if failures:
            raise AssertionError("\n".join(failures))
        return results
