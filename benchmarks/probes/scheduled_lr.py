"""Step time of graph_step with a scheduled float lr against the same loop with a tensor lr.

graph_step hands a float lr that a scheduler changes to the optimizer as a float32 device tensor
written before each replay (NOTE [scheduled hyperparameters] in graphstash/graph/_schedule.py).
This times, for each schedule users run (cosine, linear warmup then cosine decay, OneCycle,
LambdaLR), three loops over the same launch-bound MLP in the same process, in alternating rounds
(the median round is kept): graph_step with the float lr; graph_step with
``lr=torch.tensor(..., device="cuda")`` (torch's own way, one capture); and the eager loop with
the float lr. The acceptance asks the float-lr step to be within 1.1x of the tensor-lr one, with
one capture. Timings are printed, not asserted.

    python benchmarks/probes/scheduled_lr.py [--steps 100] [--rounds 5] [--width 256 --depth 24]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.optim import lr_scheduler as sched

from graphstash import graph_step

SCHEDULES = ("cosine", "warmup_then_decay", "one_cycle", "lambda")


def _scheduler(name, opt, steps):
    if name == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=steps)
    if name == "warmup_then_decay":
        warm = max(1, steps // 10)
        return sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.05, total_iters=warm),
                                        sched.CosineAnnealingLR(opt, T_max=steps - warm)],
                                  milestones=[warm])
    if name == "one_cycle":
        return sched.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, cycle_momentum=False)
    return sched.LambdaLR(opt, lambda s: 0.97 ** s)


def _loop(kind, schedule, args, data):
    """A step callable for ``kind`` ("float", "tensor", "eager") and its graph_step (or None)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    lr = torch.tensor(1e-3, device="cuda") if kind == "tensor" else 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)
    # the schedule runs over every step this loop takes (rounds x steps, plus warmup)
    scheduler = _scheduler(schedule, opt, args.steps * args.rounds + 8)

    def loss_of(x, y):
        return torch.nn.functional.mse_loss(model(x), y)

    if kind == "eager":
        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss_of(x, y).backward()
            opt.step()
            scheduler.step()
        return step, None

    @graph_step(optimizer=opt, warmup=2, outputs="static")
    def train_step(x, y):
        loss = loss_of(x, y)
        loss.backward()
        return loss

    def step(x, y):
        train_step(x, y)
        scheduler.step()

    for x, y in data[:4]:                     # warmup and capture before timing
        step(x, y)
    return step, train_step


def _time(step, data, steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=24)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("scheduled_lr: needs a CUDA GPU; none is visible")
        return 2
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [(torch.randn(64, args.width, device="cuda", generator=g),
             torch.randn(64, args.width, device="cuda", generator=g)) for _ in range(8)]
    print(f"{torch.cuda.get_device_name()}; MLP {args.depth} x {args.width}, fused capturable "
          f"AdamW, {args.steps} timed steps x {args.rounds} rounds per loop")
    header = (f"{'schedule':<18} {'float lr ms':>11} {'tensor lr ms':>12} {'ratio':>6} "
              f"{'eager ms':>9} {'captures float/tensor':>22}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for schedule in SCHEDULES:
        loops = {k: _loop(k, schedule, args, data) for k in ("float", "tensor", "eager")}
        samples = {k: [] for k in loops}
        for _ in range(args.rounds):
            for k, (step, _) in loops.items():
                samples[k].append(_time(step, data, args.steps))
        ms = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
        ratio = ms["float"] / ms["tensor"]
        worst = max(worst, ratio)
        caps = "/".join(str(loops[k][1].stats.captures) for k in ("float", "tensor"))
        print(f"{schedule:<18} {ms['float']:>11.3f} {ms['tensor']:>12.3f} {ratio:>6.3f} "
              f"{ms['eager']:>9.3f} {caps:>22}")
        for _, train_step in loops.values():
            if train_step is not None:
                train_step.release()
    print(f"worst float/tensor step time ratio: {worst:.3f} (acceptance: within 1.1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
