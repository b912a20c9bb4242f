"""Indices into the small device tensors the kernels share with Python.

Mirrors ``raw_kernels/gs_layout.cuh`` (``tests/test_layout.py`` checks they agree).
"""

# per-buffer ring state, int64 [STATE_SIZE]
ST_DEV_HEAD = 0
ST_DEV_TAIL = 1
ST_HOST_HEAD = 2
ST_HOST_TAIL = 3
ST_DEV_PEAK = 4
ST_HOST_PEAK = 5
ST_DEMAND = 6
ST_DEMAND_PEAK = 7
ST_TOKENS_PEAK = 8
ST_STASH_TICKET = 9
ST_RELOAD_TICKET = 10
ST_STASH_WORK = 11
ST_RELOAD_WORK = 12
STATE_SIZE = 16

# status shared by the buffers of a manager, int32 [STATUS_SIZE]
SS_OVERFLOW = 0
SS_HOST_SPILL = 1
SS_OVER_BUDGET = 2
SS_TOKENS_PEAK = 3
STATUS_SIZE = 8

OVERFLOW_POOL = 1
OVERFLOW_COUNT = 2
OVERFLOW_EXCHANGE = 4

# handle record in the page-table arena, int32
H_VALID = 0
H_PAGES = 1
H_DEV_PAGES = 2
H_HOST_PAGES = 3
H_COUNTS = 4
H_HEADER = 4
