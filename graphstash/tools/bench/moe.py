"""``graphstash bench moe``: MoE training steps against the peer users would run instead.

Every mode is a full training step (forward, backward, fused AdamW) of
:class:`graphstash.models.MoEModel`, from the same initialisation and batches, built by
:mod:`graphstash.tools.training` (its loss reaches every parameter: NOTE [training loss]):

- ``plain eager`` / ``plain graph``: the peer, a dropless MoE in plain PyTorch (sort, histc,
  ``torch._grouped_mm`` over exactly T*K rows, ``index_add_``; :mod:`graphstash.models.plain`),
  eagerly and captured by :func:`graphstash.graph_step` (one GPU only: under expert
  parallelism it reads its all-to-all split sizes back to the host every layer);
- ``plain compiled eager`` / ``plain compiled graph``: the same peer ``torch.compile``d
  (default mode: Inductor fuses its elementwise work as graphstash's kernels do), in an eager
  loop and under ``graph_step``: what users who compile would run (one GPU only);
- ``eager dropless``: graphstash's dispatch sized from the real counts (host reads), eager;
- ``graph + budget``: static-budget dispatch, the step captured by ``graph_step``;
- ``graph + budget compiled``: the same model ``torch.compile``d, under ``graph_step``;
- ``graph + budget + stash``: graph + budget with ``stash_activations`` around the experts
  (``graph_step(stash=...)``, device tier).

A compiled mode wraps the model in ``torch.compile(model)`` before the warmup; its first
warmup call compiles it, and the capture compiles nothing (NOTE [compile and capture] in
``graphstash/graph/compile_guard.py``). Dynamo's caches are reset before every mode, so no
mode runs code another compiled or meets the recompile limit. A mode that fails (a refused
capture, say) is reported in the table with its reason and the others still run (one GPU).

Configurations: the presets at real layer widths (``graphstash.models.PRESETS``:
``qwen3-30b-a3b``, ``mixtral-8x7b``; gated experts, 8192 tokens per rank, as many layers as
fit unless ``--layers``), a user's own (``--hidden --ffn --experts --topk``), and the
launch-bound and memory-bound configurations of earlier figures. Expert parallel under
``torchrun --nproc-per-node N -m graphstash.tools.cli bench moe`` (WORLD_SIZE is detected;
rank 0 prints; figures are the largest over the ranks). With ``--ep N`` (and ``--transport``)
the suite runs the expert-parallel rows instead, on N GPUs or N ranks sharing one
(:mod:`graphstash.tools.bench.moe_ep`).

Columns: step time (median of CUDA-event samples of back-to-back calls, each call a whole
decorated step: staging, replay and status read) and the samples' range (min-max; the JSON
has the quartiles too), its ratio to the best peer of the same run
(the fastest of the four plain modes that ran: the compiled peer graphed, where it ran, is
the bar), the peak memory over the capture and the timed steps above the memory before the
model was built (NOTE [steady-state peak]), the activation peak (that peak less parameters,
gradients and optimizer state) and its ratio to the best peer's, the bytes each rank sends to
other ranks per step (counted over one eager step), and the flags. ``--profile``: a second
table per configuration gives each mode's kernel time per step and its shares in the exchange,
grouped GEMMs, other GEMMs, the optimizer and the rest
(:mod:`~graphstash.tools.bench.kernel_share`; torch.profiler over a few steps after the timed
ones; CUDA only). Each row is printed as soon as its mode is measured, with a progress bar
per configuration and mode on stderr; ``--device cpu`` runs the loop on the CPU (eagerly, the
host clock, no memory figures: a smoke run, not a measurement).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import statistics

import torch

from ...memory import static_footprint
from ...models import PRESETS, MoEConfig
from ...tables import Column
from .. import options, progress, training
from ..output import Output
from . import failures, moe_ep
from .kernel_share import GROUPS, profile_steps
from .meter import DeviceMeter
from .moe_setup import (CONFIGS, DTYPE, QUICK, configs_from_args as one_gpu_configs,
                        count_exchange, recaptures, stash_config)
from .spread import range_text, spread

SUMMARY = "MoE training steps against the plain-PyTorch peer (one GPU; --ep N: expert parallel)"
DESCRIPTION = ("Trains the reference MoE model one step at a time in each mode (the plain-PyTorch "
               "peer eager, graphed and compiled; graphstash's dropless, budget, compiled and "
               "stash modes) from the same initialisation and batches, and prints per mode the "
               "step time and its range, the ratio to the fastest peer, peak and activation "
               "memory, bytes sent and the flags. The presets run at real layer widths; "
               "--ep N runs the expert-parallel rows instead. docs/moe-performance.md explains "
               "every column.")
MODES = ("plain eager", "plain graph", "plain compiled eager", "plain compiled graph",
         "eager dropless", "graph + budget", "graph + budget compiled", "graph + budget + stash")
GRAPHED = ("plain graph", "plain compiled graph", "graph + budget", "graph + budget compiled",
           "graph + budget + stash")
COMPILED = ("plain compiled eager", "plain compiled graph", "graph + budget compiled")
PEERS = ("plain eager", "plain graph", "plain compiled eager", "plain compiled graph")
MODEL_MODE = {"plain eager": "plain", "plain graph": "plain", "plain compiled eager": "plain",
              "plain compiled graph": "plain", "eager dropless": "dropless",
              "graph + budget": "budget", "graph + budget compiled": "budget",
              "graph + budget + stash": "stash"}
PROFILE_STEPS = 3   # steps torch.profiler records per mode under --profile
WARMUP_CALLS = 3    # calls before the timed ones: two eager warmups and the capture
__all__ = ["CONFIGS", "COMPILED", "DTYPE", "GRAPHED", "MODES", "MODEL_MODE", "PEERS",
           "PROFILE_STEPS", "QUICK", "add_arguments", "add_ratios", "best_peer",
           "configs_from_args", "count_exchange", "cycling", "modes_from_args", "run",
           "run_mode", "stash_config"]


def add_arguments(parser, *, presets=None) -> None:
    """The MoE suite's options on ``graphstash bench`` (``presets``: the names ``--preset``
    takes, default the MoE presets; ``bench all`` adds the hf suite's)."""
    g = parser.add_argument_group("moe suite")
    g.add_argument("--preset", choices=sorted(presets or PRESETS), default=None,
                   help="one preset only (default: every preset and configuration)")
    g.add_argument("--profile", action="store_true",
                   help=f"also profile {PROFILE_STEPS} steps of each mode (torch.profiler, CUDA "
                   "only) and print the shares of kernel time in the exchange, grouped GEMMs, "
                   "other GEMMs, the optimizer and the rest (with --ep: per rank)")
    for name, help_ in (("hidden", f"hidden width, a multiple of {options.HIDDEN_MULTIPLE}"),
                        ("ffn", "expert ffn width"),
                        ("experts", "experts in total"), ("topk", "experts per token"),
                        ("layers", "MoE layers (default for presets: as many as fit)"),
                        ("tokens", "tokens per rank per step"),
                        ("steps", "timed steps per mode (default 20; 5 with --quick)")):
        g.add_argument(f"--{name}", type=int, default=None, help=help_)
    g.add_argument("--capacity-factor", type=float, default=None,
                   help="static budget as a multiple of the average rows per rank")
    g.add_argument("--routing", default=None,
                   help="router logit bias, the same for every mode and peer: balanced "
                   "(default), skew:X (one rank's experts favoured by X), zipf:S, "
                   "drift[:X[:P]] (skew:X moving to the next rank's experts every P steps)")
    g.add_argument("--plain-experts", action="store_true",
                   help="SiLU experts instead of gated (SwiGLU) ones for --hidden/--ffn")
    g.add_argument("--modes", default=None,
                   help=f"comma-separated subset of: {', '.join(MODES)} (with --ep: of the "
                   "expert-parallel rows)")
    moe_ep.add_arguments(g)                 # --ep N, --transport: handed over to moe_ep


def configs_from_args(args, quick: bool, *, notes: bool = True) -> dict:
    """``{name: MoEConfig}`` the suite runs, from the command line (see :func:`add_arguments`;
    with ``--ep`` the expert-parallel bench's). Raises
    :class:`~graphstash.tools.options.FlagError` naming the option for a bad value;
    ``notes``: print the one-line notes on values that are allowed but likely mistakes."""
    if moe_ep.requested(args):
        return moe_ep.configs_from_args(args, quick, notes=notes)
    return one_gpu_configs(args, quick, notes=notes)


def modes_from_args(args) -> tuple:
    if moe_ep.requested(args):
        return moe_ep.rows_from_args(args)
    return options.names("--modes", getattr(args, "modes", None), MODES)


def _fit_layers(config: MoEConfig, world: int, device) -> int:
    """As many layers as fit on ``device`` (at most ``config.layers``): bf16 parameters, two
    AdamW moments and the gradients twice (the eager warmup's, then the graph pool's), plus
    twice the activations the peer keeps (the eager pool and the graph's private pool)."""
    E_local = config.num_experts // world
    w_rows = (3 if config.gated else 2) * config.ffn
    params = E_local * w_rows * config.hidden + config.num_experts * config.hidden
    rows = config.num_tokens * config.topk
    acts = rows * (2 * config.hidden + 4 * config.ffn) + 4 * config.num_tokens * config.hidden
    per_layer = 2 * (5 * params + 2 * acts)
    free, _ = torch.cuda.mem_get_info(device)
    fit = int(0.8 * free // per_layer)
    return max(1, min(config.layers, fit))


def run_mode(mode: str, config: MoEConfig, group, device, batches: list, steps: int, *,
             stash=None, compile_kwargs: dict | None = None, profile: bool = False,
             on_call=None) -> dict:
    """Build ``mode`` (one of :data:`MODES`) of ``config``, warm up (capture), time ``steps``
    steps on ``batches`` (:func:`graphstash.tools.training.batches`, at least 3, on
    ``device``); returns the figures the module docstring lists, as a dict, with
    ``step_ms_spread`` (:func:`~graphstash.tools.bench.spread.spread` of the samples) beside
    the median ``step_ms``.

    ``device``: a CUDA device; on the CPU (the tests) graph_step runs every step eagerly, the
    times are the host clock's and the memory figures None. ``group``: ``torch.distributed``
    group for expert parallelism (None: one GPU; the figures are then the largest over the
    ranks); ``stash``: the :class:`~graphstash.StashConfig` of the stash mode (default
    :func:`stash_config`); ``compile_kwargs``: ``torch.compile``'s arguments for the modes of
    :data:`COMPILED` (default ``{}``: Inductor, default mode); ``profile``: add ``"kernels"``
    (:func:`~graphstash.tools.bench.kernel_share.profile_steps` of :data:`PROFILE_STEPS`
    steps; CUDA only, None elsewhere); ``on_call``: called without arguments after each call of
    the step (outside the timed region), for a progress bar.
    Example::

        figures = run_mode("graph + budget", CONFIGS["launch-bound"], None, device, batches, 20)
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if len(batches) < 3:
        raise ValueError(f"batches: expected at least 3 (two warmup steps and the capture), "
                         f"got {len(batches)}")
    tick = on_call if on_call is not None else (lambda: None)
    meter = DeviceMeter(device)
    torch._dynamo.reset()         # no compiled code, guard or recompile count of another mode
    meter.settle()                # the previous mode's step, model and graph, if in a cycle
    meter.reset_peak()
    base = meter.allocated()
    graphed = mode in GRAPHED
    if mode == "graph + budget + stash" and stash is None:
        stash = stash_config(device)
    elif mode != "graph + budget + stash":
        stash = None
    if mode in COMPILED:
        compile_kwargs = {} if compile_kwargs is None else dict(compile_kwargs)
    else:
        compile_kwargs = None
    run_ = training.build(config, MODEL_MODE[mode], device, batches[0][0].dtype,
                          graphed=graphed, seed=0, lr=1e-4, stash=stash, group=group,
                          compile_kwargs=compile_kwargs)
    one, step = run_.step, run_.graph
    next_step = cycling(one, batches)

    with training.quiet_cpu_graph_step(meter.on_gpu):
        with count_exchange(group) as sent:
            one(*batches[0])                              # eager in every mode (compiles)
        tick()
        one(*batches[1])
        tick()
        meter.sync()
        # NOTE [steady-state peak]: the warmup steps are left out of the peak (the first one
        # runs before the stash pool is sized); the capture and the timed steps count.
        meter.reset_peak()
        one(*batches[2])                                  # graphed modes: the capture
        tick()
        samples = []
        for _ in range(steps):
            samples.append(meter.time_ms(next_step))
            tick()
        meter.sync()
        peak = meter.peak_above(base)
        kernels = None
        if profile and meter.on_gpu:
            kernels = profile_steps(next_step, PROFILE_STEPS)
    static = static_footprint(run_.model, run_.optimizer, device=device)
    stats = step.stats if graphed else None
    plan = step.stash_manager.plan() if mode == "graph + budget + stash" else []
    s = spread(samples)
    figures = [statistics.median(samples), sent[0] / 2**20,
               float(stats.over_budget if stats else 0), float(stats.overflows if stats else 0),
               float(stats.reruns if stats else 0), s["min"], s["q1"], s["q3"], s["max"],
               float(recaptures(stats, device))]
    if peak is not None:
        figures += [peak / 2**20, (peak - static) / 2**20]
    if group is not None:
        figures = torch.tensor(figures, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX, group=group)
        figures = figures.tolist()
    step_ms, sent_mib, over_budget, overflow, reruns = figures[:5]
    s.update(median=step_ms, min=figures[5], q1=figures[6], q3=figures[7], max=figures[8])
    recaptured = int(figures[9])
    peak_mib, act_mib = figures[10:] if peak is not None else (None, None)
    budgets = run_.model.budgets
    run_.release()
    del run_, one, step
    return {"step_ms": step_ms, "step_ms_spread": s, "peak_mib": peak_mib,
            "activation_peak_mib": act_mib, "exchanged_mib": sent_mib,
            "over_budget": int(over_budget), "overflow": int(overflow), "reruns": int(reruns),
            "recaptures": recaptured,
            "budgets": budgets.factor_range() if budgets is not None else None,
            "stashed_groups": sum(r["stashed"] for r in plan), "groups": len(plan),
            "kernels": kernels}


def best_peer(results: dict):
    """The fastest mode of :data:`PEERS` in ``results`` (``{mode: figures}``) that ran, or
    None: the bar every mode's ratio is taken against."""
    ran = [m for m in PEERS if m in results and "step_ms" in results[m]]
    return min(ran, key=lambda m: results[m]["step_ms"]) if ran else None


def add_ratios(results: dict):
    """Set each mode's ``ratio_to_best_peer`` (step time) and ``activation_ratio_to_best_peer``
    (None where a figure is missing); returns the best peer's name (:func:`best_peer`)."""
    peer = best_peer(results)
    p = results.get(peer, {}) if peer else {}
    for r in results.values():
        if "step_ms" not in r:
            continue
        r["ratio_to_best_peer"] = r["step_ms"] / p["step_ms"] if p.get("step_ms") else None
        act, p_act = r.get("activation_peak_mib"), p.get("activation_peak_mib")
        r["activation_ratio_to_best_peer"] = act / p_act if act is not None and p_act else None
    return peer


COLUMNS = (Column("mode", width=25), Column("step ms", ".2f", width=8),
           Column("min-max ms", width=13, align="right"), Column("/best", ".3f", width=6),
           Column("peak MiB", ".0f", width=8), Column("act MiB", ".0f", width=7),
           Column("act/best", ".2f", width=8), Column("sent MiB", ".1f", width=8),
           Column("flags (over budget, overflow, reruns, recaptures)"), Column("budgets"))
PROFILE_COLUMNS = (Column("mode", width=25), Column("step ms", ".2f", width=8),
                   Column("kernel ms", ".2f", width=9), Column("kernels", ".0f", width=7)) + \
    tuple(Column(g, width=max(6, len(g)), align="right") for g in GROUPS)


def _title(name: str, config: MoEConfig, world: int, device_name: str) -> str:
    return (f"MoE {name}: {config.layers} layers, hidden {config.hidden}, ffn {config.ffn}"
            f"{' (gated)' if config.gated else ''}, {config.num_experts} experts top-"
            f"{config.topk}, {config.num_tokens} tokens/rank, capacity factor "
            f"{config.capacity_factor}, routing {config.routing}, EP={world}, {device_name}")


def _row(mode: str, r: dict) -> list:
    flags = f"{r['over_budget']}, {r['overflow']}, {r['reruns']}, {r.get('recaptures', 0)}" + (
        f"; stashed {r['stashed_groups']}/{r['groups']} groups" if r["groups"] else "")
    return [mode, r["step_ms"], range_text(r.get("step_ms_spread")),
            r.get("ratio_to_best_peer"), r["peak_mib"], r["activation_peak_mib"],
            r.get("activation_ratio_to_best_peer"), r["exchanged_mib"], flags, r.get("budgets")]


def _share(value) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def _print_profile(out: Output, results: dict) -> None:
    profiled = {m: r["kernels"] for m, r in results.items() if r.get("kernels")}
    if not profiled:
        return
    out.note(f"kernel time per step (torch.profiler, {PROFILE_STEPS} steps after the timed "
             "ones) and its shares")
    out.whole(PROFILE_COLUMNS, [
        [mode, results[mode]["step_ms"], k["kernel_ms_per_step"], k["kernels_per_step"]]
        + [_share((k["shares"] or {}).get(g)) for g in GROUPS] for mode, k in profiled.items()])
    out.note("shares of the summed kernel time, kernels grouped by name "
             "(graphstash/tools/bench/kernel_share.py)")


def run(quick: bool = False, args=None, *, device=None, compile_kwargs: dict | None = None,
        out: Output | None = None) -> dict:
    """Benchmark the modes on the configurations the command line selects; returns
    ``{config: {"config", "results": {mode: figures}, "best_peer"}}``. Each mode's row is
    printed as soon as it is measured (its ratios to the best peer once every peer of the run
    has run: rows measured before get theirs in a line under the table), with a progress bar
    per configuration and mode on stderr.

    ``device``: default the current CUDA device; the CPU runs every mode eagerly at the sizes
    given (the tests). ``compile_kwargs``: ``torch.compile``'s arguments for the compiled modes
    (default: its defaults). ``out``: where the tables go (default: plain text on stdout).
    """
    if moe_ep.requested(args):
        return moe_ep.run(quick, args, device=device, out=out)
    out = Output() if out is None else out
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if world > 1:
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        group = dist.group.WORLD
    if device is None or world > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    device_name = f"bf16, {torch.cuda.get_device_name(device)}" if on_gpu else \
        "bf16 on the CPU (graph_step runs eagerly; no memory figures)"
    rank = torch.distributed.get_rank() if group is not None else 0
    configs = configs_from_args(args, quick, notes=False)
    modes = modes_from_args(args)
    steps = getattr(args, "steps", None) or (5 if quick else 20)
    profile = bool(getattr(args, "profile", False))
    explicit_layers = getattr(args, "layers", None) is not None
    calls = WARMUP_CALLS + steps
    shown = rank == 0
    results_out = {}
    with progress.bar(len(configs) * len(modes), "bench moe", unit="mode",
                      show=shown) as overall:
        for name, config in configs.items():
            if name in PRESETS and not explicit_layers and on_gpu:
                # what the previous configuration's modes left (graphs, cached blocks) is not
                # this one's to lose: collect it before measuring the free memory
                gc.collect()
                torch.cuda.empty_cache()
                config = dataclasses.replace(config, layers=_fit_layers(config, world, device))
            if world > 1 and config.chunk_factor is None:
                config = dataclasses.replace(config, chunk_factor=config.capacity_factor)
            batches = training.batches(config, 4, seed=1234 + rank, device=device, dtype=DTYPE)
            if shown:
                out.title(_title(name, config, world, device_name))
                if world > 1:
                    out.note("figures: the largest over the ranks; flags: set on any rank")
                table = out.table(COLUMNS)
            results, pending = {}, []
            peers = [m for m in modes if m in PEERS]
            for mode in modes:
                with progress.bar(calls, f"{name}: {mode}", show=shown) as bar:
                    results[mode] = _measure(mode, config, group, device, batches, steps, world,
                                             compile_kwargs, profile, bar.update)
                overall.update()
                if not shown:
                    continue
                if "error" in results[mode]:
                    table.span(mode, results[mode]["error"])
                    continue
                if all(p in results for p in peers):
                    add_ratios(results)
                else:
                    pending.append(mode)
                table.row(_row(mode, results[mode]))
            peer = add_ratios(results)
            if shown:
                if pending and peer:
                    out.note("/best (act/best) of the rows measured before the last peer: "
                             + "; ".join(f"{m} {_ratios(results[m])}" for m in pending))
                out.note(f"/best: time (act/best: activation peak) over the best peer of this "
                         f"run, {peer!r} (the fastest plain mode); min-max: the timed steps' "
                         "range; stashed: groups the stash plan stashed (NOTE [stash plan])"
                         if peer else "/best: no peer ran in this run")
                _print_profile(out, results)
            results_out[name] = {"config": dataclasses.asdict(config), "results": results,
                                 "best_peer": peer}
    if shown:
        out.end()
    return results_out


def _ratios(r: dict) -> str:
    act = r.get("activation_ratio_to_best_peer")
    return f"{r['ratio_to_best_peer']:.3f}" + ("" if act is None else f" / {act:.2f}")


def _measure(mode, config, group, device, batches, steps, world, compile_kwargs, profile,
             on_call) -> dict:
    """One mode's figures (:func:`run_mode`), or ``{"error": why}`` for a mode that cannot or
    did not run."""
    if mode in ("plain graph", "plain compiled graph") and world > 1:
        return {"error": "not capturable: reads its split sizes back"}
    if mode in COMPILED and world > 1:
        return {"error": "one GPU only (compiled modes)"}
    if world > 1:               # a failure on one rank only would leave the others waiting
        return run_mode(mode, config, group, device, batches, steps,
                        compile_kwargs=compile_kwargs, profile=profile, on_call=on_call)
    try:
        return run_mode(mode, config, group, device, batches, steps,
                        compile_kwargs=compile_kwargs, profile=profile, on_call=on_call)
    except Exception as exc:            # reported in the table; the next mode runs
        return {"error": "failed: " + failures.describe(exc)}


def cycling(step, batches: list):
    """A call without arguments that runs ``step`` on the next of ``batches`` (tuples of its
    arguments), from the first, round and round."""
    counter = iter(range(1 << 62))

    def next_step():
        return step(*batches[next(counter) % len(batches)])

    return next_step
