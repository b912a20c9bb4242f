"""The ranks of ``graphstash bench moe --ep N``: processes of a ``torch.distributed`` group
(under ``torchrun``, or N processes sharing one GPU over CUDA IPC) or threads of one process
(in-process transports; the bench runs them on the CPU only, NOTE [expert-parallel bench
launch] in ``moe_ep.py``), behind the few operations the bench's measuring loop needs: meet,
build the row's transport, combine figures, free the warmup's cache before a capture.

NOTE [in-process bench ranks]: ranks that are threads of one process share one device, its
caching allocator and its autograd device thread (NOTE [in-process ranks] in
``graphstash/moe/exchange/local.py``). A rank's replay, or its eager exchange, waits on the
device for the other ranks' kernels, which only their threads launch; so no thread may wait
for the whole device (``torch.cuda.synchronize``, ``torch.cuda.empty_cache``, which frees with
``cudaFree``) while another rank's work can still be waiting on it, and no thread may empty the
cache while another's capture is under way (the allocator refuses). ``graph_step`` does both
before a capture (NOTE [capture memory]), so the steps run with
``release_warmup_cache=False`` and the bench does it for them, once, where it is safe: at a
barrier every rank reaches after its warmup calls returned (each call returns after its own
work finished, so what the others still run waits on nothing un-launched), one thread
synchronizes, frees the cache and resets the peak statistics, and then every rank captures
(the captures run side by side, each on its own stream, in thread-local capture mode; each
rank's first replay waits on the device for the others'). The same holds when a step reruns
and the next call recaptures: nothing device-wide runs there. The figures and the release of
a row also wait for a barrier first. Every rank builds its row, and its step allocates its
page-locked flag buffer, before a barrier that precedes any exchange (CUDA lists page-locked
allocations among the calls it may order against running work). Memory statistics are the
device's: the bench reports them divided by the ranks. All of this holds only while nothing
else in the process waits for the whole device (the allocator freeing memory does): measured
on an H200, thread ranks stalled at an early barrier when the GPU was shared with other test
processes, so the command no longer offers them on a GPU; the code above serves the CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import tempfile
import threading
import traceback

import torch

EXCHANGE_TIMEOUT_S = 120.0      # a first step at real widths, or ranks time-slicing one GPU


class RankError(RuntimeError):
    """A rank of the bench failed; the message carries that rank's own error."""


class ProcessRanks:
    """One process of a ``torch.distributed`` group.

    Args:
        group: the process group of the expert-parallel ranks.
        device: this rank's CUDA device.
        launch: ``"torchrun"`` (one process per GPU, NCCL) or ``"processes"`` (processes
            sharing one GPU, gloo; the peers' collectives cannot run there).
        transport: the kind :func:`graphstash.moe.exchange.build_transport` builds
            (``"auto"``, ``"symmetric"``, ``"ipc"``, or ``"gloo"`` on the CPU).
    """

    memory_shared = False           # torch's memory statistics are this process's own
    release_warmup_cache = True     # graph_step frees the warmup's cache before its capture

    def __init__(self, group, device: torch.device, *, launch: str, transport: str,
                 ranks_per_device: int = 1, timeout_s: float = EXCHANGE_TIMEOUT_S):
        import torch.distributed as dist

        self.group = group
        self.device = device
        self.launch = launch
        self.transport_kind = transport
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ranks_per_device = ranks_per_device
        self.timeout_s = timeout_s
        self.leader = True              # device-wide actions: each process owns its own
        self.peer_group = group if launch == "torchrun" else None
        self._on_device = dist.get_backend(group) == "nccl"

    def sync(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def make_transport(self, sizes: dict):
        """This rank's transport of ``sizes`` (``capacity_rows``, ``row_bytes``,
        ``max_experts``); a collective."""
        from ...moe.exchange import build_transport

        return build_transport(self.group, kind=self.transport_kind, device=self.device,
                               timeout_s=self.timeout_s, **sizes)

    def _reduce(self, values, op):
        import torch.distributed as dist

        where = self.device if self._on_device else "cpu"
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=where)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def largest(self, values: list) -> list:
        """Each of ``values`` (floats) as its largest over the ranks."""
        import torch.distributed as dist

        return self._reduce(values, dist.ReduceOp.MAX)

    def smallest(self, values: list) -> list:
        import torch.distributed as dist

        return self._reduce(values, dist.ReduceOp.MIN)

    def device_total(self, value: float) -> float:
        """``value`` summed over the ranks whose memory statistics are shared (here: its own)."""
        return value

    def before_capture(self) -> None:
        """Reset the peak statistics (NOTE [steady-state peak] in ``moe.py``); graph_step
        frees the warmup's cache itself."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


@dataclasses.dataclass
class _Shared:
    world_size: int
    device: torch.device
    barrier: threading.Barrier
    timeout_s: float
    slots: list = dataclasses.field(default_factory=list)
    transports: list = dataclasses.field(default_factory=list)


class ThreadRanks:
    """One rank of ``world_size`` threads of this process on one GPU (NOTE [in-process bench
    ranks]); made by :func:`run_threads`."""

    launch = "threads"
    memory_shared = True            # the device's statistics: every rank's together
    release_warmup_cache = False    # NOTE [in-process bench ranks]
    peer_group = None
    transport_kind = "local"

    def __init__(self, rank: int, shared: _Shared):
        self.rank = rank
        self.world_size = shared.world_size
        self.ranks_per_device = shared.world_size
        self.device = shared.device
        self.leader = rank == 0
        self._shared = shared

    def sync(self) -> None:
        self._shared.barrier.wait()

    def make_transport(self, sizes: dict):
        from ...moe.exchange import build_local_transports

        self.sync()
        if self.leader:
            self._shared.transports = build_local_transports(
                self.world_size, device=self.device, timeout_s=self._shared.timeout_s, **sizes)
        self.sync()
        mine = self._shared.transports[self.rank]
        self.sync()
        if self.leader:
            self._shared.transports = []      # each rank holds its own; the row frees them
        return mine

    def _combine(self, values: list, fn) -> list:
        self.sync()
        if self.leader:
            self._shared.slots = [None] * self.world_size
        self.sync()
        self._shared.slots[self.rank] = [float(v) for v in values]
        self.sync()
        out = [fn(column) for column in zip(*self._shared.slots)]
        self.sync()
        return out

    def largest(self, values: list) -> list:
        return self._combine(values, max)

    def smallest(self, values: list) -> list:
        return self._combine(values, min)

    def device_total(self, value: float) -> float:
        return self._combine([value], sum)[0]

    def before_capture(self) -> None:
        """At a barrier every rank reaches with its warmup calls returned: one thread waits for
        the device, frees the warmup's cache and resets the peak statistics (NOTE [in-process
        bench ranks])."""
        self.sync()
        if self.leader:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sync()


def run_threads(world_size: int, device: torch.device, fn, *args,
                timeout_s: float = EXCHANGE_TIMEOUT_S) -> list:
    """``fn(ranks, *args)`` on ``world_size`` threads, one :class:`ThreadRanks` and one CUDA
    stream each; returns what each returned, or raises :class:`RankError` with the first
    failing rank's own error (the others' broken barriers are its consequence)."""
    shared = _Shared(world_size, device, threading.Barrier(world_size), timeout_s)
    results, errors = [None] * world_size, [None] * world_size

    def main(rank: int) -> None:
        try:
            with contextlib.ExitStack() as scope:
                if device.type == "cuda":          # the CPU: the coordination alone (tests)
                    scope.enter_context(torch.cuda.device(device))
                    scope.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
                results[rank] = fn(ThreadRanks(rank, shared), *args)
        except BaseException as exc:           # reported below, with the rank
            errors[rank] = exc
            shared.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,), name=f"ep-rank-{r}")
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    first = [(r, e) for r, e in failed if not isinstance(e, threading.BrokenBarrierError)]
    if failed:
        rank, exc = (first or failed)[0]
        raise RankError(f"rank {rank} of {world_size} (a thread) failed: "
                        f"{type(exc).__name__}: {exc}") from exc
    return results


def _process_main(rank: int, world_size: int, device_index: int, tmp: str, fn, args) -> None:
    path = os.path.join(tmp, f"rank{rank}.json")
    try:
        import torch.distributed as dist

        torch.cuda.set_device(device_index)
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
        try:
            ranks = ProcessRanks(dist.group.WORLD, torch.device("cuda", device_index),
                                 launch="processes", transport="ipc",
                                 ranks_per_device=world_size)
            result = fn(ranks, *args)
        finally:
            dist.destroy_process_group()
        with open(path, "w") as f:
            json.dump({"ok": result}, f)
    except BaseException:
        with open(path, "w") as f:
            json.dump({"error": traceback.format_exc()}, f)
        os._exit(1)


def spawn_processes(world_size: int, device_index: int, fn, *args) -> list:
    """``fn(ranks, *args)`` in ``world_size`` spawned processes sharing GPU ``device_index``
    (a gloo group through a file store; the transport is CUDA IPC); ``fn`` must be a
    module-level function and return JSON-able values. Returns each rank's value, or raises
    :class:`RankError` with the text of every rank that failed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_process_main,
                             args=(r, world_size, device_index, tmp, fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        results, failures = [], []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                failures.append(f"rank {r} wrote no result (exit code {p.exitcode})")
                continue
            with open(path) as f:
                got = json.load(f)
            if "error" in got:
                failures.append(f"rank {r} failed:\n{got['error']}")
            else:
                results.append(got["ok"])
        if failures:
            raise RankError("\n".join(failures))
        return results
