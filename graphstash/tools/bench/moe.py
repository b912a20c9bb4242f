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
decorated step: staging, replay and status read), its ratio to the best peer of the same run
(the fastest of the four plain modes that ran: the compiled peer graphed, where it ran, is
the bar), the peak memory over the capture and the timed steps above the memory before the
model was built (NOTE [steady-state peak]), the activation peak (that peak less parameters,
gradients and optimizer state) and its ratio to the best peer's, the bytes each rank sends to
other ranks per step (counted over one eager step), and the flags. ``--profile``: a second
table per configuration gives each mode's kernel time per step and its shares in grouped
GEMMs, other GEMMs, the optimizer and the rest (:mod:`~graphstash.tools.bench.kernel_share`;
torch.profiler over a few steps after the timed ones).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics

import torch

from ...memory import static_footprint
from ...models import PRESETS, MoEConfig
from .. import options, training
from . import failures
from .kernel_share import GROUPS, profile_steps
from .meter import DeviceMeter

# NOTE [bench budgets]: the launch-bound and memory-bound configurations size their static
# buffers at twice the average rows a rank receives (capacity_factor=2.0), the worst case at
# EP=2, so graph + budget never reruns there. The presets take capacity_factor=1.0 on one GPU:
# exactly the T*K dropless rows (a top-k dispatch on one GPU always fills them), so there the
# static budget holds no dead rows; expert-parallel runs pass --capacity-factor.
CONFIGS = {
    "launch-bound": MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=12,
                              num_tokens=1024, capacity_factor=2.0, pad_multiple=16),
    "memory-bound": MoEConfig(hidden=1024, ffn=2048, num_experts=8, topk=2, layers=32,
                              num_tokens=32768, capacity_factor=2.0, pad_multiple=16),
}
QUICK = {
    "quick": MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=4, num_tokens=1024,
                       capacity_factor=2.0, pad_multiple=16),
    "qwen3-30b-a3b (1 layer, 2048 tokens)": dataclasses.replace(
        PRESETS["qwen3-30b-a3b"], layers=1, num_tokens=2048),
}
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
DTYPE = torch.bfloat16


def add_arguments(parser) -> None:
    """The MoE suite's options on ``graphstash bench``."""
    g = parser.add_argument_group("moe suite")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="one preset only (default: every preset and configuration)")
    g.add_argument("--profile", action="store_true",
                   help=f"also profile {PROFILE_STEPS} steps of each mode (torch.profiler) and "
                   "print the shares of kernel time in grouped GEMMs, other GEMMs, the "
                   "optimizer and the rest")
    for name, help_ in (("hidden", f"hidden width, a multiple of {options.HIDDEN_MULTIPLE}"),
                        ("ffn", "expert ffn width"),
                        ("experts", "experts in total"), ("topk", "experts per token"),
                        ("layers", "MoE layers (default for presets: as many as fit)"),
                        ("tokens", "tokens per rank per step"),
                        ("steps", "timed steps per mode (default 20; 5 with --quick)")):
        g.add_argument(f"--{name}", type=int, default=None, help=help_)
    g.add_argument("--capacity-factor", type=float, default=None,
                   help="static budget as a multiple of the average rows per rank")
    g.add_argument("--plain-experts", action="store_true",
                   help="SiLU experts instead of gated (SwiGLU) ones for --hidden/--ffn")
    g.add_argument("--modes", default=None,
                   help=f"comma-separated subset of: {', '.join(MODES)} (with --ep: of the "
                   "expert-parallel rows)")
    from . import moe_ep

    moe_ep.add_arguments(g)                 # --ep N, --transport: handed over to moe_ep


def _replace(config: MoEConfig, **over) -> MoEConfig:
    """``dataclasses.replace``, refusing top-k above the experts by its option (MoEConfig
    would name its field)."""
    topk, experts = over.get("topk", config.topk), over.get("num_experts", config.num_experts)
    if topk > experts:
        raise options.FlagError(f"--topk: expected at most the experts ({experts}), got {topk}")
    return dataclasses.replace(config, **over)


def configs_from_args(args, quick: bool, *, notes: bool = True) -> dict:
    """``{name: MoEConfig}`` the suite runs, from the command line (see :func:`add_arguments`).
    Raises :class:`~graphstash.tools.options.FlagError` naming the option for a bad value;
    ``notes``: print the one-line notes on values that are allowed but likely mistakes."""
    from . import moe_ep

    if moe_ep.requested(args):
        return moe_ep.configs_from_args(args, quick, notes=notes)
    over = {"hidden": options.hidden_width("--hidden", getattr(args, "hidden", None)),
            "ffn": options.positive_int("--ffn", getattr(args, "ffn", None)),
            "num_experts": options.positive_int("--experts", getattr(args, "experts", None)),
            "topk": options.positive_int("--topk", getattr(args, "topk", None)),
            "layers": options.positive_int("--layers", getattr(args, "layers", None)),
            "num_tokens": options.positive_int("--tokens", getattr(args, "tokens", None)),
            "capacity_factor": options.capacity_factor(
                "--capacity-factor", getattr(args, "capacity_factor", None),
                command="bench" if notes else None)}
    options.positive_int("--steps", getattr(args, "steps", None))
    over = {k: v for k, v in over.items() if v is not None}
    preset = getattr(args, "preset", None)
    custom = any(k in over for k in ("hidden", "ffn", "num_experts", "topk"))
    if preset is not None:
        out = {preset: _replace(PRESETS[preset], **over)}
    elif custom:
        missing = [k for k in ("hidden", "ffn", "num_experts", "topk") if k not in over]
        if missing:
            raise options.FlagError(f"--{missing[0].replace('num_experts', 'experts')}: a custom "
                                "shape needs --hidden, --ffn, --experts and --topk")
        base = MoEConfig(num_tokens=8192, capacity_factor=1.0,
                         gated=not getattr(args, "plain_experts", False), layers=4)
        out = {"custom": _replace(base, **over)}
    else:
        out = dict(QUICK) if quick else {**{n: _replace(c, **over)
                                            for n, c in PRESETS.items()}, **CONFIGS}
    for name, c in out.items():
        if c.topk > c.num_experts:
            raise options.FlagError(f"--topk: expected at most the experts ({c.num_experts}), "
                                    f"got {c.topk}")
    return out


def modes_from_args(args) -> tuple:
    from . import moe_ep

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


@contextlib.contextmanager
def count_exchange(group):
    """Count the bytes this rank sends to other ranks through ``all_to_all_single`` (ours and
    the autograd version both call ``torch.distributed.all_to_all_single``); yields a one-item
    list holding the running total."""
    total = [0]
    if group is None:
        yield total
        return
    import torch.distributed as dist

    original = dist.all_to_all_single
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        if input_split_sizes:
            sent = sum(n for r, n in enumerate(input_split_sizes) if r != rank)
        else:
            sent = input.shape[0] // world * (world - 1)
        total[0] += sent * row
        return original(output, input, output_split_sizes, input_split_sizes, *a, **k)

    dist.all_to_all_single = counting
    try:
        yield total
    finally:
        dist.all_to_all_single = original


def stash_config(device: torch.device):
    """The :class:`~graphstash.StashConfig` of the ``graph + budget + stash`` mode on the CUDA
    ``device`` (``graphstash memory --mode stash`` uses it too; on the CPU, where the tests
    run the mode, one copy block).

    NOTE [bench pool factor]: the pool is 1.05x the demand of the warmup steps: a layer's
    live rows vary by well under 1 % between random routings here. A step that outgrows it is
    flagged and rerun (the flags column), never silently wrong. Copies get half the
    multiprocessors (NOTE [copy blocks] in stash/scheduler.py). A group's reload is issued once
    autograd released the group before it (``prefetch="after_release"``, NOTE [prefetch]):
    in the memory-bound configuration that step was faster than issuing it at the last unpack,
    with the same peak, in every paired run (the figures and their command:
    docs/moe-performance.md, change 7).
    """
    import graphstash

    on_gpu = torch.device(device).type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 2
    return graphstash.StashConfig(host_tier=False, copy_blocks=max(1, sms // 2),
                                  device_factor=1.05, prefetch="after_release")


def run_mode(mode: str, config: MoEConfig, group, device, batches: list, steps: int, *,
             stash=None, compile_kwargs: dict | None = None, profile: bool = False) -> dict:
    """Build ``mode`` (one of :data:`MODES`) of ``config``, warm up (capture), time ``steps``
    steps on ``batches`` (:func:`graphstash.tools.training.batches`, at least 3, on
    ``device``); returns the figures the module docstring lists, as a dict.

    ``device``: a CUDA device; on the CPU (the tests) graph_step runs every step eagerly, the
    times are the host clock's and the memory figures None. ``group``: ``torch.distributed``
    group for expert parallelism (None: one GPU); ``stash``: the :class:`~graphstash.StashConfig`
    of the stash mode (default :func:`stash_config`); ``compile_kwargs``: ``torch.compile``'s
    arguments for the modes of :data:`COMPILED` (default ``{}``: Inductor, default mode);
    ``profile``: add ``"kernels"`` (:func:`~graphstash.tools.bench.kernel_share.profile_steps`
    of :data:`PROFILE_STEPS` steps; CUDA only, None elsewhere).
    Example::

        figures = run_mode("graph + budget", CONFIGS["launch-bound"], None, device, batches, 20)
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if len(batches) < 3:
        raise ValueError(f"batches: expected at least 3 (two warmup steps and the capture), "
                         f"got {len(batches)}")
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
        one(*batches[1])
        meter.sync()
        # NOTE [steady-state peak]: the warmup steps are left out of the peak (the first one
        # runs before the stash pool is sized); the capture and the timed steps count.
        meter.reset_peak()
        one(*batches[2])                                  # graphed modes: the capture
        samples = [meter.time_ms(next_step) for _ in range(steps)]
        meter.sync()
        peak = meter.peak_above(base)
        kernels = None
        if profile and meter.on_gpu:
            kernels = profile_steps(next_step, PROFILE_STEPS)
    static = static_footprint(run_.model, run_.optimizer, device=device)
    stats = step.stats if graphed else None
    plan = step.stash_manager.plan() if mode == "graph + budget + stash" else []
    figures = [statistics.median(samples), sent[0] / 2**20,
               float(stats.over_budget if stats else 0), float(stats.overflows if stats else 0),
               float(stats.eager_reruns if stats else 0)]
    if peak is not None:
        figures += [peak / 2**20, (peak - static) / 2**20]
    if group is not None:
        figures = torch.tensor(figures, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX, group=group)
        figures = figures.tolist()
    step_ms, sent_mib, over_budget, overflow, reruns = figures[:5]
    peak_mib, act_mib = figures[5:] if peak is not None else (None, None)
    run_.release()
    del run_, one, step
    return {"step_ms": step_ms, "peak_mib": peak_mib, "activation_peak_mib": act_mib,
            "exchanged_mib": sent_mib, "over_budget": int(over_budget),
            "overflow": int(overflow), "reruns": int(reruns),
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


def _cell(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _print_table(name: str, config: MoEConfig, world: int, results: dict, peer,
                 device_name: str) -> None:
    print(f"\nMoE {name}: {config.layers} layers, hidden {config.hidden}, ffn {config.ffn}"
          f"{' (gated)' if config.gated else ''}, {config.num_experts} experts top-"
          f"{config.topk}, {config.num_tokens} tokens/rank, capacity factor "
          f"{config.capacity_factor}, EP={world}, {device_name}")
    if world > 1:
        print("figures: the largest over the ranks; flags: set on any rank")
    print(f"{'mode':<25}{'step ms':>9}{'/best':>7}{'peak MiB':>10}{'act MiB':>9}{'act/best':>9}"
          f"{'sent MiB':>10}  flags (over_budget, overflow, reruns)")
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<25}  {r['error']}")
            continue
        print(f"{mode:<25}{r['step_ms']:>9.2f}{_cell(r['ratio_to_best_peer'], '.3f', 7)}"
              f"{_cell(r['peak_mib'], '.0f', 10)}{_cell(r['activation_peak_mib'], '.0f', 9)}"
              f"{_cell(r['activation_ratio_to_best_peer'], '.2f', 9)}{r['exchanged_mib']:>10.1f}"
              f"  {r['over_budget']}, {r['overflow']}, {r['reruns']}"
              + (f"; stashed {r['stashed_groups']}/{r['groups']} groups" if r["groups"] else ""))
    print(f"/best: time (act/best: activation peak) over the best peer of this run, {peer!r} "
          "(the fastest plain mode); stashed: groups the stash plan stashed (NOTE [stash plan])"
          if peer else "/best: no peer ran in this run")
    profiled = {m: r["kernels"] for m, r in results.items() if r.get("kernels")}
    if profiled:
        print(f"kernel time per step (torch.profiler, {PROFILE_STEPS} steps after the timed "
              "ones) and its shares")
        print(f"{'mode':<25}{'step ms':>9}{'kernel ms':>10}{'kernels':>9}"
              + "".join(f"{g:>14}" for g in GROUPS))
        for mode, k in profiled.items():
            share = k["shares"] or {}
            print(f"{mode:<25}{results[mode]['step_ms']:>9.2f}{k['kernel_ms_per_step']:>10.2f}"
                  f"{k['kernels_per_step']:>9.0f}"
                  + "".join(f"{100 * share[g]:>13.1f}%" if g in share else f"{'-':>14}"
                            for g in GROUPS))
        print("shares of the summed kernel time, kernels grouped by name "
              "(graphstash/tools/bench/kernel_share.py)")


def run(quick: bool = False, args=None, *, device=None, compile_kwargs: dict | None = None
        ) -> dict:
    """Benchmark the modes on the configurations the command line selects; returns
    ``{config: {"config", "results": {mode: figures}, "best_peer"}}``.

    ``device``: default the current CUDA device; the CPU runs every mode eagerly at the sizes
    given (the tests). ``compile_kwargs``: ``torch.compile``'s arguments for the compiled modes
    (default: its defaults).
    """
    from . import moe_ep

    if moe_ep.requested(args):
        return moe_ep.run(quick, args)
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
    out = {}
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
        results = {}
        for mode in modes:
            if mode in ("plain graph", "plain compiled graph") and world > 1:
                results[mode] = {"error": "not capturable: reads its split sizes back"}
                continue
            if mode in COMPILED and world > 1:
                results[mode] = {"error": "one GPU only (compiled modes)"}
                continue
            if world > 1:           # a failure on one rank only would leave the others waiting
                results[mode] = run_mode(mode, config, group, device, batches, steps,
                                         compile_kwargs=compile_kwargs, profile=profile)
                continue
            try:
                results[mode] = run_mode(mode, config, group, device, batches, steps,
                                         compile_kwargs=compile_kwargs, profile=profile)
            except Exception as exc:            # reported in the table; the next mode runs
                results[mode] = {"error": "failed: " + failures.describe(exc)}
        peer = add_ratios(results)
        if rank == 0:
            _print_table(name, config, world, results, peer, device_name)
        out[name] = {"config": dataclasses.asdict(config), "results": results,
                     "best_peer": peer}
    return out


def cycling(step, batches: list):
    """A call without arguments that runs ``step`` on the next of ``batches`` (tuples of its
    arguments), from the first, round and round."""
    counter = iter(range(1 << 62))

    def next_step():
        return step(*batches[next(counter) % len(batches)])

    return next_step
