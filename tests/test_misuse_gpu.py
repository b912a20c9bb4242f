"""GPU tests of misuse where the CUDA path differs from the CPU one: the step function's own
optimizer.step() under capture, on_overflow raising after a replay's rerun, device-side
expert counts out of range, and stash/reload of [rows, 1] tensors with transposed strides."""
from __future__ import annotations

import copy

import pytest
import torch

import graphstash
from graphstash import _layout as L
from graphstash.errors import UpdateAppliedError
from graphstash.graph import graph_step
from graphstash.moe import default_status, expert_mlp, grouped_mm

from _data import as_bytes, pattern

pytestmark = pytest.mark.gpu
W = 64


class FlagNet(torch.nn.Module):
    """Two layers; ``marker`` 1 raises the overflow flag inside the graph and poisons the
    activations with NaN (dropless reruns never flag)."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(W, W)
        self.l2 = torch.nn.Linear(W, W)

    @property
    def status(self):
        """The running step's status tensor (NOTE [current step]), or None outside a step."""
        owner = graphstash.status.current()
        return None if owner is None else owner.tensor

    def forward(self, x, marker):
        h = torch.relu(self.l1(x))
        if self.status is not None and not graphstash.is_dropless():
            s = self.status[L.SS_OVERFLOW: L.SS_OVERFLOW + 1]
            s.copy_(torch.maximum(s, marker))
            h = h + torch.where(marker.bool(), float("nan"), 0.0).to(h.dtype)
        return self.l2(h)


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True, capturable=True)


def _batch(g, flagged=False):
    x = torch.randn(16, W, device="cuda", generator=g)
    y = torch.randn(16, W, device="cuda", generator=g)
    return x, y, torch.tensor([int(flagged)], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("warmup", [0, 1])
def test_optimizer_step_in_the_step_function_is_refused_eagerly_and_under_capture(warmup):
    torch.manual_seed(0)
    model = FlagNet().cuda()
    opt = _opt(model.parameters())
    if warmup == 0:                     # state must exist for a capture without warmup
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator(device="cuda").manual_seed(1)

    @graph_step(optimizer=opt, warmup=warmup)
    def train_step(x, y, marker):
        torch.nn.functional.mse_loss(model(x, marker), y).backward()
        opt.step()

    with pytest.raises(ValueError, match=r"fn: .*owns optimizer\.step\(\)"):
        train_step(*_batch(g))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert train_step.stats.steps == 0


def test_on_overflow_raising_after_a_replay_rerun_counts_the_applied_update():
    torch.manual_seed(0)
    model = FlagNet().cuda()
    ref = copy.deepcopy(model)
    opt, ref_opt = _opt(model.parameters()), _opt(ref.parameters())
    g = torch.Generator(device="cuda").manual_seed(2)
    data = [_batch(g, flagged=(i == 3)) for i in range(6)]

    def on_overflow(flags):
        raise RuntimeError("budget table full")

    @graph_step(optimizer=opt, warmup=1, on_overflow=on_overflow)
    def train_step(x, y, marker):
        loss = torch.nn.functional.mse_loss(model(x, marker), y)
        loss.backward()
        return loss

    for i, batch in enumerate(data):
        if i == 3:                      # a replay, flagged: rerun, update, then the callback
            with pytest.raises(UpdateAppliedError, match="already applied"):
                train_step(*batch)
        else:
            train_step(*batch)
        assert train_step.stats.steps == i + 1
    for x, y, _ in data:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x, torch.zeros(1, dtype=torch.int32,
                                                        device="cuda")), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert int(opt.state[next(model.parameters())]["step"]) == 6
    st = train_step.stats
    assert (st.replays, st.eager_reruns, st.captures) == (5, 1, 2)   # recaptured after it


@pytest.mark.parametrize("impl", ["auto", "masked"])
@pytest.mark.parametrize("counts", [[20, -8, 20], [12, 0, 21], [40, 0, 0]])
def test_device_counts_out_of_range_set_the_overflow_flag(impl, counts):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(32, 64, device="cuda", generator=g).bfloat16()
    w = torch.randn(3, 32, 64, device="cuda", generator=g).bfloat16()
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device="cuda")
    out = grouped_mm(x, w, torch.tensor([12, 0, 20], dtype=torch.int32, device="cuda"),
                     impl=impl, status=status)
    assert out.shape == (32, 32) and int(status[L.SS_OVERFLOW]) == 0     # good counts: no flag
    out = grouped_mm(x, w, torch.tensor(counts, dtype=torch.int32, device="cuda"), impl=impl,
                     status=status)
    torch.cuda.synchronize()
    assert out.shape == (32, 32)
    assert int(status[L.SS_OVERFLOW]) & L.OVERFLOW_COUNT


def test_expert_mlp_device_counts_out_of_range_flag_the_default_status():
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(32, 64, device="cuda", generator=g).bfloat16()
    w1 = torch.randn(3, 32, 64, device="cuda", generator=g).bfloat16()
    w2 = torch.randn(3, 64, 32, device="cuda", generator=g).bfloat16()
    status = default_status(x.device)
    status.zero_()
    y = expert_mlp(x, w1, w2, torch.tensor([30, 1, 8], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert y.shape == (32, 64) and int(status[L.SS_OVERFLOW]) & L.OVERFLOW_COUNT
    status.zero_()


def test_loop_impl_reads_device_counts_and_refuses_them():
    x = torch.randn(32, 16, device="cuda")
    w = torch.randn(3, 8, 16, device="cuda")
    with pytest.raises(ValueError, match="tokens_per_expert: expected counts >= 0"):
        grouped_mm(x, w, torch.tensor([40, -8, 0], device="cuda"), impl="loop")


def test_single_column_rows_with_transposed_strides_match_the_reference():
    rows = 96
    bufs = {b: graphstash.PagedStashBuffer(rows, 1, dtype=torch.float32, device="cuda",
                                           page_size=16, backend=b)
            for b in ("cupy", "reference")}
    outs = {}
    for b, buf in bufs.items():
        x = pattern((1, rows), torch.float32, salt=7, device="cuda").t()
        out = pattern((1, rows), torch.float32, salt=8, device="cuda").t()
        assert x.stride() == (1, rows) and x.is_contiguous()
        h = buf.stash(x, torch.tensor([70], dtype=torch.int32, device="cuda"))
        buf.reload(h, out=out)
        assert h.record()["valid"] == -1
        outs[b] = as_bytes(out.reshape(-1)).clone()
    assert torch.equal(outs["cupy"], outs["reference"])
    want = pattern((1, rows), torch.float32, salt=8, device="cuda").reshape(-1)
    want[:70] = pattern((1, rows), torch.float32, salt=7, device="cuda").reshape(-1)[:70]
    assert torch.equal(outs["cupy"], as_bytes(want))
