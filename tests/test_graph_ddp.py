"""graph_step around DistributedDataParallel (NOTE [DDP]): two gloo processes on the CPU run the
eager path a GPU run takes before its capture. graph_step finds the DDP module that holds the
optimizer's parameters, runs 11 eager steps before the call that would capture (warned once),
trains exactly as a plain DDP loop does (losses and parameters equal bit for bit, each rank on
its own seeded data), and refuses ``find_unused_parameters=True`` without ``static_graph``.

Nothing depends on timing: ranks meet only in collectives, results go through files, and a
failure shows every rank's own traceback (a rank that failed first, not only the peer that
then lost its connection). The two-GPU NCCL variant is in test_graph_multigpu.py.
"""
from __future__ import annotations

import os
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _ranks import end_process

WORLD, STEPS, WIDTH = 2, 14, 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, WIDTH))


def _data(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, WIDTH, generator=gen), torch.randn(6, WIDTH, generator=gen))
            for _ in range(STEPS)]


def _run_rank(rank, case, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from graphstash.graph import graph_step

    kwargs = {"static": dict(static_graph=True), "plain": {},
              "unused": dict(find_unused_parameters=True)}[case]
    model, ref = _model(), _model()
    ddp, ref_ddp = DDP(model, **kwargs), DDP(ref, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    proj = torch.randn(WIDTH, generator=torch.Generator().manual_seed(7))

    @graph_step(optimizer=opt, device="cpu", warmup=2)
    def train_step(x, y):
        loss = ((ddp(x) - y) * proj).pow(2).mean()
        loss.backward()
        return loss

    result = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "unused":
            try:
                train_step(*_data(rank)[0])
            except ValueError as exc:
                result["refused"] = str(exc)
            result["steps"] = train_step.stats.steps
            return result
        losses = [train_step(x, y) for x, y in _data(rank)]
    ref_losses = []
    for x, y in _data(rank):
        ref_opt.zero_grad()
        loss = ((ref_ddp(x) - y) * proj).pow(2).mean()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())
    result.update(
        losses_equal=[bool(torch.equal(a, b)) for a, b in zip(losses, ref_losses)],
        params_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())),
        grads_nonzero=all(float(p.grad.abs().max()) > 1e-6 for p in ref.parameters()),
        found=[type(m).__name__ for m in train_step.data_parallel],
        found_is_ours=train_step.data_parallel[0] is ddp,
        warmup_steps=train_step.warmup_steps, eager_steps=train_step.stats.eager_steps,
        steps=train_step.stats.steps,
        ddp_notes=[str(c.message) for c in caught if "DistributedDataParallel" in str(c.message)])
    return result


CASES = ("static", "plain", "unused")


def _worker(rank, out_dir):
    """Every case in one process group (one spawn: the suite stays fast)."""
    path = os.path.join(out_dir, f"rank{rank}")
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}",
                                rank=rank, world_size=WORLD)
        try:
            torch.save({case: _run_rank(rank, case, out_dir) for case in CASES}, path + ".pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(path + ".err", "w") as f:
            f.write(traceback.format_exc())
        raise
    end_process()            # NOTE [ending a rank's process] in tests/_ranks.py


def _spawn(out_dir):
    """Run both ranks; on failure, raise with every rank's own traceback."""
    context = mp.start_processes(_worker, args=(out_dir,), nprocs=WORLD, join=False,
                                 start_method="spawn")
    failure = None
    try:
        # A deadline only turns a hang into a failure; a passing run never comes near it.
        deadline = time.monotonic() + 900
        while not context.join(timeout=10):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                failure = TimeoutError("the ranks did not finish within 900 s")
                break
    except Exception as exc:            # a rank raised: the peers are terminated by join()
        failure = exc
    errors = {r: open(os.path.join(out_dir, f"rank{r}.err")).read()
              for r in range(WORLD) if os.path.exists(os.path.join(out_dir, f"rank{r}.err"))}
    if failure is not None or errors:
        raise AssertionError("a rank failed:\n" + "\n".join(
            f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))
            + ("" if errors else f"\n{failure}"))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(str(tmp_path_factory.mktemp("ddp")))


@pytest.mark.parametrize("case", ["static", "plain"])
def test_ddp_is_found_warmed_up_and_trains_as_eager(case, ranks):
    for r in (results[case] for results in ranks):
        assert r["grads_nonzero"], r
        assert all(r["losses_equal"]) and r["params_equal"], r
        assert r["found"] == ["DistributedDataParallel"] and r["found_is_ours"], r
        assert (r["warmup_steps"], r["eager_steps"], r["steps"]) == (11, STEPS, STEPS), r
        assert len(r["ddp_notes"]) == 1 and "11 eager steps run before the capture" in \
            r["ddp_notes"][0], r


def test_ddp_searching_unused_parameters_is_refused(ranks):
    for r in (results["unused"] for results in ranks):
        assert "find_unused_parameters=True" in r["refused"], r
        assert "static_graph=True" in r["refused"] and r["steps"] == 0, r
