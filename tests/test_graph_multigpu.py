"""Data parallel under graph_step on every GPU of the machine (NCCL, one rank per GPU: 2, 4 or
8, ``_world.WORLD_SIZE``): DistributedDataParallel and FSDP2 capture once and train as the
same eager loop does (NOTE [DDP]).

Each case runs in its own set of processes; each rank trains a graphed model and, beside it, an
eager twin with the same wrapper and seeds, on its own data, and writes what it saw to a file.
A failure shows every rank's own traceback. The CPU (gloo) variant of the eager path is
test_graph_ddp.py.
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

from _world import WORLD_SIZE as WORLD, require_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]
STEPS, WIDTH = 24, 64   # every width divides over 8 ranks (FSDP2 shards dim 0)
RUNS = 10           # runs of each DDP-on-the-default-stream case in one set of processes


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, WIDTH)).cuda()


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True, capturable=True)


def _data(rank):
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    return [(torch.randn(32, WIDTH, device="cuda", generator=g),
             torch.randn(32, WIDTH, device="cuda", generator=g)) for _ in range(STEPS)]


def _wrap(case, model, rank):
    """The model wrapped for ``case`` (DDP built on a side stream unless the case says not)."""
    if case.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        if case.startswith("ddp_default_stream"):      # as users build it
            return DDP(model, device_ids=[rank], static_graph=case.endswith("static"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):        # DDP's gradient hooks are bound to this stream
            wrapped = DDP(model, device_ids=[rank], static_graph=case == "ddp_static")
        torch.cuda.current_stream().wait_stream(side)
        return wrapped
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _run_rank(rank, case):
    from graphstash.errors import CaptureError
    from graphstash.graph import graph_step

    model = _wrap(case, _mlp(), rank)
    ref = _wrap(case, _mlp(), rank)
    opt, ref_opt = _opt(model.parameters()), _opt(ref.parameters())
    proj = torch.randn(WIDTH, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))

    def loss_of(m, x, y):
        return ((m(x) - y) * proj).pow(2).mean()

    @graph_step(optimizer=opt, warmup=2)
    def train_step(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    result = {"rank": rank}
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            for x, y in _data(rank):
                losses.append(train_step(x, y))
        except CaptureError as exc:
            result["capture_error"] = str(exc)
            return result             # a failed capture leaves the collectives unmatched
    ref_losses = []
    for x, y in _data(rank)[:len(losses)]:
        ref_opt.zero_grad()
        loss = loss_of(ref, x, y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())
    st = train_step.stats
    result.update(
        bitwise=[bool(torch.equal(a, b)) for a, b in zip(losses, ref_losses)],
        worst=max((float((a - b).abs() / b.abs()) for a, b in zip(losses, ref_losses)),
                  default=0.0),
        grads_nonzero=all(p.grad is not None and float(p.grad.abs().max()) > 1e-6
                          for p in ref.parameters()),
        captures=st.captures, replays=st.replays, steps=st.steps,
        warmup_steps=train_step.warmup_steps, found=len(train_step.data_parallel))
    train_step.release()          # the graph holds NCCL work: free it before the communicator
    torch.cuda.synchronize()
    return result


def _worker(rank, case, out_dir):
    path = os.path.join(out_dir, f"rank{rank}")
    try:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(out_dir, 'store')}",
                                rank=rank, world_size=WORLD)
        try:
            # DDP as users build it: ten fresh models, each rebuilt, warmed up and captured
            runs = RUNS if case.startswith("ddp_default_stream") else 1
            torch.save([_run_rank(rank, case) for _ in range(runs)], path + ".pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(path + ".err", "w") as f:
            f.write(traceback.format_exc())
        raise


def _spawn(case, out_dir):
    context = mp.start_processes(_worker, args=(case, out_dir), nprocs=WORLD, join=False,
                                 start_method="spawn")
    failure = None
    try:
        deadline = time.monotonic() + 600      # turns a hang into a failure only
        while not context.join(timeout=10):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                failure = TimeoutError("the ranks did not finish within 600 s")
                break
    except Exception as exc:
        failure = exc
    errors = {r: open(os.path.join(out_dir, f"rank{r}.err")).read()
              for r in range(WORLD) if os.path.exists(os.path.join(out_dir, f"rank{r}.err"))}
    if failure is not None or errors:
        raise AssertionError("a rank failed:\n" + "\n".join(
            f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))
            + ("" if errors else f"\n{failure}"))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.parametrize("case", ["ddp_static", "ddp_plain", "ddp_default_stream_static",
                                  "ddp_default_stream", "fsdp2"])
def test_data_parallel_captures_once_and_equals_eager(case, tmp_path):
    require_gpus(WORLD)
    results = [run for rank in _spawn(case, str(tmp_path)) for run in rank]
    assert len(results) == WORLD * (RUNS if case.startswith("ddp_default_stream") else 1)
    for r in results:
        print(case, r)
        assert "capture_error" not in r, r
        assert r["grads_nonzero"], r
        assert r["worst"] <= 1e-6 and all(r["bitwise"]), r
        expected_warmup = 11 if case.startswith("ddp") else 2
        assert r["warmup_steps"] == expected_warmup and r["found"] == int(case != "fsdp2"), r
        assert (r["captures"], r["steps"]) == (1, STEPS), r
        assert r["replays"] == STEPS - expected_warmup, r
