"""The transport of an expert-parallel exchange: one rank's shared region, a device table of
every rank's addresses, and the few operations every exchange is built from (a barrier, the
count exchange, the row push, the flag sum).

NOTE [exchange transport]: each rank owns one region (``graphstash/moe/exchange/layout.py``):
signals, flag slots, count rows, and room for ``capacity_rows`` received rows and their router
weights. ``table`` (int64 ``[XF_FIELDS, W]`` on the device) holds the address of each field of
every rank's region, so a kernel writes into a peer by address, inside a CUDA graph, with no
library call. Where the addresses come from is the builder's business, and the only
difference between transports:

- :func:`~graphstash.moe.exchange.build_symmetric_transport`: torch symmetric memory (CUDA
  backend, multicast off) on GPUs of one node, one rank per GPU;
- :func:`~graphstash.moe.exchange.build_ipc_transport`: CUDA IPC handles exchanged over a CPU
  process group, for several processes sharing one GPU;
- :func:`~graphstash.moe.exchange.build_local_transports`: W ranks inside one process, each
  table pointing at that process's own regions;
- :func:`~graphstash.moe.exchange.build_gloo_transport`: the CPU reference, the same
  semantics over gloo collectives (:mod:`graphstash.reference.exchange`).

Everything is allocated and rendezvoused when the transport is built (at layer build or graph
reset), never inside a step; the region's size is the only thing that separates the live-row
exchange (``capacity_rows`` = the budget) from a worst-case one (every row any rank could
send: ``W x tokens x topk``): same code, another number.
"""
from __future__ import annotations

import torch

from . import layout as X
from ..._checks import describe, forbid_capture, require_positive_int, require_tensor
from ...errors import ExchangeError

DEFAULT_TIMEOUT_S = 30.0
NO_BUDGET = 2**62          # budget of a dropless exchange: no receiver drops


def check_sizes(capacity_rows, row_bytes, max_experts, timeout_s) -> None:
    """Validate a builder's sizes (TypeError/ValueError naming the argument)."""
    require_positive_int("capacity_rows", capacity_rows)
    require_positive_int("row_bytes", row_bytes)
    require_positive_int("max_experts", max_experts)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s: expected a number of seconds, got {type(timeout_s).__name__}")
    if not timeout_s > 0 or timeout_s > 3600:
        raise ValueError(f"timeout_s: expected seconds in (0, 3600], got {timeout_s}")


class Transport:
    """One rank's end of an exchange (NOTE [exchange transport]); built by a builder.

    Attributes:
        kind: ``"symmetric"``, ``"ipc"``, ``"local"`` or ``"gloo"``.
        rank, world_size: this rank and the ranks of the exchange.
        device: where the region, the table and the state live.
        layout: the :class:`~graphstash.moe.exchange.layout.RegionLayout` of every region.
        region: uint8 ``[layout.nbytes]``, this rank's region (others write into it).
        table: int64 ``[XF_FIELDS, W]`` every rank's field addresses (zeros for ``"gloo"``).
        state: int64 ``[XS_SIZE]`` private: barrier epoch, error, bytes moved.
        timeout_s: how long a rank waits for a peer's signal before it gives up.
        group: the process group it was built over (None for in-process ranks).
        push_blocks: thread blocks a push may use at most (0: as many as it has row groups);
            peer transports only (docs/exchange.md, "Bandwidth between two GPUs").
    """

    def __init__(self, *, kind: str, rank: int, world_size: int, layout: X.RegionLayout,
                 region: torch.Tensor, table: torch.Tensor, timeout_s: float, group=None,
                 keep=(), on_close=None):
        self.kind = kind
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.region = region
        self.table = table
        self.device = region.device
        self.timeout_s = float(timeout_s)
        self.group = group
        self.state = torch.zeros(X.XS_SIZE, dtype=torch.int64, device=self.device)
        self._keep = list(keep)           # the peers' mappings and handles, alive until close
        self._on_close = on_close
        self._offsets = layout.offsets()
        self.closed = False
        self.push_blocks = 0
        # the self test's device tensors, made here: a rank must not allocate while a peer's
        # barrier spins (NOTE [in-process ranks] in local.py)
        W = world_size
        self._test_src = torch.zeros(W, 4, dtype=torch.int32, device=self.device)
        self._test_peers = torch.arange(W, dtype=torch.int32, device=self.device)
        self._test_rows = torch.full((W,), rank, dtype=torch.int32, device=self.device)
        self._test_count = torch.tensor([W], dtype=torch.int32, device=self.device)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(kind={self.kind!r}, rank={self.rank}, "
                f"world_size={self.world_size}, capacity_rows={self.capacity_rows}, "
                f"row_bytes={self.row_bytes}, device={self.device})")

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def capacity_rows(self) -> int:
        """Rows one exchange can receive at once (each rank's region holds as many)."""
        return self.layout.capacity_rows

    @property
    def row_bytes(self) -> int:
        """Bytes of the widest row the region holds."""
        return self.layout.row_bytes

    @property
    def max_experts(self) -> int:
        """Most experts (over all ranks) a dispatch through it may have."""
        return self.layout.max_experts

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def field_address(self, field: int) -> int:
        """Device address of ``field`` (``XF_*``) in this rank's region."""
        return self.region.data_ptr() + self._offsets[field]

    def field_view(self, field: int, dtype: torch.dtype, width: int, rows: int) -> torch.Tensor:
        """``[rows, width]`` of ``dtype``: the first rows of ``field`` (``XF_ROWS`` or
        ``XF_WEIGHTS``) of this rank's region, packed as the push kernels write them."""
        nbytes = rows * width * torch.empty((), dtype=dtype).element_size()
        start = self._offsets[field]
        return self.region[start:start + nbytes].view(dtype).view(rows, width)

    def require(self, *, rows: int, row_bytes: int, num_experts: int, name: str) -> None:
        """ValueError naming ``name`` unless ``rows`` rows of ``row_bytes`` bytes and
        ``num_experts`` experts fit this transport."""
        if num_experts % self.world_size:
            raise ValueError(f"num_experts: expected a multiple of the exchange's "
                             f"{self.world_size} ranks, got {num_experts}")
        if num_experts > self.max_experts:
            raise ValueError(f"num_experts: the exchange was built for at most "
                             f"{self.max_experts} experts, got {num_experts}")
        if row_bytes > self.row_bytes:
            raise ValueError(f"{name}: rows of {row_bytes} bytes do not fit the exchange's "
                             f"{self.row_bytes}-byte rows (build it with a larger row_bytes)")
        if rows > self.capacity_rows:
            raise ValueError(f"{name}: {rows} rows do not fit the exchange's "
                             f"{self.capacity_rows} (build it with capacity_rows >= {rows})")

    # ---- operations (device side, capturable) -------------------------------------------
    def barrier(self, status: torch.Tensor | None = None) -> None:
        """Every rank's exchanges issued before it are done when it returns on the device.
        ``status`` (int32 ``[8]``, or None) gets ``OVERFLOW_EXCHANGE`` if the exchange has
        failed (NOTE [exchange timeout])."""
        raise NotImplementedError

    def exchange_counts(self, send_counts, num_experts, budget, pad_multiple, row_bytes,
                        bad_index, status, **outputs) -> None:
        """Count exchange, barrier and layout (``gs_xchg_counts``); see the kernel op."""
        raise NotImplementedError

    def exchange_map(self, *args) -> None:
        """``gs_xchg_map`` / :func:`graphstash.reference.exchange.exchange_map`."""
        raise NotImplementedError

    def push(self, field: int, src: torch.Tensor, src_index, dest_peer, dest_row, count,
             window_lo: int, window_hi: int, weights: torch.Tensor | None = None,
             weights_index: torch.Tensor | None = None) -> None:
        """Copy the live rows of ``src`` into the ranks' ``field`` (a collective); with
        ``weights``, each row's weight into the ``XF_WEIGHTS`` field beside it (see the
        ``exchange_push`` operator in ``graphstash/_kernels/exchange.py``)."""
        raise NotImplementedError

    def all_reduce_flags_(self, flags: torch.Tensor, peaks: torch.Tensor | None = None) -> None:
        """Sum ``flags`` (int32 ``[n]``, ``n <= 16``, on this transport's device) over the
        ranks, in place, through the regions: capturable, no host read, no NCCL; ``peaks``
        (int32 ``[m]``, ``m <= 1024``, or None: NOTE [step peaks] in ``graphstash/status.py``)
        become their maximum over the ranks in the same exchange. After a failed exchange
        every flag is at least 1, so the step is not trusted (and the host raises
        :class:`~graphstash.errors.ExchangeError` at its next read).

        This is the flag reducer of a training step whose exchange runs through this
        transport (``graphstash.status.FlagReducer``). Example::

            flags = (status[:3] != 0).to(torch.int32)
            transport.all_reduce_flags_(flags)      # every rank now holds the same sums
        """
        require_tensor("flags", flags, "an int32 tensor")
        if (flags.dtype != torch.int32 or flags.dim() != 1 or flags.device != self.device
                or not 1 <= flags.numel() <= X.X_MAX_FLAGS or not flags.is_contiguous()):
            raise ValueError(f"flags: expected a contiguous int32 tensor of 1 to "
                             f"{X.X_MAX_FLAGS} elements on {self.device}, got {describe(flags)}")
        if peaks is not None and (
                not isinstance(peaks, torch.Tensor) or peaks.dtype != torch.int32
                or peaks.dim() != 1 or peaks.device != self.device
                or not 1 <= peaks.numel() <= X.X_MAX_PEAKS or not peaks.is_contiguous()):
            raise ValueError(f"peaks: expected None or a contiguous int32 tensor of 1 to "
                             f"{X.X_MAX_PEAKS} elements on {self.device}, got "
                             f"{describe(peaks) if isinstance(peaks, torch.Tensor) else peaks!r}")
        self._all_reduce_flags(flags, peaks)

    def _all_reduce_flags(self, flags: torch.Tensor, peaks: torch.Tensor | None) -> None:
        raise NotImplementedError

    # ---- host side ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`~graphstash.errors.ExchangeError` if an exchange through this
        transport failed (one host read; not while capturing)."""
        forbid_capture("Transport.check()")
        state = self.state.tolist()
        code, peer, epoch = state[X.XS_ERROR], state[X.XS_ERROR_PEER], state[X.XS_ERROR_EPOCH]
        if code == X.XE_TIMEOUT:
            raise ExchangeError(
                f"expert-parallel exchange ({self.kind}, rank {self.rank} of "
                f"{self.world_size}): rank {peer} did not signal within {self.timeout_s:g} s "
                f"(barrier {epoch} of this transport); it died, raised before the exchange, or "
                f"runs another sequence of exchanges. The step's results are not trusted and "
                f"this transport cannot be used again")
        if code == X.XE_MISMATCH:
            raise ExchangeError(
                f"expert-parallel exchange ({self.kind}, rank {self.rank} of "
                f"{self.world_size}): rank {peer} dispatched with another number of experts, "
                f"budget, pad_multiple or row width than this rank (barrier {epoch}); every "
                f"rank must run the same layers with the same settings")
        if code:
            raise ExchangeError(f"expert-parallel exchange ({self.kind}, rank {self.rank}): "
                                f"failure code {code} from rank {peer} at barrier {epoch}")

    @property
    def failed(self) -> bool:
        """Whether an exchange failed (one host read)."""
        return int(self.state[X.XS_ERROR]) != 0

    def counters(self) -> dict:
        """What this rank moved since the last :meth:`reset_counters`, counted on the device
        (one host read): ``row_bytes_remote`` / ``row_bytes_local`` (rows and router weights
        written into other ranks' regions / its own), ``meta_bytes`` (counts, flags and
        signals), ``rows_sent`` and ``barriers`` (epochs since the transport was built)."""
        state = self.state.tolist()
        return {"row_bytes_remote": state[X.XS_ROW_BYTES_REMOTE],
                "row_bytes_local": state[X.XS_ROW_BYTES_LOCAL],
                "meta_bytes": state[X.XS_META_BYTES], "rows_sent": state[X.XS_ROWS_SENT],
                "barriers": state[X.XS_EPOCH]}

    def reset_counters(self) -> None:
        """Zero the byte and row counters (on the device, capturable)."""
        with torch.no_grad():
            self.state[X.XS_ROW_BYTES_REMOTE:X.XS_ROWS_SENT + 1].zero_()

    def close(self) -> None:
        """Release the region and the peers' mappings. A collective for the process-group
        transports (each rank's region stays until every rank has dropped its mapping)."""
        if self.closed:
            return
        forbid_capture("Transport.close()")
        self._close()
        self.closed = True

    def _close(self) -> None:
        self._keep.clear()
        if self._on_close is not None:
            self._on_close()

    # ---- self test ------------------------------------------------------------------------
    def self_test(self) -> None:
        """Check the table end to end: every rank pushes one row into every rank, a barrier,
        and each checks what arrived (one host read; a collective). Raises ExchangeError
        naming the rank whose row is wrong; :meth:`check` first for a peer that never came.
        Needs ``capacity_rows >= world_size`` and ``row_bytes >= 16``."""
        forbid_capture("Transport.self_test()")
        W = self.world_size
        if self.capacity_rows < W or self.row_bytes < 16:
            raise ValueError(f"self_test: needs capacity_rows >= {W} and row_bytes >= 16, got "
                             f"{self.capacity_rows} and {self.row_bytes}")
        stamp = 0x5E1F0000
        src = torch.stack([torch.full((W,), self.rank, dtype=torch.int32),
                           torch.arange(W, dtype=torch.int32),
                           torch.full((W,), stamp, dtype=torch.int32),
                           torch.full((W,), W, dtype=torch.int32)], 1)
        self._test_src.copy_(src)
        self.barrier()
        self.push(X.XF_ROWS, self._test_src, None, self._test_peers, self._test_rows,
                  self._test_count, 0, W)
        self.barrier()
        got = self.field_view(X.XF_ROWS, torch.int32, 4, W).cpu()
        self.barrier()
        self.check()
        for s in range(W):
            want = [s, self.rank, stamp, W]
            if got[s].tolist() != want:
                raise ExchangeError(f"expert-parallel exchange self test ({self.kind}): rank "
                                    f"{self.rank} received {got[s].tolist()} from rank {s}, "
                                    f"expected {want}: the peer table is wrong")


class PeerTransport(Transport):
    """A transport whose kernels write into the peers through the device table (symmetric
    memory, CUDA IPC or one process's own regions)."""

    @staticmethod
    def _ops():
        from ..._kernels import exchange as ops
        return ops

    def barrier(self, status: torch.Tensor | None = None) -> None:
        self._ops().barrier(self.table, self.state, self.region, self.world_size, self.rank,
                            self.timeout_ns, status)

    def exchange_counts(self, send_counts, num_experts, budget, pad_multiple, row_bytes,
                        bad_index, status, *, cube, work, tokens_per_expert, live_rows,
                        demand_rows, over_budget) -> None:
        self._ops().exchange_counts(
            self.table, self.state, self.region, self.world_size, self.rank, self.timeout_ns,
            send_counts, num_experts, self.layout.count_stride, budget, pad_multiple, row_bytes,
            bad_index, status, cube, work, tokens_per_expert, live_rows, demand_rows,
            over_budget)

    def exchange_map(self, *args) -> None:
        self._ops().exchange_map(*args)

    def push(self, field, src, src_index, dest_peer, dest_row, count, window_lo, window_hi,
             weights=None, weights_index=None):
        self._ops().exchange_push(self.table, self.state, self.region, self.world_size,
                                  self.rank, field, self.field_address(field), src, src_index,
                                  dest_peer, dest_row, count, window_lo, window_hi,
                                  self.capacity_rows, X.XF_WEIGHTS, weights, weights_index,
                                  self.push_blocks)

    def _all_reduce_flags(self, flags: torch.Tensor, peaks: torch.Tensor | None) -> None:
        self._ops().exchange_flags(self.table, self.state, self.region, self.world_size,
                                   self.rank, self.timeout_ns, flags, peaks)

    def _close(self) -> None:
        torch.cuda.synchronize(self.device)
        super()._close()


def build_table(layout: X.RegionLayout, bases: list[int], device) -> torch.Tensor:
    """int64 ``[XF_FIELDS, W]`` on ``device``: every field's address in every rank's region,
    from each region's base address (``bases[p]``)."""
    offsets = layout.offsets()
    rows = [[base + offsets[f] for base in bases] for f in range(X.XF_FIELDS)]
    return torch.tensor(rows, dtype=torch.int64, device=device)
