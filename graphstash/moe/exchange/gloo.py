"""The CPU reference transport: the exchange's semantics over gloo collectives.

Each rank's region is a CPU tensor laid out as on the GPU; what the kernels write into a peer's
region, the peer receives through a gloo collective and writes into its own
(:mod:`graphstash.reference.exchange`). Offsets, clipping, layout, flags and the byte counts
are those of the kernels, so the CPU test suite runs the same exchange the GPU runs.
"""
from __future__ import annotations

import math

import torch

from . import layout as X
from ...reference import exchange as ref
from .transport import DEFAULT_TIMEOUT_S, Transport, check_sizes


class GlooTransport(Transport):
    """A :class:`~graphstash.moe.exchange.Transport` of CPU tensors over a gloo group."""

    def _counts_field(self) -> torch.Tensor:
        start = self._offsets[X.XF_COUNTS]
        W, stride = self.world_size, self.layout.count_stride
        return self.region[start:start + 4 * W * stride].view(torch.int32).view(W, stride)

    def _field_bytes(self, field: int, row_bytes: int) -> torch.Tensor:
        start = self._offsets[field]
        rows = self.capacity_rows
        return self.region[start:start + rows * row_bytes].view(rows, row_bytes)

    def barrier(self, status: torch.Tensor | None = None) -> None:
        ref.barrier(self.state, self.world_size, status)

    def exchange_counts(self, send_counts, num_experts, budget, pad_multiple, row_bytes,
                        bad_index, status, *, cube, work, tokens_per_expert, live_rows,
                        demand_rows, over_budget) -> None:
        ref.exchange_counts(self.group, self.rank, self.world_size, self.state,
                            self._counts_field(), send_counts, num_experts, budget,
                            pad_multiple, row_bytes, bad_index, status, cube=cube, work=work,
                            tokens_per_expert=tokens_per_expert, live_rows=live_rows,
                            demand_rows=demand_rows, over_budget=over_budget)

    def exchange_map(self, *args) -> None:
        ref.exchange_map(*args)

    def push(self, field, src, src_index, dest_peer, dest_row, count, window_lo, window_hi,
             weights=None, weights_index=None):
        row_bytes = math.prod(src.shape[1:]) * src.element_size()
        extra = None
        if weights is not None:
            extra = (self._field_bytes(X.XF_WEIGHTS, weights.element_size()), weights,
                     weights_index)
        ref.push_rows(self.group, self.rank, self.world_size, self.state,
                      self._field_bytes(field, row_bytes), src, src_index, dest_peer, dest_row,
                      count, window_lo, window_hi, extra=extra)

    def _all_reduce_flags(self, flags: torch.Tensor, peaks: torch.Tensor | None) -> None:
        ref.all_reduce_flags_(self.group, self.world_size, self.state, flags, peaks)


def build_gloo_transport(group=None, *, capacity_rows: int, row_bytes: int, max_experts: int,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> GlooTransport:
    """The CPU reference transport of this rank of ``group`` (a gloo process group; default
    the world). Every rank calls it with the same sizes.

    Args:
        group: ``torch.distributed`` process group with the gloo backend, or None (world).
        capacity_rows: rows one exchange can receive at once (see
            :func:`~graphstash.moe.exchange.build_ipc_transport`).
        row_bytes: bytes of the widest row (``hidden x element size``).
        max_experts: most experts (over all ranks) of a dispatch.
        timeout_s: kept for the interface (gloo's own timeout applies).

    Example::

        dist.init_process_group("gloo", rank=rank, world_size=2)
        transport = build_gloo_transport(capacity_rows=4096, row_bytes=4 * 64, max_experts=8)
    """
    import torch.distributed as dist

    check_sizes(capacity_rows, row_bytes, max_experts, timeout_s)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; call "
                         "init_process_group('gloo', ...) first")
    layout = X.RegionLayout(dist.get_world_size(group), capacity_rows, row_bytes, max_experts)
    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    table = torch.zeros(X.XF_FIELDS, layout.world_size, dtype=torch.int64)
    return GlooTransport(kind="gloo", rank=dist.get_rank(group), world_size=layout.world_size,
                         layout=layout, region=region, table=table, timeout_s=timeout_s,
                         group=group)
