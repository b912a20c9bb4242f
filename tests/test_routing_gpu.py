"""The routing kernels (raw_kernels/moe_routing.cu) against the torch plan they replace:
every index map, count and flag equal, exactly."""
from __future__ import annotations

import pytest
import torch

from graphstash import _layout as L
from graphstash.moe._routing import plan_local
from graphstash.moe.backend import OPERATORS, REFERENCE

pytestmark = pytest.mark.gpu

FIELDS = ("slot_of_pair", "token_of_slot", "pair_of_slot", "tokens_per_expert", "live_rows",
          "demand_rows", "over_budget", "bad_index")


@pytest.mark.parametrize("T, K, E, budget, pad", [
    (1, 1, 1, 1, None),
    (300, 2, 8, 600, None),            # exactly the dropless rows
    (300, 2, 8, 1300, 16),             # headroom, padding
    (1000, 8, 128, 8000, None),        # 128 experts, more than one chunk per warp
    (1000, 8, 128, 5000, 8),           # over budget: rows dropped
    (4099, 4, 64, 9000, 4),            # pairs not a multiple of the chunk
    (256, 2, 700, 600, None),          # many experts, most empty
])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_kernel_plan_equals_torch_plan(gen, T, K, E, budget, pad, dtype):
    idx = torch.randint(0, E, (T, K), generator=gen)
    if T * K > 10:
        idx[3, 0] = E + 2                  # out of range: bad, never placed
        idx[5, -1] = -1
        skew = torch.randint(0, T, (T // 3,), generator=gen)
        idx[skew, 0] = 0                   # a hot expert
    idx = idx.to("cuda", dtype)
    status = [torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device="cuda") for _ in range(2)]
    for s in status:
        s[L.SS_TOKENS_PEAK] = 5
    want = plan_local(idx, E, budget, pad, kernels=REFERENCE, status=status[0])   # torch ops
    got = plan_local(idx, E, budget, pad, kernels=OPERATORS, status=status[1])    # kernels
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(status[1], status[0], rtol=0, atol=0)     # the same flags
