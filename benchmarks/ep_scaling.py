"""Expert-parallel scaling: ``graphstash bench moe`` at EP = 1, 2, 4 (or any counts that fit
the machine), for each preset and routing, and one Markdown table of them.

    python benchmarks/ep_scaling.py run --out DIR [--ep 1,2,4] [--presets ...] [--routings ...]
    python benchmarks/ep_scaling.py table DIR

``run`` launches one bench per (preset, EP, routing) and keeps its JSON and log in ``DIR``
(a bench whose JSON is there already is not run again, so an interrupted run resumes):

- EP = N > 1: ``torchrun --standalone --nproc-per-node N -m graphstash.tools.cli bench moe
  --ep N`` with the expert-parallel rows (``--rows``) and ``--profile`` (the exchange's share of
  the kernel time);
- EP = 1: the one-GPU bench, every expert on one GPU: ``plain eager`` stands for the eager peer,
  ``graph + budget`` for live rows and ``graph + budget + stash`` for live rows + stash (there is
  no exchange). A preset whose layers do not fit one GPU runs ``--ep1-layers`` layers (``fit``:
  as many as fit); the table gives the layers of each run.

``--pack`` runs benches of fewer GPUs than the machine has side by side on disjoint GPUs
(``CUDA_VISIBLE_DEVICES``): four EP = 1 benches at once on four GPUs, two EP = 2 benches. They
share the host's cores and NVSwitch, not GPUs or NVLink ports. ``--deadline`` starts no bench
after that many seconds (the rest run on the next call).

``table`` prints, per preset: EP, routing, row, step ms, the eager peer's time over the row's
(speed-up), activation MiB per rank and its ratio to the eager peer's, MiB each rank sends to
the others per step, the exchange kernels' share of the kernel time (torch.profiler; the
exchange kernels' time includes waiting on the peers), the row's step over the no-exchange
row's (NOTE [no-exchange row] in ``graphstash/tools/bench/ep_rows.py``: what the exchange
costs; balanced routing only), steps over budget / reruns / recaptures; then the
weak-scaling ratios (the row's step at EP = N over its step at the smallest EP > 1
measured).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

EP_ROWS = ("eager peer,nccl chunks,worst-case buffers,live rows,live rows + stash,"
           "live rows + resend,gathered tokens,gathered tokens + resend,no exchange")
ONE_GPU_ROWS = {"plain eager": "eager peer", "graph + budget": "live rows",
                "graph + budget + stash": "live rows + stash"}


def _slug(preset: str, ep: int, routing: str) -> str:
    return f"{preset}_ep{ep}_{routing.replace(':', '-')}"


def bench_argv(preset: str, ep: int, routing: str, args) -> list[str]:
    """The command line of one bench (``python3 -m ...``)."""
    common = ["--preset", preset, "--tokens", str(args.tokens), "--steps", str(args.steps),
              "--capacity-factor", str(args.capacity_factor), "--routing", routing,
              "--format", "md"]
    if ep == 1:
        layers = dict(item.split("=") for item in args.ep1_layers.split(",") if item)
        count = layers.get(preset, str(args.layers))
        return [sys.executable, "-m", "graphstash.tools.cli", "bench", "moe", *common,
                *(["--layers", count] if count != "fit" else []),
                "--modes", ",".join(ONE_GPU_ROWS)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ep), "-m", "graphstash.tools.cli", "bench", "moe",
            "--ep", str(ep), *common, "--layers", str(args.layers), "--modes", args.rows,
            *(["--profile"] if args.profile else [])]


def run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    jobs = [(p, ep, r) for ep in sorted({int(e) for e in args.ep.split(",")})
            for p in args.presets.split(",") for r in args.routings.split(",")]
    pending = [j for j in jobs if not os.path.exists(os.path.join(args.out, _slug(*j) + ".json"))]
    failed = 0
    while pending:
        if time.monotonic() - t0 > args.deadline:
            print(f"deadline: {len(pending)} benches not started: "
                  + ", ".join(_slug(*j) for j in pending), flush=True)
            break
        ep = pending[0][1]
        side = max(1, args.gpus // ep) if args.pack else 1
        batch = [j for j in pending if j[1] == ep][:side]
        procs = []
        for slot, (preset, ep, routing) in enumerate(batch):
            slug = _slug(preset, ep, routing)
            argv = bench_argv(preset, ep, routing, args) + [
                "--json", os.path.join(args.out, slug + ".json")]
            env = dict(os.environ)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(slot * ep + i) for i in range(ep))
            log = open(os.path.join(args.out, slug + ".log"), "w")
            log.write("$ CUDA_VISIBLE_DEVICES=" + env["CUDA_VISIBLE_DEVICES"] + " "
                      + shlex.join(argv) + "\n")
            log.flush()
            procs.append((slug, time.monotonic(), log,
                          subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)))
        for slug, start, log, proc in procs:
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
            log.close()
            failed += rc != 0
            print(f"{slug}: rc {rc}, {time.monotonic() - start:.0f} s"
                  + (f" (side by side with {len(procs) - 1})" if len(procs) > 1 else ""),
                  flush=True)
        pending = [j for j in pending if j not in batch]
    return 1 if failed else 0


def _rows(path: str):
    """``(config, ep, gpu, {row: result})`` of one bench JSON, EP = 1 rows renamed."""
    data = json.load(open(path))
    (entry,) = data["moe"].values()
    ep = entry.get("ep", {}).get("world_size", 1)
    rows = entry["results"]
    if ep == 1:
        rows = {ONE_GPU_ROWS[k]: v for k, v in rows.items() if k in ONE_GPU_ROWS}
    gpus = data.get("meta", {}).get("gpus") or "?"
    return entry["config"], ep, gpus, rows


def _fmt(value, spec: str) -> str:
    return "–" if value is None or value != value else format(value, spec)


def _push_barrier(split: list) -> str:
    """The push's and the barriers' ms per step, each the largest over the ranks (``split``:
    each rank's ``exchange_ms`` from ``--profile``), or a dash where none ran."""
    if not any("push" in e or "barrier" in e for e in split):
        return "–"
    push, barrier = (max(e.get(kind, 0.0) for e in split) for kind in ("push", "barrier"))
    return f"{push:.2f} / {barrier:.2f}"


def table(args) -> int:
    found = {}
    for name in sorted(os.listdir(args.dir)):
        if name.endswith(".json"):
            config, ep, gpus, rows = _rows(os.path.join(args.dir, name))
            preset = name.split("_ep")[0]
            found[(preset, ep, config["routing"])] = (config, gpus, rows)
    order = ("eager peer", "nccl chunks", "worst-case buffers", "live rows", "live rows + stash",
             "live rows + resend", "gathered tokens", "gathered tokens + resend", "no exchange")
    for preset in sorted({k[0] for k in found}):
        print(f"\n### {preset}\n")
        print("| EP | layers | routing | row | step ms | peer / row | act MiB | act / peer "
              "| sent MiB | exchange share | push / barrier ms | row / no exchange "
              "| over budget / reruns / recaptures |")
        print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        keys = sorted((k for k in found if k[0] == preset), key=lambda k: (k[1], k[2]))
        for key in keys:
            config, _, rows = found[key]
            peer = rows.get("eager peer", {})
            local = rows.get("no exchange", {}).get("step_ms")
            for name in order:
                r = rows.get(name)
                if r is None or "step_ms" not in r:     # not run, or not available there
                    continue
                shares = [k["shares"].get("exchange") for k in (r.get("kernels") or [])
                          if k and k.get("shares")]
                act, peer_act = r.get("activation_peak_mib"), peer.get("activation_peak_mib")
                split = [k.get("exchange_ms") or {} for k in (r.get("kernels") or []) if k]
                print(f"| {key[1]} | {config['layers']} | {key[2]} | {name} "
                      f"| {_fmt(r['step_ms'], '.2f')} "
                      f"| {_fmt(peer.get('step_ms', float('nan')) / r['step_ms'], '.2f')}x "
                      f"| {_fmt(act, '.0f')} "
                      f"| {_fmt(act / peer_act if act and peer_act else None, '.2f')} "
                      f"| {_fmt(r.get('sent_mib', r.get('exchanged_mib')), '.1f')} "
                      f"| {_fmt(max(shares) if shares else None, '.1%')} "
                      f"| {_push_barrier(split)} "
                      f"| {_fmt(r['step_ms'] / local if local else None, '.3f')} "
                      f"| {r['over_budget']:.0f} / {r['reruns']:.0f} / {r['recaptures']:.0f} |")
        eps = sorted({k[1] for k in keys if k[1] > 1})
        if len(eps) > 1:
            print(f"\nweak scaling (step at EP = N over EP = {eps[0]}, same tokens per rank):\n")
            for routing in sorted({k[2] for k in keys}):
                base = found.get((preset, eps[0], routing))
                for ep in eps[1:]:
                    other = found.get((preset, ep, routing))
                    if base is None or other is None:
                        continue
                    parts = [f"{name} {other[2][name]['step_ms'] / base[2][name]['step_ms']:.3f}"
                             for name in order
                             if "step_ms" in base[2].get(name, {})
                             and "step_ms" in other[2].get(name, {})]
                    print(f"- {routing}, EP {ep} / {eps[0]}: " + ", ".join(parts))
    gpu_names = sorted({str(v[1]) for v in found.values()})
    print("\nGPUs: " + "; ".join(gpu_names))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the benches into --out")
    r.add_argument("--out", required=True)
    r.add_argument("--ep", default="1,2,4")
    r.add_argument("--presets", default="qwen3-30b-a3b,mixtral-8x7b")
    r.add_argument("--routings", default="balanced,skew:1.5,zipf:1.2,drift")
    r.add_argument("--rows", default=EP_ROWS, help="the expert-parallel rows (--modes)")
    r.add_argument("--layers", type=int, default=8)
    r.add_argument("--ep1-layers", default="",
                   help="PRESET=LAYERS,... for EP = 1 where the preset's layers do not fit "
                   "one GPU (LAYERS 'fit': as many as fit, the one-GPU bench's choice)")
    r.add_argument("--tokens", type=int, default=8192)
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--capacity-factor", type=float, default=1.25)
    r.add_argument("--no-profile", dest="profile", action="store_false")
    r.add_argument("--pack", action="store_true",
                   help="run benches of fewer GPUs side by side on disjoint GPUs")
    r.add_argument("--gpus", type=int, default=None,
                   help="GPUs of the machine to pack onto (default: what torch sees)")
    r.add_argument("--deadline", type=float, default=float("inf"),
                   help="start no bench after this many seconds")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per bench")
    t = sub.add_parser("table", help="the Markdown table of a run's JSON files")
    t.add_argument("dir")
    args = p.parse_args(argv)
    if args.command == "run":
        if args.gpus is None:
            import torch
            args.gpus = torch.cuda.device_count()
        return run(args)
    return table(args)


if __name__ == "__main__":
    sys.exit(main())
