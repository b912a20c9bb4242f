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
import time
import traceback

import torch

EXCHANGE_TIMEOUT_S = 120.0      # a first step at real widths, or ranks time-slicing one GPU
COLLECTIVE_TIMEOUT_S = 600.0    # the spawned ranks' gloo group: a rank compiling its kernels


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
        # the peers' collectives: NCCL under torchrun, gloo on the CPU; none on a shared GPU
        self.peer_group = group if launch == "torchrun" or transport == "gloo" else None
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

    def gather(self, value) -> list:
        """Every rank's ``value`` (picklable), in rank order, on every rank; a collective."""
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

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
            try:
                self._shared.transports = build_local_transports(
                    self.world_size, device=self.device, timeout_s=self._shared.timeout_s,
                    **sizes)
            except ValueError as exc:         # refused here: refused for every rank
                self._shared.transports = exc
        self.sync()
        built = self._shared.transports
        mine = built if isinstance(built, ValueError) else built[self.rank]
        self.sync()
        if self.leader:
            self._shared.transports = []      # each rank holds its own; the row frees them
        if isinstance(mine, ValueError):
            raise ValueError(str(mine))
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

    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        self.sync()
        if self.leader:
            self._shared.slots = [None] * self.world_size
        self.sync()
        self._shared.slots[self.rank] = value
        self.sync()
        out = list(self._shared.slots)
        self.sync()
        return out

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


def _process_main(rank: int, world_size: int, device_index, tmp: str,
                  collective_timeout_s: float, fn, args) -> None:
    """One spawned rank (``torch.multiprocessing.start_processes`` passes ``rank`` first): a
    gloo group through a file store, ``fn(ranks, *args)``, its value written to
    ``<tmp>/rank<r>.json``. A failure is written to ``<tmp>/rank<r>.error.json`` with its time
    and whether it is a lost peer's consequence, then left to torch's starter."""
    import torch.distributed as dist

    try:
        on_gpu = device_index is not None
        if on_gpu:
            torch.cuda.set_device(device_index)
        else:       # the ranks share the cores: each spinning one thread per core, they crawl
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        try:
            device = torch.device("cuda", device_index) if on_gpu else torch.device("cpu")
            ranks = ProcessRanks(dist.group.WORLD, device, launch="processes",
                                 transport="ipc" if on_gpu else "gloo",
                                 ranks_per_device=world_size)
            result = fn(ranks, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        with open(os.path.join(tmp, f"rank{rank}.error.json"), "w") as f:
            json.dump({"time_ns": time.time_ns(), "text": traceback.format_exc(),
                       "consequence": isinstance(exc, getattr(dist, "DistError", ()))}, f)
        raise
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def first_failure(tmp: str, world_size: int):
    """``(rank, traceback)`` of the failure that came first among the ranks' error files in
    ``tmp`` (a failure of the collectives, the consequence of a lost peer, only where there is
    no other), or None."""
    found = []
    for rank in range(world_size):
        path = os.path.join(tmp, f"rank{rank}.error.json")
        if os.path.exists(path):
            with open(path) as f:
                got = json.load(f)
            found.append((got["consequence"], got["time_ns"], rank, got["text"]))
    if not found:
        return None
    _, _, rank, text = min(found)
    return rank, text


def spawn_processes(world_size: int, device_index, fn, *args,
                    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> list:
    """``fn(ranks, *args)`` in ``world_size`` spawned processes sharing GPU ``device_index``
    (None: the CPU), a gloo group through a file store whose collectives time out after
    ``collective_timeout_s`` (on a GPU the transport is CUDA IPC, whose exchanges time out
    after :data:`EXCHANGE_TIMEOUT_S`); ``fn`` must be a module-level function and return
    JSON-able values. Returns each rank's value.

    The processes are started by torch's process starter
    (``torch.multiprocessing.start_processes``): when a rank fails, the parent ends the others
    at once and raises :class:`RankError` with the first failing rank's own traceback (the
    others' lost connections are its consequence), so no rank is left waiting for one that
    died: the others end at once, not when their collective or exchange times out."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _process_main, args=(world_size, device_index, tmp, collective_timeout_s, fn, args),
            nprocs=world_size, join=False, start_method="spawn")
        try:
            while not context.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            first = first_failure(tmp, world_size)
            if first is not None:
                rank, text = first
                raise RankError(f"rank {rank} of {world_size} failed (the other ranks were "
                                f"stopped):\n{text}") from None
            how = str(exc).strip()
            raise RankError(f"rank {exc.error_index} of {world_size} failed (the other ranks "
                            f"were stopped): {how}") from None
        results = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results
