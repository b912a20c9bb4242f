"""Where things are in an expert-parallel exchange's shared region, its peer table and its private state.

Mirrors ``raw_kernels/gs_exchange.cuh`` (``tests/test_exchange.py`` checks they agree). One
region per rank holds, each field aligned to :data:`ALIGN` bytes::

    SIGNALS  int64 [W]                          the last barrier epoch each rank raised here
    FLAGS    int32 [2, W, X_MAX_FLAGS + X_MAX_PEAKS]  flags and peaks pushed by all_reduce_flags_
                                                (two parities)
    COUNTS   int32 [W, X_HEADER + max_experts]  each source's header and per-expert counts
    WEIGHTS  [capacity_rows] x 8 bytes          the router weight of each received row
    ROWS     [capacity_rows] x row_bytes        the received rows

The peer table is int64 ``[XF_FIELDS, W]``: entry ``[f, p]`` is the device address of field
``f`` of rank ``p``'s region. Nothing here touches the GPU.
"""
from __future__ import annotations

import dataclasses

# peer table fields
XF_SIGNALS = 0
XF_FLAGS = 1
XF_COUNTS = 2
XF_WEIGHTS = 3
XF_ROWS = 4
XF_FIELDS = 5

# private state, int64 [XS_SIZE]
XS_EPOCH = 0
XS_ERROR = 1
XS_ERROR_PEER = 2
XS_ERROR_EPOCH = 3
XS_ROW_BYTES_REMOTE = 4
XS_ROW_BYTES_LOCAL = 5
XS_META_BYTES = 6
XS_ROWS_SENT = 7
XS_SIZE = 16

# failure codes
XE_TIMEOUT = 1
XE_MISMATCH = 2

X_HEADER = 4
X_MAX_FLAGS = 16           # flags one all_reduce_flags_ sums
X_MAX_PEAKS = 1024         # peaks it takes the maximum of in the same exchange (MAX_STEP_PEAKS)

# plan workspace, int64 [XW_ARRAYS * E + 1]
XW_OFFS = 0
XW_TOTAL = 1
XW_DST = 2
XW_RECV = 3
XW_SRC = 4
XW_SLOT = 5
XW_ARRAYS = 6

ALIGN = 256
WEIGHT_BYTES = 8          # room for one router weight of any floating dtype


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def work_size(num_experts: int) -> int:
    """Entries of the int64 plan workspace of a dispatch over ``num_experts`` experts."""
    return XW_ARRAYS * num_experts + 1


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """Byte offsets of the fields of one rank's region; every rank's is the same.

    ``capacity_rows`` rows of at most ``row_bytes`` bytes can be received at once (a budget's
    rows on the dispatch side; a rank's ``tokens x topk`` pairs on the combine side), counts of
    up to ``max_experts`` experts.
    """
    world_size: int
    capacity_rows: int
    row_bytes: int
    max_experts: int

    @property
    def count_stride(self) -> int:
        """int32 entries of one source's count row (header + counts)."""
        return X_HEADER + self.max_experts

    def sizes(self) -> tuple[int, ...]:
        """Bytes of each field, in table order."""
        W = self.world_size
        return (8 * W, 4 * 2 * W * (X_MAX_FLAGS + X_MAX_PEAKS), 4 * W * self.count_stride,
                WEIGHT_BYTES * self.capacity_rows, self.row_bytes * self.capacity_rows)

    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each field, in table order (each aligned to ALIGN)."""
        out, at = [], 0
        for size in self.sizes():
            out.append(at)
            at += _align(size)
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region."""
        return self.offsets()[-1] + _align(self.sizes()[-1])
