"""``graphstash memory``: where the memory of one training step of the reference MoE model is.

Builds :class:`graphstash.models.MoEModel` (a preset of :data:`graphstash.models.PRESETS` or
the default sizes, with any width overridden), AdamW and the step as ``graphstash bench moe``
does (:mod:`graphstash.tools.training`): a plain eager loop in ``--mode dropless``,
:func:`graphstash.graph_step` in the budget and stash modes (with ``stash=`` in the latter,
whose plan is printed). After the warmup steps it records with
:func:`graphstash.memory.profile` and prints the peak, the owner totals and the blocks alive at
the peak; ``--plot FILE`` writes the timeline. On a GPU the graphed modes record the call that
captures the step into a CUDA graph and the next call (a replay). On the CPU the sizes not
given by a flag are capped (:data:`CPU_LIMITS`) and the model runs eagerly in float32 with
the reference backend; the header shows every size as it runs and says which were reduced.
``--snapshot FILE`` writes torch's memory snapshot of the recording (CUDA only: the file
PyTorch's memory_viz page loads); ``--format md`` prints the tables as Markdown with the run's
source line. A progress bar on stderr (a terminal only) counts the steps.
Flags are checked before anything is built (:mod:`graphstash.tools.options`).

``--ep N`` records one step of expert parallelism over ``N`` ranks, launched as ``torchrun
--nproc-per-node N -m graphstash.tools.cli memory --ep N`` (NOTE [memory over ranks]); ``--routing``
biases the routers as ``graphstash bench moe --routing`` does.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ..memory import profile
from ..models import EXCHANGE_KINDS, PRESETS, MoEConfig, preset
from ..stash.config import PREFETCH_POINTS
from ..tables import FORMATS
from . import options, progress, provenance, training

MODES = ("dropless", "budget", "stash")
# On the CPU every size not given by a flag is capped (a reduced run of the same structure).
# On a GPU the presets' depth is cut to GPU_LAYERS unless --layers says otherwise: 48
# Qwen3-30B-A3B or 32 Mixtral layers with bf16 AdamW state do not fit one GPU.
CPU_LIMITS = {"hidden": 64, "ffn": 128, "num_experts": 8, "topk": 2, "layers": 2,
              "num_tokens": 256}
GPU_LAYERS = 4
# flag -> MoEConfig field
_FLAGS = {"hidden": "hidden", "ffn": "ffn", "experts": "num_experts", "topk": "topk",
          "layers": "layers", "tokens": "num_tokens", "capacity_factor": "capacity_factor"}
WARMUP = training.WARMUP      # eager steps before the recorded one (graph_step's warmup)
SEED = 1234                   # the recorded batch


def add_arguments(p) -> None:
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="layer widths of a real model (default: graphstash.models.MoEConfig())")
    p.add_argument("--mode", default="stash", choices=MODES,
                   help="dropless (eager, host-sized buffers), budget (static budget, a CUDA "
                   "graph on a GPU) or stash (budget + stashed activations; default)")
    p.add_argument("--hidden", type=int, default=None,
                   help=f"hidden width, a multiple of {options.HIDDEN_MULTIPLE}")
    for flag, what in (("ffn", "expert ffn width"), ("experts", "experts in total"),
                       ("topk", "experts per token"), ("layers", "MoE layers"),
                       ("tokens", "tokens per step")):
        p.add_argument(f"--{flag}", type=int, default=None, help=what)
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="static budget as a multiple of the average rows (below 1: rows are "
                   "over budget)")
    p.add_argument("--stash-prefetch", default=None, choices=PREFETCH_POINTS,
                   help="--mode stash: when a group's reload is issued (StashConfig.prefetch; "
                   "default: the bench's, after_release)")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="write the memory timeline to FILE (PNG, PDF, SVG...; matplotlib)")
    p.add_argument("--device", default="auto",
                   help=f"{', '.join(options.DEVICES)} (default auto: the GPU if torch sees one)")
    p.add_argument("--top", type=int, default=12, help="rows listed per owner (default 12)")
    p.add_argument("--snapshot", default=None, metavar="FILE",
                   help="write torch's memory snapshot of the recorded steps to FILE (a pickle "
                   "for https://pytorch.org/memory_viz; CUDA only)")
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="text (default) or md: Markdown tables with the run's source line")
    p.add_argument("--routing", default=None,
                   help="router logit bias: balanced (default), skew:X, zipf:S, drift[:X[:P]] "
                   "(as graphstash bench moe --routing)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel ranks: launch with torchrun --nproc-per-node N -m "
                   "graphstash.tools.cli memory --ep N; every rank records its step, rank 0 "
                   "prints its report and every rank's peaks")
    p.add_argument("--exchange", default=None, choices=EXCHANGE_KINDS,
                   help="with --ep: MoEConfig.exchange_kind (default auto: the gathered tokens "
                   "where --topk is above the ranks, else the live rows)")


def check_flags(args) -> torch.device:
    """Every flag checked (:class:`~graphstash.tools.options.FlagError` naming it) before
    anything runs; returns the device."""
    dev = options.device("--device", args.device)
    options.hidden_width("--hidden", args.hidden)
    for flag in ("ffn", "experts", "topk", "layers", "tokens"):
        options.positive_int(f"--{flag}", getattr(args, flag))
    options.positive_int("--top", args.top)
    options.capacity_factor("--capacity-factor", args.capacity_factor, command="memory")
    options.plot_file("--plot", args.plot)
    options.output_file("--snapshot", args.snapshot)
    if args.snapshot is not None and dev.type != "cuda":
        raise options.FlagError(f"--snapshot: torch's memory snapshot records the CUDA caching "
                                f"allocator; the run is on {dev}, which has none (--device "
                                "cuda on a GPU)")
    if getattr(args, "exchange", None) is not None and getattr(args, "ep", None) is None:
        raise options.FlagError("--exchange: chooses how expert-parallel ranks exchange "
                                "tokens; give --ep N with it (one device exchanges nothing)")
    ep_world(args)
    return dev


# NOTE [memory over ranks]: with --ep N every process of a torchrun launch is one rank of the
# expert-parallel group and builds the model as README shows it, MoEModel(config, group=g)
# (its exchange chosen and built at the first forward, NOTE [auto exchange] in
# graphstash/moe/exchange/factory.py: the gathered tokens where top-K is above the ranks, else
# the live rows over symmetric memory on the GPUs of one host, gloo on the CPU; the report
# says which ran). Each rank records its own step (the allocator of its own process); rank 0 prints
# its report, and a table of every rank's peak, activation peak and stash pool, since under
# skewed routing the ranks receive different rows and the largest is what must fit.
def ep_world(args, environ=None) -> int | None:
    """``--ep`` checked against the launcher's ``WORLD_SIZE`` (FlagError naming ``--ep``);
    None without it."""
    ep = options.positive_int("--ep", getattr(args, "ep", None), minimum=2)
    if ep is None:
        return None
    environ = os.environ if environ is None else environ
    world = environ.get("WORLD_SIZE")
    if world != str(ep):
        raise options.FlagError(
            f"--ep: expected to run as one of {ep} processes of a torchrun launch (torchrun "
            f"--nproc-per-node {ep} -m graphstash.tools.cli memory --ep {ep}), got "
            f"WORLD_SIZE={world}")
    return ep


def _join_ranks(dev: torch.device):
    """This process's rank of the launch's group (initialised here if the launcher left it to
    us: NCCL on a GPU, gloo on the CPU), its device (``cuda:LOCAL_RANK`` on a GPU) and whether
    the group was initialised here (then :func:`_leave_ranks` destroys it)."""
    import torch.distributed as dist

    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    return dist.group.WORLD, dev, created


# NOTE [leaving the group]: a process that exits with its gloo group alive can abort in the
# group's threads ("terminate called without an active exception"): measured on the CPU, one
# in three four-rank `memory --ep 4` runs ended with a rank killed by SIGABRT after printing
# its report. The command destroys the group it initialised, once every rank is done with it.
def _leave_ranks(group, created: bool) -> None:
    """Wait for every rank of ``group``, then destroy the default group if this command
    initialised it (NOTE [leaving the group])."""
    import torch.distributed as dist

    dist.barrier(group=group)
    if created:
        dist.destroy_process_group()


def sizes(args, on_gpu: bool) -> tuple[MoEConfig, dict]:
    """The model's sizes from the flags: a preset (or ``MoEConfig()``), each size given by a
    flag taking its value; on the CPU the others capped at :data:`CPU_LIMITS`, on a GPU a
    preset's depth cut to :data:`GPU_LAYERS` unless ``--layers``. Returns the config and
    ``{field: size before it was reduced}`` of those reduced (:func:`header` shows both)."""
    config = preset(args.preset) if args.preset else MoEConfig()
    overrides = {field: getattr(args, flag) for flag, field in _FLAGS.items()
                 if getattr(args, flag) is not None}
    reduced = {}
    if not on_gpu:
        for field, cap in CPU_LIMITS.items():
            if field not in overrides and getattr(config, field) > cap:
                reduced[field] = getattr(config, field)
                config = dataclasses.replace(config, **{field: cap})
    elif args.preset and "layers" not in overrides:
        reduced["layers"] = config.layers
        config = dataclasses.replace(config, layers=GPU_LAYERS)
    topk = overrides.get("topk", config.topk)              # before MoEConfig refuses it
    experts = overrides.get("num_experts", config.num_experts)
    if topk > experts:
        raise options.FlagError(f"--topk: expected at most the experts ({experts}), got {topk}")
    config = dataclasses.replace(config, **overrides)
    if getattr(args, "routing", None) is not None:
        from .bench.moe_setup import routing_from_args

        config = dataclasses.replace(config, routing=routing_from_args(args))
    if getattr(args, "exchange", None) is not None:
        config = dataclasses.replace(config, exchange_kind=args.exchange)
    return config, reduced


def _stash_config(mode: str, dev: torch.device, prefetch: str | None = None):
    """The stash configuration ``graphstash bench moe`` runs (None without stashing), with
    ``prefetch`` (``--stash-prefetch``) if given."""
    if mode != "stash":
        return None
    from ..stash import StashConfig

    if dev.type == "cuda":
        from .bench.moe_setup import DEFAULT_PREFETCH, stash_config

        return stash_config(dev, prefetch or DEFAULT_PREFETCH)
    # The reduced model's saved tensors are small: let all of them be candidates.
    return StashConfig(host_tier=False, min_tensor_bytes=0,
                       **({} if prefetch is None else {"prefetch": prefetch}))


def header(args, config: MoEConfig, reduced: dict, dtype, dev, on_gpu: bool) -> str:
    """The first line: every size as it runs; a reduced one with what it was reduced from."""
    def size(field: str, label: str) -> str:
        text = label.format(getattr(config, field))
        return text + (f" (from {reduced[field]})" if field in reduced else "")

    why = ""
    if reduced:
        why = ("; (from N): reduced for the CPU" if not on_gpu
               else "; (from N): reduced to fit one GPU, --layers to change")
    return (f"graphstash memory: {args.preset or 'default sizes'}, mode {args.mode}, "
            f"{size('layers', '{} layers')}, {size('hidden', 'hidden {}')}, "
            f"{size('ffn', 'ffn {}')}, {size('num_experts', '{} experts')} "
            f"{size('topk', 'top-{}')}, {size('num_tokens', '{} tokens')}, "
            f"capacity factor {config.capacity_factor}, {str(dtype).replace('torch.', '')} "
            f"on {dev}{why}")


def run(args) -> int:
    """Check the flags, build, warm up and record one step; print the report (and write the
    plot and the snapshot). With ``--ep``: on every rank of the launch (NOTE [memory over
    ranks])."""
    dev = check_flags(args)
    on_gpu = dev.type == "cuda"
    config, reduced = sizes(args, on_gpu)
    world = ep_world(args)
    group, rank, created = None, 0, False
    if world is not None:
        if config.num_experts % world:
            raise options.FlagError(f"--ep: expected ranks that split the {config.num_experts} "
                                    f"experts evenly, got {world}")
        import torch.distributed as dist

        group, dev, created = _join_ranks(dev)
        rank = dist.get_rank(group)
        if dev.type == "cuda":
            # every kernel compiled before the first exchange: a rank compiling while the other
            # waits in one could reach the exchange's timeout
            from .bench.moe_ep import prepare

            prepare(dev)
    leader = rank == 0
    dtype = torch.bfloat16 if on_gpu else torch.float32
    graphed = args.mode != "dropless"
    captured = on_gpu and graphed
    fmt = getattr(args, "format", "text")
    say = print if leader else (lambda *a, **k: None)
    say(header(args, config, reduced, dtype, dev, on_gpu))
    if world is not None:
        say(f"expert parallel: {world} ranks (MoEModel(config, group=g)), "
            f"{config.num_experts // world} experts each, {config.num_tokens} tokens per rank, "
            f"routing {config.routing}; the report is rank 0's")
    if captured:
        say(f"recorded: the CUDA graph capture of the step by graph_step and the next "
            f"call's replay, after {WARMUP} eager warmup steps")
    else:
        where = "eagerly" if on_gpu else "eagerly on the CPU (no CUDA graph), reference backend"
        say(f"recorded: one step {where}, after {WARMUP} warmup steps")
    steps = 2 if captured else 1
    with training.quiet_cpu_graph_step(on_gpu), \
            progress.bar(WARMUP + steps, "memory: warmup, then the recorded steps",
                         show=leader) as bar:
        run_ = training.build(config, args.mode, dev, dtype, graphed=graphed,
                              stash=_stash_config(args.mode, dev, args.stash_prefetch),
                              warmup=WARMUP, group=group)
        x, y = training.batches(config, 1, seed=SEED + rank, device=dev, dtype=dtype)[0]

        def step(*batch):
            out = run_.step(*batch)
            bar.update()
            return out

        report = profile(step, x, y, model=run_.model, optimizer=run_.optimizer,
                         stash_manager=run_.stash_manager, warmup=WARMUP, steps=steps,
                         device=dev, snapshot=args.snapshot is not None)
    if leader and run_.stash_manager is not None and run_.stash_manager.plan():
        print("\nstash plan (from the warmup measurement):")
        if fmt == "md":
            print()
        print(run_.stash_manager.plan_table(fmt))
    say()
    say(report.table(top=args.top, fmt=fmt))
    if world is not None:
        per_rank = rank_figures(report, group)
        say()
        say(rank_table(per_rank, fmt))
        # README's default picks the exchange (NOTE [auto exchange]): say which ran
        say(f"exchange: {run_.model.exchange_kind}")
    if fmt == "md":
        say(f"\nsource: {provenance.line(provenance.collect(getattr(args, 'argv', None)))}")
    if args.plot and leader:
        print(f"wrote {report.plot(args.plot)}")
    if args.snapshot and leader:
        print(f"wrote {report.write_snapshot(args.snapshot)} (torch's memory snapshot: open it "
              "in https://pytorch.org/memory_viz)")
    run_.release()
    if world is not None:
        _leave_ranks(group, created)
    return 0


def rank_figures(report, group) -> list:
    """Every rank's ``(peak, activation peak, stash pool)`` bytes, in rank order (a
    collective over ``group``)."""
    import torch.distributed as dist

    from ..memory import STASH_POOL

    mine = (report.peak, report.activation_peak, report.owner_totals.get(STASH_POOL, 0))
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def rank_table(per_rank: list, fmt: str = "text") -> str:
    """The table of :func:`rank_figures`: MiB per rank."""
    from ..tables import Column, format_table

    mib = 2 ** 20
    rows = [(r, p / mib, a / mib, s / mib) for r, (p, a, s) in enumerate(per_rank)]
    return format_table([Column("rank", "d"), Column("peak MiB", ".1f"),
                         Column("activation peak MiB", ".1f"), Column("stash pool MiB", ".1f")],
                        rows, fmt, title="every rank")
