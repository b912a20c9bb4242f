"""``graphstash bench moe``: MoE training steps against the peer users would run instead.

Every mode is a full training step (forward, backward, fused AdamW) of
:class:`graphstash.models.MoEModel`, from the same initialisation and batches, built by
:mod:`graphstash.tools.training` (its loss reaches every parameter: NOTE [training loss]):

- ``plain eager`` / ``plain graph``: the peer, a dropless MoE in plain PyTorch (sort, histc,
  ``torch._grouped_mm`` over exactly T*K rows, ``index_add_``; :mod:`graphstash.models.plain`),
  eagerly and captured by :func:`graphstash.graph_step` (one GPU only: under expert
  parallelism it reads its all-to-all split sizes back to the host every layer);
- ``eager dropless``: graphstash's dispatch sized from the real counts (host reads), eager;
- ``graph + budget``: static-budget dispatch, the step captured by ``graph_step``;
- ``graph + budget + stash``: the same with ``stash_activations`` around the experts
  (``graph_step(stash=...)``, device tier).

Configurations: the presets at real layer widths (``graphstash.models.PRESETS``:
``qwen3-30b-a3b``, ``mixtral-8x7b``; gated experts, 8192 tokens per rank, as many layers as
fit unless ``--layers``), a user's own (``--hidden --ffn --experts --topk``), and the
launch-bound and memory-bound configurations of earlier figures. Expert parallel under
``torchrun --nproc-per-node N -m graphstash.tools.cli bench moe`` (WORLD_SIZE is detected;
rank 0 prints; figures are the largest over the ranks). With ``--ep N`` (and ``--transport``)
the suite runs the expert-parallel rows instead, on N GPUs or N ranks sharing one
(:mod:`graphstash.tools.bench.moe_ep`).

Columns: step time (median of CUDA-event samples of back-to-back calls, each call a whole
decorated step: staging, replay and status read), its ratio to the peer (graphed peer for
graphed modes where there is one, else the eager peer), the peak memory over the capture and
the timed steps above the memory before the model was built (NOTE [steady-state peak]), the
activation peak (that peak less parameters, gradients and optimizer state), the bytes each
rank sends to other ranks per step (counted over one eager step), and the flags.
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
from .timing import event_ms

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
MODES = ("plain eager", "plain graph", "eager dropless", "graph + budget",
         "graph + budget + stash")
GRAPHED = ("plain graph", "graph + budget", "graph + budget + stash")
MODEL_MODE = {"plain eager": "plain", "plain graph": "plain", "eager dropless": "dropless",
              "graph + budget": "budget", "graph + budget + stash": "stash"}
DTYPE = torch.bfloat16


def add_arguments(parser) -> None:
    """The MoE suite's options on ``graphstash bench``."""
    g = parser.add_argument_group("moe suite")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="one preset only (default: every preset and configuration)")
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
    text = getattr(args, "modes", None)
    if not text:
        return MODES
    modes = tuple(m.strip() for m in text.split(","))
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise options.FlagError(f"--modes: expected names from {', '.join(MODES)}, "
                                f"got {', '.join(map(repr, bad))}")
    return modes


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
    ``device`` (``graphstash memory --mode stash`` uses it too).

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

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return graphstash.StashConfig(host_tier=False, copy_blocks=max(1, sms // 2),
                                  device_factor=1.05, prefetch="after_release")


def run_mode(mode: str, config: MoEConfig, group, device, batches: list, steps: int, *,
             stash=None) -> dict:
    """Build ``mode`` (one of :data:`MODES`) of ``config``, warm up (capture), time ``steps``
    steps on ``batches`` (:func:`graphstash.tools.training.batches`, at least 3, on the CUDA
    ``device``); returns the figures the module docstring lists, as a dict.

    ``group``: ``torch.distributed`` group for expert parallelism (None: one GPU); ``stash``:
    the :class:`~graphstash.StashConfig` of the stash mode (default :func:`stash_config`).
    Example::

        figures = run_mode("graph + budget", CONFIGS["launch-bound"], None, device, batches, 20)
    """
    torch.cuda.synchronize(device)
    gc.collect()                  # the previous mode's step, model and graph, if in a cycle
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    graphed = mode in GRAPHED
    if mode == "graph + budget + stash" and stash is None:
        stash = stash_config(device)
    elif mode != "graph + budget + stash":
        stash = None
    run_ = training.build(config, MODEL_MODE[mode], device, DTYPE, graphed=graphed, seed=0,
                          lr=1e-4, stash=stash, group=group)
    one, step = run_.step, run_.graph

    with count_exchange(group) as sent:
        one(*batches[0])                                  # eager in every mode
    one(*batches[1])
    torch.cuda.synchronize(device)
    # NOTE [steady-state peak]: the warmup steps are left out of the peak (the first one runs
    # before the stash pool is sized); the capture and the timed steps count.
    torch.cuda.reset_peak_memory_stats(device)
    one(*batches[2])                                      # graphed modes: the capture
    counter = iter(range(1 << 30))
    samples = []
    for _ in range(steps):
        samples.append(event_ms(lambda: one(*batches[next(counter) % len(batches)]), 1))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    static = static_footprint(run_.model, run_.optimizer, device=device)
    stats = step.stats if graphed else None
    plan = step.stash_manager.plan() if mode == "graph + budget + stash" else []
    figures = torch.tensor([statistics.median(samples), peak / 2**20, (peak - static) / 2**20,
                            sent[0] / 2**20,
                            float(stats.over_budget if stats else 0),
                            float(stats.overflows if stats else 0),
                            float(stats.eager_reruns if stats else 0)],
                           dtype=torch.float64, device=device)
    if group is not None:
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX, group=group)
    step_ms, peak_mib, act_mib, sent_mib, over_budget, overflow, reruns = figures.tolist()
    run_.release()
    del run_, one, step
    return {"step_ms": step_ms, "peak_mib": peak_mib, "activation_peak_mib": act_mib,
            "exchanged_mib": sent_mib, "over_budget": int(over_budget),
            "overflow": int(overflow), "reruns": int(reruns),
            "stashed_groups": sum(r["stashed"] for r in plan), "groups": len(plan)}


def _peer_of(mode: str, results: dict):
    if mode in GRAPHED and "plain graph" in results and "step_ms" in results["plain graph"]:
        return "plain graph"
    return "plain eager" if "plain eager" in results else None


def _print_table(name: str, config: MoEConfig, world: int, results: dict) -> None:
    print(f"\nMoE {name}: {config.layers} layers, hidden {config.hidden}, ffn {config.ffn}"
          f"{' (gated)' if config.gated else ''}, {config.num_experts} experts top-"
          f"{config.topk}, {config.num_tokens} tokens/rank, capacity factor "
          f"{config.capacity_factor}, EP={world}, bf16, {torch.cuda.get_device_name()}")
    if world > 1:
        print("figures: the largest over the ranks; flags: set on any rank")
    print(f"{'mode':<24}{'step ms':>9}{'/peer':>7}{'peak MiB':>10}{'act MiB':>9}{'act/peer':>9}"
          f"{'sent MiB':>10}  flags (over_budget, overflow, reruns)")
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<24}  {r['error']}")
            continue
        peer = _peer_of(mode, results)
        p = results.get(peer, {}) if peer else {}
        t_ratio = f"{r['step_ms'] / p['step_ms']:.3f}" if "step_ms" in p else "-"
        a_ratio = (f"{r['activation_peak_mib'] / p['activation_peak_mib']:.2f}"
                   if p.get("activation_peak_mib") else "-")
        print(f"{mode:<24}{r['step_ms']:>9.2f}{t_ratio:>7}{r['peak_mib']:>10.0f}"
              f"{r['activation_peak_mib']:>9.0f}{a_ratio:>9}{r['exchanged_mib']:>10.1f}"
              f"  {r['over_budget']}, {r['overflow']}, {r['reruns']}"
              + (f"; stashed {r['stashed_groups']}/{r['groups']} groups" if r["groups"] else ""))
    print("/peer: time over 'plain graph' for graphed modes, over 'plain eager' for eager ones;"
          " stashed: groups the stash plan stashed (NOTE [stash plan])")


def run(quick: bool = False, args=None) -> dict:
    """Benchmark the modes on the configurations the command line selects; returns
    ``{config: {mode: figures}}``."""
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
    device = torch.device("cuda", torch.cuda.current_device())
    rank = torch.distributed.get_rank() if group is not None else 0
    configs = configs_from_args(args, quick, notes=False)
    modes = modes_from_args(args)
    steps = getattr(args, "steps", None) or (5 if quick else 20)
    explicit_layers = getattr(args, "layers", None) is not None
    out = {}
    for name, config in configs.items():
        if name in PRESETS and not explicit_layers:
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
            if mode == "plain graph" and world > 1:
                results[mode] = {"error": "not capturable: reads its split sizes back"}
                continue
            results[mode] = run_mode(mode, config, group, device, batches, steps)
        if rank == 0:
            _print_table(name, config, world, results)
        out[name] = {"config": dataclasses.asdict(config), "results": results}
    return out
