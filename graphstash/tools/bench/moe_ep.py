"""``graphstash bench moe --ep N``: expert parallelism over N ranks, the live-row exchange
next to the designs a user would run instead, in one run, from the same initialisation and
routing.

Launch (NOTE [expert-parallel bench launch]):

- under ``torchrun --nproc-per-node N -m graphstash.tools.cli bench moe --ep N``: one
  process per GPU, NCCL for the peers, the live rows over ``--transport`` (``auto``: torch
  symmetric memory on the GPUs of one host; ``symmetric``, ``ipc``, or ``nccl`` for no
  live-row transport at all);
- on one GPU, ``--transport ipc`` (the default there): N processes sharing the GPU through
  CUDA IPC. Correct but slow: processes take turns on the GPU, so every barrier waits for a
  time slice (docs/exchange.md); the table says so;
- on the CPU (``--device cpu`` or no GPU), ``--transport gloo`` (the default there): N
  processes over gloo, every row eagerly (a smoke run of the loop), or ``--transport local``:
  N ranks as threads of this process, the coordination alone (the tests). Not on a GPU (NOTE
  [expert-parallel bench launch] says why).

Rows (NOTE [expert-parallel bench rows] in ``ep_rows.py``): ``eager peer`` (plain-PyTorch
dropless MoE, ``all_to_all_single`` with split sizes read back every layer; NCCL ranks only),
``nccl chunks`` (graphstash's budget dispatch over NCCL's fixed chunks under ``graph_step``;
NCCL ranks only), ``worst-case buffers`` (the live-row exchange with receive room for every row
any rank could send and a budget of that size, torchtitan's graphable design), ``live rows``,
``live rows + stash`` and ``live rows + resend`` (under ``graph_step``; the last pushes the
rows again in backward instead of keeping them, NOTE [resent rows]), and ``no exchange`` (each rank's own experts on
its own tokens, nothing sent: the baseline of what the exchange costs, balanced routing only;
NOTE [no-exchange row]). The presets at 8192 tokens per rank,
``--capacity-factor`` (default 2.0), as many layers as fit (up to 16) unless ``--layers``,
bf16.

Columns: step time (median of CUDA-event samples of whole decorated calls), its ratio to the
eager peer, to the worst-case row and to the no-exchange row, the peak memory over the capture
and the timed steps and the activation peak (that peak less parameters, gradients and
optimizer state), the bytes each rank writes into other ranks per step (device counters of the
transport over the timed steps; for the peers, what their collectives send, from the split
sizes, over the warmup steps) and their ratio to the eager peer's, the counts/flags/signals
bytes, and the steps flagged over budget, overflowed and rerun (all calls of the row;
dropless or by capture, NOTE [rerun by capture] in ``graphstash/graph/_step.py``:
``"dropless_reruns"`` in the JSON are the first).
Figures are the largest over the ranks.
Under the table, on CUDA: which call set each row's peak, and whether it was a rerun, a
capture or a replay (NOTE [peak call] in ``peak_call.py``; ``"peak_call"`` in the JSON).
``--profile``: each rank profiles a few calls of each row after the timed ones and rank 0
prints, per row and rank, the kernel time per step and its shares in the exchange (the
live-row kernels ``gs_xchg_*``, NCCL's), grouped GEMMs, other GEMMs, the optimizer and the rest
(:mod:`~graphstash.tools.bench.kernel_share`; CUDA only). Rank 0 prints each row as soon as it
is measured and shows the progress on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import os
import statistics
import time

import torch

from ...memory import static_footprint
from ...models import PRESETS, MoEConfig
from ...stash.config import PREFETCH_POINTS
from ...tables import Column
from .. import options, progress, training
from ..output import Output
from . import moe_setup
from .moe_setup import DEFAULT_PREFETCH
from .ep_rows import (BUILDS_OWN, LOCAL_ROWS, PEER_ROWS, ROWS, TRANSPORT_ROWS, build_row,
                      transport_bytes, transport_sizes, unavailable)
from .kernel_share import EXCHANGE_KERNELS, GROUPS, profile_steps
from .peak_call import PeakCalls, describe, highest
from .spread import range_text, spread
from .timing import event_ms

TRANSPORTS = ("auto", "ipc", "gloo", "local", "symmetric", "nccl")
DEFAULT_CAPACITY_FACTOR = 2.0
LAYERS_CAP = 16
DTYPE = torch.bfloat16
BATCHES = 4
MIB = 2.0 ** 20
PROFILE_STEPS = 3   # calls torch.profiler records per row and rank under --profile

# NOTE [expert-parallel bench launch]: where the N ranks come from decides which rows can
# run. Under torchrun (WORLD_SIZE > 1) every process is a rank on its own GPU: NCCL runs the
# peers, and the live rows take the transport --transport names (symmetric memory by default).
# Without it the N ranks share this process's GPU, where NCCL refuses to run ("Duplicate GPU
# detected"), so the peers are reported as not available: as N spawned processes over CUDA
# IPC (--transport ipc, the default on a GPU), whose barriers wait for the GPU's time slices.
# On the CPU (--device cpu, or no GPU) the ranks are N spawned processes over gloo (--transport
# gloo, the default there: every row, peers included, eagerly: a smoke run of the whole loop)
# or threads of this process (--transport local, NOTE [in-process bench ranks] in
# ep_ranks.py: the coordination the tests check; in-process transports need a GPU, so the
# live-row rows are not available there). Threads are not offered on a GPU:
# each rank's exchange kernels wait on the device for the other ranks' signals, so anything in
# one thread that waits for the whole device (a synchronize, the allocator freeing memory)
# stalls every rank until the transport's timeout. Measured on an H200: the thread ranks ran
# alone, and stalled at an early barrier (rank 1 did not signal within 120 s) in two full
# test-suite runs that shared the GPU with other test processes. Processes have a CUDA context
# each, so one's device-wide wait does not wait on another's kernels. --transport symmetric and
# nccl need one process per GPU, --transport local needs one process on the CPU: the other
# combinations are refused before anything runs.


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the ranks run: ``kind`` ``"torchrun"``, ``"processes"`` or ``"threads"`` (NOTE
    [expert-parallel bench launch]), ``world_size`` ranks, ``transport`` the live rows' kind
    (``--transport``; ``"local"`` for threads, ``"ipc"`` for processes sharing a GPU,
    ``"gloo"`` for processes on the CPU)."""
    kind: str
    world_size: int
    transport: str

    def describe(self) -> str:
        n = self.world_size
        if self.kind == "torchrun":
            return (f"{n} processes under torchrun, the peers over the process group, live "
                    f"rows over transport {self.transport}")
        if self.kind == "threads":
            return f"{n} threads of one process on one GPU, in-process transports"
        if self.transport == "gloo":
            return f"{n} processes on the CPU over gloo (eager)"
        return f"{n} processes sharing one GPU over CUDA IPC"


def add_arguments(group) -> None:
    """``--ep`` and ``--transport`` on the MoE suite's argument group."""
    group.add_argument("--ep", type=int, default=None, metavar="N",
                       help="expert parallelism over N ranks: the live-row exchange against "
                       "the eager peer, NCCL chunks and worst-case buffers (under torchrun N "
                       "is WORLD_SIZE; on one GPU the ranks are processes)")
    group.add_argument("--stash-prefetch", choices=PREFETCH_POINTS, default=DEFAULT_PREFETCH,
                       help="with --ep: when the live rows + stash row issues a group's reload "
                       f"(StashConfig.prefetch; default {DEFAULT_PREFETCH})")
    group.add_argument("--overlap-sms", type=int, default=None, metavar="N",
                       help="with --ep: multiprocessors the live rows' backward pushes take "
                       "beside the expert GEMMs (MoEConfig.overlap_sms; 0: none; default: the "
                       "exchange's)")
    group.add_argument("--transport", choices=TRANSPORTS, default=None,
                       help="the live rows' transport with --ep: auto (torchrun: symmetric "
                       "memory; one GPU: ipc; the CPU: gloo), ipc (ranks as processes sharing a "
                       "GPU: correct, slow), gloo (ranks as processes on the CPU: the loop, "
                       "eagerly), local (ranks as threads of one process; the CPU only), "
                       "symmetric, nccl (no live-row transport)")


def requested(args) -> bool:
    """Whether the command line asks for the expert-parallel bench (``--ep`` or
    ``--transport``)."""
    return (getattr(args, "ep", None) is not None
            or getattr(args, "transport", None) is not None)


def _world_size_from(environ) -> int:
    text = environ.get("WORLD_SIZE")
    if text is None:
        return 1
    try:
        world = int(text)
    except ValueError:
        raise options.FlagError(f"--ep: the launcher's WORLD_SIZE must be an int, got "
                                f"{text!r}") from None
    if world < 1:
        raise options.FlagError(f"--ep: the launcher's WORLD_SIZE must be >= 1, got {world}")
    return world


def launch_from_args(args, environ=None) -> Launch:
    """The :class:`Launch` the command line and the environment (``WORLD_SIZE``) ask for;
    :class:`~graphstash.tools.options.FlagError` naming the flag for a combination that cannot
    run (NOTE [expert-parallel bench launch])."""
    environ = os.environ if environ is None else environ
    ep = options.positive_int("--ep", getattr(args, "ep", None), minimum=2)
    transport = getattr(args, "transport", None) or "auto"
    if transport not in TRANSPORTS:
        raise options.FlagError(f"--transport: expected one of {', '.join(TRANSPORTS)}, got "
                                f"{transport!r}")
    world = _world_size_from(environ)
    if world > 1:
        if ep is not None and ep != world:
            raise options.FlagError(f"--ep: expected the launcher's WORLD_SIZE={world} (one "
                                    f"rank per process), got {ep}")
        if transport in ("local", "gloo"):
            raise options.FlagError(
                f"--transport: {transport!r} runs the ranks itself (threads of one process, or "
                f"processes on the CPU); under torchrun (WORLD_SIZE={world}) every process is "
                f"a rank: use auto, symmetric, ipc or nccl")
        if getattr(args, "device", "auto") == "cpu" or not torch.cuda.is_available():
            why = ("--device cpu asks for none" if getattr(args, "device", "auto") == "cpu"
                   else "torch sees none")
            raise options.FlagError(
                f"--device: under torchrun (WORLD_SIZE={world}) every process is a rank on its "
                f"own CUDA GPU, and {why}; on the CPU run it without torchrun: graphstash bench "
                f"moe --ep {world} --device cpu (the ranks as gloo processes)")
        return Launch("torchrun", world, transport)
    if ep is None:
        raise options.FlagError("--ep: expected the number of expert-parallel ranks (an int "
                                ">= 2) with --transport, got none (or launch under torchrun)")
    if transport in ("symmetric", "nccl"):
        raise options.FlagError(
            f"--transport: {transport!r} needs one process per GPU: launch with torchrun "
            f"--nproc-per-node {ep} -m graphstash.tools.cli bench moe --ep {ep}; on one GPU "
            f"use 'local' (ranks as threads) or 'ipc' (ranks as processes)")
    on_gpu = torch.cuda.is_available() and getattr(args, "device", "auto") != "cpu"
    if transport == "local" and on_gpu:
        raise options.FlagError(
            "--transport: 'local' (ranks as threads of one process) is not offered on a GPU "
            "(NOTE [expert-parallel bench launch]): a device-wide wait in one rank's thread "
            "stalls the other ranks' exchange kernels; use 'ipc' (ranks as processes sharing "
            "the GPU) or torchrun")
    if transport == "gloo" and on_gpu:
        raise options.FlagError("--transport: 'gloo' runs the ranks as processes on the CPU "
                                "(--device cpu); on a GPU use 'ipc' or torchrun")
    if transport == "ipc" and not on_gpu:
        raise options.FlagError("--transport: 'ipc' runs the ranks as processes sharing one "
                                "GPU, and none is in use; on the CPU use 'gloo' (the default "
                                "there) or 'local'")
    if transport == "ipc" or (transport == "auto" and on_gpu):
        return Launch("processes", ep, "ipc")
    if transport in ("gloo", "auto"):
        return Launch("processes", ep, "gloo")
    return Launch("threads", ep, "local")


def configs_from_args(args, quick: bool, *, notes: bool = True) -> dict:
    """``{name: MoEConfig}`` the expert-parallel bench runs: the presets (or ``--preset``, or a
    custom shape, or with ``--quick`` the small configurations), at ``--capacity-factor``
    (default 2.0), NCCL chunks of the same factor. ``layers`` is each preset's own until
    :func:`fit_layers` decides (unless ``--layers``). FlagError naming the flag for bad values,
    and ``--ep`` when the experts do not split over the ranks."""
    launch = launch_from_args(args)
    plain = argparse.Namespace(**{**vars(args), "ep": None, "transport": None})
    chosen = moe_setup.configs_from_args(plain, quick, notes=notes)  # every shape flag checked
    custom = "custom" in chosen
    preset = getattr(args, "preset", None)
    factor = getattr(args, "capacity_factor", None) or DEFAULT_CAPACITY_FACTOR
    over = {"capacity_factor": factor, "chunk_factor": factor,
            "routing": moe_setup.routing_from_args(args)}
    overlap = getattr(args, "overlap_sms", None)
    if overlap is not None:
        if overlap < 0:
            raise options.FlagError(f"--overlap-sms: expected 0 (no overlap) or more "
                                    f"multiprocessors, got {overlap}")
        over["overlap_sms"] = overlap
    if quick and preset is None and not custom:
        for name in ("layers", "tokens"):
            value = getattr(args, name, None)
            if value is not None:
                over["num_tokens" if name == "tokens" else "layers"] = value
        chosen = dict(moe_setup.QUICK)
    elif preset is None and not custom:
        chosen = {n: c for n, c in chosen.items() if n in PRESETS}
    out = {n: dataclasses.replace(c, **over) for n, c in chosen.items()}
    W = launch.world_size
    for name, c in out.items():
        if c.num_experts % W == 0:
            continue
        if custom:
            raise options.FlagError(f"--experts: expected a multiple of the {W} ranks, got "
                                    f"{c.num_experts}")
        raise options.FlagError(f"--ep: expected ranks that split the experts evenly "
                                f"({name} has {c.num_experts}), got {W}")
    return out


def rows_from_args(args) -> tuple:
    """The rows ``--modes`` names (default: every row of :data:`ROWS`)."""
    return options.names("--modes", getattr(args, "modes", None), ROWS, context=" with --ep")


def fit_layers(config: MoEConfig, world_size: int, ranks_per_device: int, free_bytes: int,
               rows=ROWS) -> int:
    """As many layers as fit (1 to :data:`LAYERS_CAP`) for the most demanding of ``rows``, with
    ``ranks_per_device`` ranks sharing ``free_bytes`` of one device: per layer, bf16
    parameters, gradients twice (the warmup's, then the graph's) and two AdamW moments, plus
    twice the activations the largest budget keeps (``W x T x K`` rows for the worst-case row);
    besides, the largest receive region."""
    E_local = config.num_experts // world_size
    w_rows = (3 if config.gated else 2) * config.ffn
    params = E_local * w_rows * config.hidden + config.num_experts * config.hidden
    factor = max(1.0, config.capacity_factor)
    if "worst-case buffers" in rows:
        factor = max(factor, float(world_size))
    kept_rows = math.ceil(factor * config.num_tokens * config.topk)
    acts = kept_rows * (2 * config.hidden + 4 * config.ffn) + 4 * config.num_tokens * config.hidden
    per_layer = 2 * (5 * params + 2 * acts)
    region = kept_rows * (2 * config.hidden + 8) if set(rows) & set(TRANSPORT_ROWS) else 0
    usable = 0.8 * free_bytes / ranks_per_device - region
    return max(1, min(LAYERS_CAP, int(usable // per_layer)))


@dataclasses.dataclass
class Plan:
    """What every rank runs: the configurations (``fit``: the names whose layers
    :func:`fit_layers` decides), the rows, the timed steps, the launch; ``stash``: the
    ``StashConfig`` of ``live rows + stash`` (None: :func:`graphstash.tools.bench.moe_setup.
    stash_config`, the one-GPU bench's); ``profile``: also profile :data:`PROFILE_STEPS` calls
    of each row on every rank (``--profile``; CUDA kernels); ``stash_prefetch``: that
    config's ``prefetch`` (``--stash-prefetch``) when ``stash`` is None."""
    launch: Launch
    configs: dict
    rows: tuple
    steps: int
    fit: tuple
    stash: object = None
    profile: bool = False
    stash_prefetch: str = DEFAULT_PREFETCH


# NOTE [bench rows on the CPU]: the bench measures GPUs, but its measuring loop also runs on
# the CPU, eagerly, with host timers and no memory statistics (zeros): over two gloo ranks
# (tests/test_bench_ep_rows.py runs the whole loop, collectives, transports, byte counts and
# table included) and, from the command line (``graphstash bench moe --ep 2 --device cpu``),
# over ranks that are threads of one process with in-process transports: a smoke run of the
# loop, not a measurement.
def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device, peak: bool = False) -> int:
    if device.type != "cuda":
        return 0
    return (torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated)(device)


def _time_ms(device: torch.device, fn) -> float:
    if device.type == "cuda":
        return event_ms(fn, 1)
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def prepare(device: torch.device) -> None:
    """Compile graphstash's kernels and settle the expert GEMMs before any rank's first step
    (a rank that compiles while another waits in an exchange could reach its timeout)."""
    import graphstash
    from ...moe import prepare_experts

    graphstash.warmup(device)
    prepare_experts(device, DTYPE)


def measure_row(row: str, config: MoEConfig, ranks, batches: list, steps: int, *,
                stash=None, profile: bool = False, on_call=None,
                stash_prefetch: str = DEFAULT_PREFETCH) -> dict:
    """Build ``row`` on this rank (``ranks``: :mod:`~graphstash.tools.bench.ep_ranks`), warm
    it up, capture, time ``steps`` calls on ``batches`` (:func:`graphstash.tools.training.
    batches`, this rank's) and return the figures the module docstring lists, each the largest
    over the ranks, with ``step_ms_spread`` (each of its figures the largest over the ranks)
    beside the median ``step_ms``. ``stash``: the ``StashConfig`` of ``live rows + stash``
    (default: :func:`graphstash.tools.bench.moe_setup.stash_config` with ``stash_prefetch``);
    ``profile``: add ``"kernels"``, every rank's :func:`~graphstash.tools.bench.kernel_share.profile_steps` of
    :data:`PROFILE_STEPS` calls after the timed ones, in rank order; ``on_call``: called
    without arguments after each call (outside the timed region). A collective."""
    tick = on_call if on_call is not None else (lambda: None)
    device, W = ranks.device, ranks.world_size
    ranks.sync()
    if ranks.leader:
        gc.collect()                   # the previous row's graph, model and transport
        _wait(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ranks.sync()
    base = _allocated(device)
    ranks.sync()                       # in-process: every rank read it before any allocates
    transport = None
    # README's path where the ranks have a group and the transport is chosen automatically:
    # the model builds its exchange, and builds it again when a budget outgrows it
    builds_own = (row in BUILDS_OWN and ranks.peer_group is not None
                  and ranks.transport_kind == "auto")
    if row in TRANSPORT_ROWS and not builds_own:
        try:
            transport = ranks.make_transport(transport_sizes(row, config, W, DTYPE))
        except ValueError as exc:      # no transport by peer addresses here (the same on all)
            return {"error": f"not available: {exc}"}
    if row == "live rows + stash" and stash is None:
        stash = moe_setup.stash_config(device, stash_prefetch)
    run = build_row(row, config, device, DTYPE, world_size=W, group=ranks.peer_group,
                    transport=transport, stash=stash,
                    release_warmup_cache=ranks.release_warmup_cache)
    if run.graph is not None:
        # reading the stash manager sets the step up (its pinned flag buffer, its streams):
        # here, before any rank waits in an exchange (NOTE [in-process bench ranks])
        run.stash_manager
    ranks.sync()
    warmup = training.WARMUP
    with moe_setup.count_exchange(ranks.peer_group if row in PEER_ROWS else None) as sent:
        for i in range(warmup):
            run.step(*batches[i % len(batches)])
            tick()
    ranks.before_capture()             # NOTE [steady-state peak] in moe.py
    peak_calls = PeakCalls(device, run.graph)            # NOTE [peak call]
    run.step(*batches[warmup % len(batches)])            # graphed rows: the capture
    tick()
    peak_calls.after_call()
    if builds_own:
        transport = run.model.exchange
    before = transport.counters() if transport is not None else None
    samples = []
    for i in range(steps):
        batch = batches[(warmup + 1 + i) % len(batches)]
        samples.append(_time_ms(device, functools.partial(run.step, *batch)))
        tick()
        peak_calls.after_call()
    after = transport.counters() if transport is not None else None
    if builds_own and run.model.exchange is not transport:     # rebuilt while timed
        before = after = None
    kernels = None
    if profile:                        # every rank, in step: the exchange waits for the peers
        ranks.sync()
        step, calls = run.step, iter(range(1 << 62))
        kernels = ranks.gather(profile_steps(
            lambda: step(*batches[next(calls) % len(batches)]), PROFILE_STEPS))
        step = None                    # the row's model is freed below
    peak_call = highest(ranks.gather(peak_calls.best()))
    ranks.sync()
    peak = _allocated(device, peak=True) - base
    static = ranks.device_total(static_footprint(run.model, run.optimizer, device=device))
    share = W if ranks.memory_shared else 1
    stats = run.graph.stats if run.graph is not None else None
    plan = run.stash_manager.plan() if row == "live rows + stash" else []
    stashed = sum(r["stashed"] for r in plan)     # each rank plans from its own step
    budgets = run.model.budgets
    budgets = budgets.factor_range() if budgets is not None else None
    if transport is not None and before is not None:
        moved = transport_bytes(before, after, steps)
        counted = "device counters, timed steps"
    elif transport is not None:
        moved = {"sent": float("nan"), "local": float("nan"), "meta": float("nan")}
        counted = "not counted: the exchange was rebuilt during the timed steps"
    elif row in LOCAL_ROWS:
        moved = {"sent": 0.0, "local": 0.0, "meta": 0.0}
        counted = "nothing leaves the rank"
    else:
        moved = {"sent": sent[0] / warmup, "local": 0.0, "meta": 0.0}
        counted = "collective sizes, warmup steps"
    exchange = run.model.exchange_kind
    calls = warmup + 1 + steps + (PROFILE_STEPS if profile else 0)
    ranks.sync()
    run.release()
    if transport is not None:
        transport.close()
    del run, transport
    s = spread(samples)
    figures = ranks.largest([
        statistics.median(samples), peak / share / MIB, (peak - static) / share / MIB,
        moved["sent"] / MIB, moved["local"] / MIB, moved["meta"] / 1024,
        stats.over_budget if stats else 0, stats.overflows if stats else 0,
        stats.reruns if stats else 0, s["min"], s["q1"], s["q3"], s["max"],
        moe_setup.recaptures(stats, device), stashed, -stashed,   # -: the fewest
        stats.eager_reruns if stats else 0])
    (step_ms, peak_mib, act_mib, sent_mib, local_mib, meta_kib, over_budget, overflow,
     reruns) = figures[:9]
    if device.type != "cuda":          # no memory statistics on the CPU
        peak_mib = act_mib = None
    s.update(median=step_ms, min=figures[9], q1=figures[10], q3=figures[11], max=figures[12])
    return {"step_ms": step_ms, "step_ms_spread": s, "peak_mib": peak_mib,
            "activation_peak_mib": act_mib, "sent_mib": sent_mib, "local_mib": local_mib,
            "meta_kib": meta_kib, "bytes_counted": counted, "exchange": exchange,
            "over_budget": int(over_budget), "overflow": int(overflow), "reruns": int(reruns),
            "dropless_reruns": int(figures[16]), "recaptures": int(figures[13]),
            "budgets": budgets, "calls": calls, "stashed_groups": int(figures[14]),
            "stashed_groups_min": int(-figures[15]), "groups": len(plan), "kernels": kernels,
            "peak_call": peak_call}


def add_ratios(results: dict) -> None:
    """Each measured row's ratios to the eager peer (step time, bytes sent), to the
    worst-case row and to the no-exchange row (step time: NOTE [no-exchange row] in
    ``ep_rows.py``), where those rows ran."""
    peer = results.get("eager peer", {})
    worst = results.get("worst-case buffers", {})
    local = results.get("no exchange", {})
    for r in results.values():
        if "step_ms" not in r:
            continue
        r["vs_eager_peer"] = r["step_ms"] / peer["step_ms"] if "step_ms" in peer else None
        r["vs_worst_case"] = r["step_ms"] / worst["step_ms"] if "step_ms" in worst else None
        r["vs_no_exchange"] = r["step_ms"] / local["step_ms"] if "step_ms" in local else None
        r["sent_vs_eager_peer"] = (r["sent_mib"] / peer["sent_mib"]
                                   if peer.get("sent_mib") else None)


COLUMNS = (Column("row", width=18), Column("step ms", ".2f", width=8),
           Column("min-max ms", width=13, align="right"), Column("/peer", ".3f", width=6),
           Column("/worst", ".3f", width=6), Column("/no exch", ".3f", width=8),
           Column("peak MiB", ".0f", width=8),
           Column("act MiB", ".0f", width=7), Column("sent MiB", ".1f", width=8),
           Column("/peer", ".3f", width=6), Column("meta KiB", ".1f", width=8),
           Column("flags (over budget, overflow, reruns, recaptures)"),
           Column("budgets"))
PROFILE_COLUMNS = (Column("row", width=18), Column("rank", width=4, align="right"),
                   Column("kernel ms", ".2f", width=9), Column("kernels", ".0f", width=7)) + \
    tuple(Column(g, width=max(6, len(g)), align="right") for g in GROUPS)


def title(name: str, entry: dict) -> str:
    """The line above a configuration's table (``entry`` as :func:`run_rank` returns it)."""
    c, ep = entry["config"], entry["ep"]
    return (f"MoE expert parallel {name}: {c['layers']} layers, hidden {c['hidden']}, ffn "
            f"{c['ffn']}{' (gated)' if c['gated'] else ''}, {c['num_experts']} experts top-"
            f"{c['topk']}, {c['num_tokens']} tokens/rank, capacity factor "
            f"{c['capacity_factor']}, routing {c.get('routing', 'balanced')}, "
            f"overlap SMs {_overlap(c.get('overlap_sms'))}, EP={ep['world_size']} as {ep['launch']}, bf16, {ep['gpu']}")


def _overlap(sms) -> str:
    return "default" if sms is None else str(sms)


def table_row(row: str, r: dict) -> list:
    """The values of ``row``'s line in the table (``r``: its figures, ratios where known)."""
    low = r.get("stashed_groups_min", r["stashed_groups"])
    most = r["stashed_groups"] if low == r["stashed_groups"] else f"{low}-{r['stashed_groups']}"
    stashed = (f"; stashed {most}/{r['groups']} groups" if r["groups"] else "")
    return [row, r["step_ms"], range_text(r.get("step_ms_spread")), r.get("vs_eager_peer"),
            r.get("vs_worst_case"), r.get("vs_no_exchange"), r["peak_mib"],
            r["activation_peak_mib"], r["sent_mib"], r.get("sent_vs_eager_peer"), r["meta_kib"],
            f"{r['over_budget']}, {r['overflow']}, {r['reruns']}, {r.get('recaptures', 0)} of "
            f"{r['calls']} calls{stashed}", r.get("budgets")]


def notes(entry: dict) -> list:
    """The lines under a configuration's table."""
    lines = ["figures: per rank, the largest over the ranks (min-max: the timed steps' range); "
             "sent: rows (and router weights) written into other ranks per step (transports: "
             "device counters over the timed steps; peers: their collectives' split sizes "
             "over the warmup steps); meta: counts, flags and signals"]
    peaks = [describe(row, r.get("peak_call")) for row, r in entry["results"].items()]
    if any(peaks):
        lines.append("peak set by (NOTE [peak call]): " + "; ".join(p for p in peaks if p))
    if entry["ep"]["kind"] == "threads":
        lines.append("in-process ranks share one device: peak and activation peak are the "
                     "device's divided by the ranks")
    if entry["ep"]["kind"] == "processes" and entry["ep"].get("transport") != "gloo":
        lines.append("ranks are processes taking turns on one GPU: every barrier waits for a "
                     "time slice, so these step times measure the time slicing, not the "
                     "exchange (docs/exchange.md); correct, not fast")
    return lines


def print_profile(out: Output, results: dict) -> None:
    """Each row's kernel time per step on each rank and its shares (``--profile``)."""
    rows = []
    for row, r in results.items():
        for rank, k in enumerate(r.get("kernels") or []):
            share = k["shares"] or {}
            rows.append([row, rank, k["kernel_ms_per_step"], k["kernels_per_step"]]
                        + [None if g not in share else f"{100 * share[g]:.1f}%"
                           for g in GROUPS])
    if not rows:
        return
    out.note(f"kernel time per step on each rank (torch.profiler, {PROFILE_STEPS} calls after "
             "the timed ones) and its shares")
    out.whole(PROFILE_COLUMNS, rows)
    out.note("shares of the rank's summed kernel time, kernels grouped by name "
             "(graphstash/tools/bench/kernel_share.py; exchange: gs_xchg_* and NCCL kernels)")
    for line in exchange_lines(results):
        out.note(line)


def exchange_lines(results: dict) -> list[str]:
    """One line per profiled row that ran exchange kernels: each kind's ms per step
    (:func:`~graphstash.tools.bench.kernel_share.exchange_kernel`), the largest over the
    ranks (``results``: rows as :func:`run_rank` gives them, with ``--profile``)."""
    lines = []
    for row, r in results.items():
        ranks = [k.get("exchange_ms") or {} for k in r.get("kernels") or []]
        kinds = [kind for kind in EXCHANGE_KERNELS if any(kind in e for e in ranks)]
        if kinds:
            parts = ", ".join(f"{kind} {max(e.get(kind, 0.0) for e in ranks):.2f}"
                              for kind in kinds)
            lines.append(f"{row}: exchange kernels, ms per step (the largest over the ranks; "
                         f"a barrier's time is mostly its wait for the peers): {parts}")
    return lines


def print_table(name: str, entry: dict, out: Output | None = None) -> None:
    """One configuration's rows at once (``entry`` as :func:`run_rank` returns it)."""
    out = Output() if out is None else out
    out.title(title(name, entry))
    table = out.table(COLUMNS)
    for row, r in entry["results"].items():
        if "error" in r:
            table.span(row, r["error"])
        else:
            table.row(table_row(row, r))
    for line in notes(entry):
        out.note(line)
    print_profile(out, entry["results"])
    out.end()


RATIOS = {"vs_eager_peer": "/peer", "vs_worst_case": "/worst", "vs_no_exchange": "/no exch",
          "sent_vs_eager_peer": "sent /peer"}       # figure -> its column


def run_rank(ranks, plan: Plan, out: Output | None = None) -> dict:
    """Every configuration and row of ``plan`` on this rank; rank 0 prints each row as soon as
    it is measured (its ratios once the rows they are taken against ran: rows measured before
    get theirs in a line under the table) and shows the progress. Returns ``{config:
    {"config", "ep", "results": {row: figures}}}`` (JSON-able)."""
    device = ranks.device
    on_gpu = device.type == "cuda"
    shown = ranks.rank == 0
    out = Output() if out is None and shown else out
    if plan.launch.kind != "threads" and on_gpu:
        prepare(device)
    ranks.sync()
    gpu = torch.cuda.get_device_name(device) if on_gpu else "the CPU"
    calls = training.WARMUP + 1 + plan.steps + (PROFILE_STEPS if plan.profile else 0)
    results_out = {}
    with progress.bar(len(plan.configs) * len(plan.rows), "bench moe --ep", unit="row",
                      show=shown) as overall, training.quiet_cpu_graph_step(on_gpu):
        for name, config in plan.configs.items():
            if name in plan.fit:
                ranks.sync()
                free, _ = torch.cuda.mem_get_info(device)
                fit = fit_layers(config, ranks.world_size, ranks.ranks_per_device, free,
                                 plan.rows)
                config = dataclasses.replace(config, layers=int(ranks.smallest([fit])[0]))
            batches = training.batches(config, BATCHES, seed=1234 + ranks.rank, device=device,
                                       dtype=DTYPE)
            entry = {"config": dataclasses.asdict(config),
                     "ep": {"world_size": ranks.world_size, "kind": plan.launch.kind,
                            "launch": plan.launch.describe(),
                            "transport": plan.launch.transport, "gpu": gpu},
                     "results": {}}
            results, pending = entry["results"], {}
            if shown:
                out.title(title(name, entry))
                table = out.table(COLUMNS)
            for row in plan.rows:
                why = unavailable(row, plan.launch.kind, plan.launch.transport, config,
                                  ranks.world_size)
                if why is not None:
                    results[row] = {"error": why}
                else:
                    with progress.bar(calls, f"{name}: {row}", show=shown) as bar:
                        results[row] = measure_row(row, config, ranks, batches, plan.steps,
                                                   stash=plan.stash, profile=plan.profile,
                                                   on_call=bar.update,
                                                   stash_prefetch=plan.stash_prefetch)
                overall.update()
                if not shown:
                    continue
                if "error" in results[row]:
                    table.span(row, results[row]["error"])
                    continue
                add_ratios(results)            # against the rows measured so far
                missing = [k for k in RATIOS if results[row].get(k) is None]
                if missing:
                    pending[row] = missing
                table.row(table_row(row, results[row]))
            add_ratios(results)
            if shown:
                late = {row: [k for k in keys if results[row].get(k) is not None]
                        for row, keys in pending.items()}
                late = {row: keys for row, keys in late.items() if keys}
                if late:
                    out.note("ratios of the rows measured before the rows they are taken "
                             "against: " + "; ".join(
                                 f"{row} " + ", ".join(f"{RATIOS[k]} {results[row][k]:.3f}"
                                                       for k in keys)
                                 for row, keys in late.items()))
                for line in notes(entry):
                    out.note(line)
                print_profile(out, results)
            results_out[name] = entry
            del batches
    if shown:
        out.end()
    return results_out


def run(quick: bool = False, args=None, *, device=None, out: Output | None = None) -> dict:
    """Run the expert-parallel bench the command line asks for (NOTE [expert-parallel bench
    launch]) on ``device`` (default: the current CUDA device; the CPU runs the ranks as
    threads); returns what rank 0's :func:`run_rank` returned. ``out``: where rank 0's tables
    go (ranks in other processes print plain text)."""
    from . import ep_ranks

    launch = launch_from_args(args)
    configs = configs_from_args(args, quick, notes=False)
    explicit_layers = getattr(args, "layers", None) is not None
    fit = () if quick or explicit_layers else tuple(configs)
    steps = getattr(args, "steps", None) or (5 if quick else 20)
    plan = Plan(launch, configs, rows_from_args(args), steps, fit,
                profile=bool(getattr(args, "profile", False)),
                stash_prefetch=getattr(args, "stash_prefetch", None) or DEFAULT_PREFETCH)
    if launch.kind == "torchrun":
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
        ranks = ep_ranks.ProcessRanks(dist.group.WORLD, device, launch="torchrun",
                                      transport=launch.transport)
        return run_rank(ranks, plan, out)
    if device is None:
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        device = torch.device("cuda", index)
    device = torch.device(device)
    if launch.kind == "threads":
        if device.type == "cuda":
            prepare(device)
        return ep_ranks.run_threads(launch.world_size, device, run_rank, plan, out)[0]
    fmt = out.fmt if out is not None else "text"
    meta = out.meta if out is not None else None
    index = device.index if device.type == "cuda" else None      # None: gloo on the CPU
    return ep_ranks.spawn_processes(launch.world_size, index, run_rank_printing, plan, fmt,
                                    meta)[0]


def run_rank_printing(ranks, plan: Plan, fmt: str, meta) -> dict:
    """:func:`run_rank` in a spawned process: rank 0 prints in ``fmt`` with ``meta``."""
    return run_rank(ranks, plan, Output(fmt, meta, source_first=False)
                    if ranks.rank == 0 else None)
