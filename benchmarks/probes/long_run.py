"""Long runs stay flat: graph_step over thousands of steps of the reference MoE model.

``--steps`` (default 2000) steps of ``graphstash.models.MoEModel`` (budget or stash mode, small
widths) under ``graph_step``, with

* random forced overflows: on a forced step the step routes 16 auxiliary tokens unevenly through
  a second ``dispatch`` whose budget only even routing fits, so dispatch raises the over-budget
  flag on the device, as routing skew does in a real model; graph_step skips that update and
  reruns the step dropless (where budgets do not apply);
* a scheduler on a float lr (linear warmup, then cosine);
* a checkpoint saved and loaded back into the same model, optimizer and scheduler every
  ``--checkpoint-every`` steps (default 500);

beside an eager control from the same state: the same model in dropless mode, trained by a plain
loop with the same optimizer, scheduler and checkpoints. On CUDA the control's optimizer is
handed each step's lr rounded to float32, the value the graph's kernels read from their lr
tensor (NOTE [scheduled hyperparameters] in graphstash/graph/_schedule.py).

Every ``--print-every`` steps (default 100) it prints: step, the largest |loss - eager loss| in
that window, eager reruns so far against the overflows forced so far, captures,
``torch.cuda.memory_allocated`` and the host's resident memory. It exits 1 when a rerun count
differs from the forced overflows, a loss drifts from the control by more than ``--tolerance``
(relative), or allocated or host memory grows after the first printed row.

    python benchmarks/probes/long_run.py                      # 2000 steps on the GPU
    python benchmarks/probes/long_run.py --mode stash --steps 4000
    python benchmarks/probes/long_run.py --device cpu --steps 200
"""
from __future__ import annotations

import argparse
import io
import os
import random
import sys
import warnings

import torch

from graphstash import graph_step
from graphstash.models import MoEConfig, MoEModel
from graphstash.moe import dispatch

AUX_TOKENS, AUX_EXPERTS, AUX_PAD = 16, 2, 8
EVEN = [0] * 8 + [1] * 8           # 8 + 8 rows: fits the 16-row budget
UNEVEN = [0] * 9 + [1] * 7         # padded to 16 + 8 rows: over the budget


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--mode", choices=("budget", "stash"), default="budget")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--overflow-rate", type=float, default=0.03)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--print-every", type=int, default=100)
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest relative |loss - eager loss| accepted")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "hidden", "ffn", "experts", "layers", "tokens", "checkpoint_every",
                 "print_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if not 0 <= args.overflow_rate <= 1:
        p.error(f"--overflow-rate: expected a probability in [0, 1], got {args.overflow_rate}")
    if args.tokens < AUX_TOKENS or args.hidden < AUX_PAD:
        p.error(f"--tokens and --hidden: expected at least {AUX_TOKENS} and {AUX_PAD}")
    return args


def _host_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _setup(args, dev, mode):
    config = MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=args.experts, topk=2,
                       layers=args.layers, num_tokens=args.tokens, capacity_factor=1.0)
    model = MoEModel(config, mode=mode, seed=args.seed, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, fused=True,
                            capturable=True)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warm),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps - warm))],
        milestones=[warm])
    return model, opt, sched


def _checkpoint(model, opt, sched):
    """Save to a file-like buffer and load back into the same objects."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])


def run(args) -> dict:
    """Train ``args.steps`` steps beside the eager control; print the table; return the rows,
    the verdict and the step's stats."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"graphstash\.graph_step\(.*eagerly")
        return _run(args)


def _run(args) -> dict:
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    stash = None
    if args.mode == "stash":
        from graphstash import StashConfig

        stash = StashConfig(device_factor=1.1, host_factor=0.25)
    model, opt, sched = _setup(args, dev, args.mode)
    control, ctl_opt, ctl_sched = _setup(args, dev, "dropless")
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
    proj = torch.randn(args.hidden, device=dev, generator=gen)
    chooser = random.Random(args.seed)
    aux_weight = torch.ones(AUX_TOKENS, 1, device=dev)
    routes = {False: torch.tensor(EVEN, device=dev).view(-1, 1),
              True: torch.tensor(UNEVEN, device=dev).view(-1, 1)}

    def loss_of(m, x):
        return (m(x).float() * proj).sum() / x.shape[0]

    @graph_step(optimizer=opt, stash=stash, warmup=2, device=dev)
    def train_step(x, route):
        # the over-budget flag of a skewed routing, raised on the device (no effect on the loss)
        dispatch(x[:AUX_TOKENS, :AUX_PAD], route, aux_weight, AUX_EXPERTS, budget=AUX_TOKENS,
                 pad_multiple=AUX_PAD)
        loss = loss_of(model, x)
        loss.backward()
        return loss

    def control_step(x):
        ctl_opt.zero_grad(set_to_none=True)
        loss = loss_of(control, x)
        loss.backward()
        floats = [g["lr"] for g in ctl_opt.param_groups]
        if dev.type == "cuda":          # the value graph_step's kernels read (float32)
            for g in ctl_opt.param_groups:
                g["lr"] = float(torch.tensor(g["lr"], dtype=torch.float32))
        ctl_opt.step()
        for g, lr in zip(ctl_opt.param_groups, floats):
            g["lr"] = lr
        return loss.detach()

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    header = (f"{'step':>6} {'max |dloss|':>12} {'rel':>9} {'reruns':>7} {'forced':>7} "
              f"{'captures':>8} {'alloc MiB':>10} {'host MiB':>9}")
    print(f"graph_step long run: {args.steps} steps, MoEModel {args.mode} mode "
          f"(hidden {args.hidden}, {args.experts} experts, {args.layers} layers, {args.tokens} "
          f"tokens) on {dev}; checkpoint every {args.checkpoint_every}, forced overflow rate "
          f"{args.overflow_rate}")
    print(header)
    print("-" * len(header))
    rows, forced, window, window_rel, worst_rel = [], 0, 0.0, 0.0, 0.0
    for step in range(1, args.steps + 1):
        x = torch.randn(args.tokens, args.hidden, device=dev, generator=gen)
        force = chooser.random() < args.overflow_rate and step > 2     # not in the warmup
        forced += force
        loss = train_step(x, routes[force])
        ref = control_step(x)
        sched.step()
        ctl_sched.step()
        diff = float((loss - ref).abs())
        rel = diff / max(float(ref.abs()), 1e-12)
        window, window_rel = max(window, diff), max(window_rel, rel)
        worst_rel = max(worst_rel, rel)
        if step % args.checkpoint_every == 0:
            _checkpoint(model, opt, sched)
            _checkpoint(control, ctl_opt, ctl_sched)
        if step % args.print_every == 0 or step == args.steps:
            sync()
            st = train_step.stats
            alloc = torch.cuda.memory_allocated(dev) / 2 ** 20 if dev.type == "cuda" else 0.0
            row = dict(step=step, max_diff=window, max_rel=window_rel, reruns=st.eager_reruns,
                       forced=forced, captures=st.captures, alloc_mib=alloc,
                       host_mib=_host_rss_mib())
            rows.append(row)
            print(f"{step:>6} {window:>12.3e} {window_rel:>9.2e} {row['reruns']:>7} "
                  f"{forced:>7} {row['captures']:>8} "
                  f"{alloc if dev.type == 'cuda' else float('nan'):>10.1f} "
                  f"{row['host_mib']:>9.1f}")
            window, window_rel = 0.0, 0.0
    st = train_step.stats
    first, last = rows[0], rows[-1]
    verdict = {
        "reruns_equal_forced": st.eager_reruns == forced,
        "losses_within_tolerance": worst_rel <= args.tolerance,
        "allocated_flat": last["alloc_mib"] <= first["alloc_mib"] + max(1.0, 0.01 * first["alloc_mib"]),
        "host_flat": last["host_mib"] <= first["host_mib"] + max(32.0, 0.05 * first["host_mib"]),
    }
    print(f"reruns {st.eager_reruns} for {forced} forced overflows; worst relative |dloss| "
          f"{worst_rel:.2e} (tolerance {args.tolerance}); allocated {first['alloc_mib']:.1f} -> "
          f"{last['alloc_mib']:.1f} MiB; host {first['host_mib']:.1f} -> "
          f"{last['host_mib']:.1f} MiB; {st.captures} captures, {st.invalidations} invalidations")
    print("flat and equal" if all(verdict.values()) else
          "NOT flat or equal: " + ", ".join(k for k, ok in verdict.items() if not ok))
    train_step.release()
    return {"rows": rows, "verdict": verdict, "forced": forced, "worst_rel": worst_rel,
            "stats": st.as_dict()}


def main(argv=None) -> int:
    result = run(parse_args(argv))
    return 0 if all(result["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
