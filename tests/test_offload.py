"""Activation offload on the CPU path: copies into the host pool exercise groups, keys, prefetch
order, thresholds, toggling, forced release, misuse errors and in-place detection."""
from __future__ import annotations

import pytest
import torch

from graphstash import mark_not_movable
from graphstash.errors import (CaptureError, GraphstashError, SavedTensorModifiedError,
                               SavedTensorsError)
from graphstash._saved.host import dense_strides_like, size_class
from graphstash.offload import ActivationOffloader, HostPool, format_bytes_table
from graphstash.swap import TensorSwapper

from _marks import Marker

WIDTH = 48
ROWS = 24


def _blocks(gen, n=4, width=WIDTH):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return [torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                torch.nn.Linear(2 * width, width), torch.nn.Tanh()) for _ in range(n)]


def _input(gen, rows=ROWS, width=WIDTH):
    # row i is offset by i so a misplaced row shows up as an exact diff
    base = torch.randn(rows, width, generator=gen)
    return base + torch.arange(rows, dtype=torch.float32)[:, None] / rows


def _grads(blocks, x):
    out = [p.grad.clone() for b in blocks for p in b.parameters()] + [x.grad.clone()]
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return out


def _step(blocks, x0, off=None, api="ctx", log=None):
    x = x0.clone().requires_grad_()
    h = x * 1.5                            # not a leaf, so block 0's input can be offloaded
    if off is None:
        for b in blocks:
            h = b(h)
    else:
        with off:
            for i, b in enumerate(blocks):
                if api == "ctx":
                    with off.group(f"b{i}"):
                        h = b(h)
                else:
                    h = off.group_start(h, f"b{i}")
                    if log is not None:
                        h = Marker.apply(h, log, f"end b{i}")
                    h = b(h)
                    h = off.group_commit(h, f"b{i}")
                    if log is not None:
                        h = Marker.apply(h, log, f"begin b{i}")
    h.pow(2).sum().backward()
    return _grads(blocks, x)


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"gradient {i} differs"


@pytest.mark.parametrize("api", ["ctx", "functions"])
def test_gradients_exact_and_pool_reused(gen, api):
    blocks = _blocks(gen)
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu")
    for step in range(3):
        x0 = _input(gen)
        ref = _step(blocks, x0)
        _assert_same(_step(blocks, x0, off, api), ref)
        if step == 0:
            allocations = off.host_pool.allocations
            assert allocations > 0
        assert off.host_pool.allocations == allocations          # no host allocation per step
        assert off.host_pool.in_use_bytes == 0                    # every buffer given back
        assert off.pending_forwards == 0


def test_schedule_release_keep_last_and_prefetch(gen):
    blocks = _blocks(gen)
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=1)
    x0 = _input(gen)
    _step(blocks, x0, off, "functions")
    first = list(off.transfer_log)
    # first forward: the group count is unknown, so every group is offloaded; the last one is
    # still on the device when backward starts and is handed over without a copy
    assert first[:3] == [("d2h", "b0"), ("d2h", "b1"), ("release", "b0")]
    assert ("adopt", "b3") in first and ("h2d", "b3") not in first
    off.transfer_log.clear()
    log = off.transfer_log
    _step(blocks, x0, off, "functions", log=log)
    events = list(log)
    assert ("d2h", "b3") not in events                            # kept on the device
    assert off.summary()["b3"] == 0 and off.summary()["b0"] > 0
    fwd = [e for e in events if e[0] in ("d2h", "release")]
    assert fwd == [("d2h", "b0"), ("d2h", "b1"), ("release", "b0"), ("d2h", "b2"),
                   ("release", "b1"), ("release", "b2")]
    # backward: group k-1 is fetched once group k's backward has begun, before it ends
    for k in (3, 2, 1):
        begin = events.index(("bwd", f"begin b{k}"))
        end = events.index(("bwd", f"end b{k}"))
        fetch = events.index(("h2d", f"b{k - 1}"))
        assert begin < fetch < end, events


def test_min_size_dedupe_and_not_offloadable(gen):
    off = ActivationOffloader(min_tensor_bytes=4096, device="cpu", keep_last=0)
    a = (torch.randn(32, 64, generator=gen) + 1).requires_grad_()     # 8 KiB
    small = (torch.randn(16, generator=gen) + 2).requires_grad_()     # 64 B
    with off:
        with off.group("g"):
            a2, s2 = a * 1, small * 1
            y = torch.sin(a2) * a2 + a2 * a2 + torch.cos(s2).sum()     # a2 saved 4 times
    # records: a2 (once, deduplicated) and sin(a2); the small tensor stays
    assert off.summary() == {"g": 2 * 32 * 64 * 4, "total": 2 * 32 * 64 * 4}
    y.sum().backward()
    expected_a = (torch.cos(a) * a + torch.sin(a) + 2 * a).detach()
    assert torch.allclose(a.grad, expected_a, rtol=0, atol=1e-5)
    assert torch.allclose(small.grad, -torch.sin(small).detach() * 32 * 64, rtol=1e-5, atol=1e-3)
    with off:
        with off.group("g"):
            a3 = mark_not_movable(a * 1)
            view = a3.view(64, 32)                                     # same storage
            y = torch.sin(view).sum() + torch.cos(a3).sum()        # both save a3's storage
    assert off.summary()["total"] == 0
    y.backward()


def test_parameters_and_other_devices_stay(gen):
    lin = torch.nn.Linear(64, 64)
    off = ActivationOffloader(min_tensor_bytes=0, device="cpu", keep_last=0)
    x = torch.randn(8, 64, generator=gen, dtype=torch.float64).float().requires_grad_()
    with off:
        with off.group("lin"):
            y = lin(x)              # saves x (a leaf requiring grad) and the weight: none moved
    assert off.summary()["total"] == 0
    y.sum().backward()
    assert torch.allclose(x.grad, lin.weight.detach().sum(0).expand_as(x), rtol=1e-5, atol=1e-6)


def test_toggle_at_run_time(gen):
    blocks = _blocks(gen, n=3)
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=0)
    x0 = _input(gen)
    ref = _step(blocks, x0)
    off.disable()
    _assert_same(_step(blocks, x0, off), ref)
    assert off.summary()["total"] == 0 and not [e for e in off.transfer_log if e[0] == "d2h"]
    off.enable()
    _assert_same(_step(blocks, x0, off), ref)
    assert off.summary()["total"] > 0
    # switched off mid-forward: groups started afterwards stay on the device
    x = x0.clone().requires_grad_()
    h = x * 1.5
    with off:
        for i, b in enumerate(blocks):
            if i == 2:
                off.disable()
            with off.group(f"b{i}"):
                h = b(h)
    off.enable()
    h.pow(2).sum().backward()
    _assert_same(_grads(blocks, x), ref)
    s = off.summary()
    assert s["b0"] > 0 and s["b1"] > 0 and s["b2"] == 0


def test_delayed_groups(gen):
    blocks = _blocks(gen, n=3)
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=0)
    x0 = _input(gen)
    ref = _step(blocks, x0)
    x = x0.clone().requires_grad_()
    h = x * 1.5
    with off:
        with off.group("b0", delay=True):
            h = blocks[0](h)
        assert [e for e in off.transfer_log if e[0] == "d2h"] == []
        with off.group("b1"):
            h = blocks[1](h)
        assert [e for e in off.transfer_log if e[0] == "d2h"] == [("d2h", "b0"), ("d2h", "b1")]
        with off.group("b2", delay=True):
            h = blocks[2](h)
    assert ("d2h", "b2") in off.transfer_log                    # flushed when the scope closed
    h.pow(2).sum().backward()
    _assert_same(_grads(blocks, x), ref)


class _KeepsInput(torch.autograd.Function):
    """y = x * w; saves x for backward and also keeps it in ctx (outside autograd's reach)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.extra = x
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


def test_forced_release(gen):
    w = (torch.randn(64, generator=gen) + 3).requires_grad_()
    x = torch.randn(32, 64, generator=gen).requires_grad_()
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=0)
    with off:
        h = x * 2
        h = off.group_start(h, "mul")
        y = _KeepsInput.apply(h, w)
        kept = h
        y = off.group_commit(y, release=[kept])
        assert kept.untyped_storage().nbytes() > 0               # copy not yet waited on
        z = off.group_start(y, "next")
        z = off.group_commit(torch.sin(z))                       # releases the previous group
        assert kept.untyped_storage().nbytes() == 0
    z.sum().backward()
    gw = (torch.cos((x * 2 * w)) * x * 2).sum(0)
    assert torch.allclose(w.grad, gw.detach(), rtol=0, atol=1e-4)
    with off:
        off.group_start(x, "bad")
        with pytest.raises(ValueError, match="release\\[0\\].*not offloaded"):
            off.group_commit(torch.sin(x * 1), release=[torch.randn(3)])
        off.group_commit(x, "bad")                   # the group is still open after the error


def test_misuse_errors(gen):
    off = ActivationOffloader(device="cpu")
    x = torch.randn(4, generator=gen)
    with pytest.raises(SavedTensorsError, match="outside `with offloader:`"):
        off.group_start(x, "a")
    with off:
        with pytest.raises(SavedTensorsError, match="without an open group"):
            off.group_commit(x)
        off.group_start(x, "a")
        with pytest.raises(SavedTensorsError, match="groups do not nest"):
            off.group_start(x, "b")
        with pytest.raises(SavedTensorsError, match="open group is 'a'"):
            off.group_commit(x, "b")
        off.group_commit(x, "a")
        with pytest.raises(SavedTensorsError, match="cannot be re-entered"):
            off.__enter__()
        with pytest.raises(SavedTensorsError, match="do not nest"):
            with TensorSwapper(device="cpu").swap("layers.*"):
                pass
        with pytest.raises(SavedTensorsError, match="do not nest"):
            with ActivationOffloader(device="cpu"):
                pass
    with pytest.raises(SavedTensorsError, match="while group 'open' is open"):
        with off:
            off.group_start(x, "open")
    with TensorSwapper(device="cpu").swap("t"):
        with pytest.raises(SavedTensorsError, match="inside swap scope 't'"):
            off.__enter__()
    # out-of-order manual exits are refused rather than popping someone else's hooks
    other = ActivationOffloader(device="cpu")
    off.__enter__()
    with pytest.raises(SavedTensorsError, match="do not nest"):
        other.__enter__()
    off.__exit__(None, None, None)
    assert issubclass(SavedTensorsError, GraphstashError)


def test_bad_arguments():
    with pytest.raises(TypeError, match="min_tensor_bytes"):
        ActivationOffloader(min_tensor_bytes=1.5)
    with pytest.raises(ValueError, match="keep_last"):
        ActivationOffloader(keep_last=-1)
    with pytest.raises(TypeError, match="enabled"):
        ActivationOffloader(enabled=1)
    with pytest.raises(ValueError, match="device"):
        ActivationOffloader(device="meta")
    with pytest.raises(TypeError, match="host_pool"):
        ActivationOffloader(host_pool=object())
    off = ActivationOffloader(device="cpu")
    with pytest.raises(TypeError, match="t: expected a torch.Tensor, got list"):
        mark_not_movable([1, 2])
    with off:
        with pytest.raises(TypeError, match="name"):
            off.group_start(torch.ones(2), 3)
        with pytest.raises(TypeError, match="tensor"):
            off.group_start("x", "g")


def test_inplace_after_offload_is_detected(gen):
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=0)
    x = torch.randn(32, 64, generator=gen).requires_grad_()
    with off:
        with off.group("g"):
            h = x * 2
            y = torch.sin(h)
        with off.group("g2"):
            y = torch.cos(y)
    h.add_(1)                                       # after the copy to host
    with pytest.raises(SavedTensorModifiedError, match="modified in place"):
        y.sum().backward()
    off.reset()
    assert off.host_pool.in_use_bytes == 0


def test_inplace_before_copy_and_on_kept_tensors(gen):
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=0)
    x = torch.randn(32, 64, generator=gen).requires_grad_()
    with pytest.raises(SavedTensorModifiedError, match="before its copy to host"):
        with off:
            with off.group("g"):
                h = x * 2
                y = torch.sin(h)
                h.mul_(3)
    off.reset()
    small = torch.randn(4, generator=gen).requires_grad_()
    with off:
        with off.group("g"):
            h = small * 2                           # below min_tensor_bytes: stays, still checked
            y = torch.sin(h)
    h.add_(1)
    with pytest.raises(SavedTensorModifiedError, match="stayed on the device"):
        y.sum().backward()
    # in-place ops autograd allows keep working
    with off:
        with off.group("g"):
            h = (x * 2).relu_()
            y = (h * h).sum()
    y.backward()
    assert torch.equal(x.grad, (8 * x * (x > 0)).detach())


def test_second_backward_refused_and_backward_inside_scope(gen):
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=0)
    x = torch.randn(32, 64, generator=gen).requires_grad_()
    with off:
        with off.group("g"):
            y = torch.sin(x * 2).sum()
    y.backward(retain_graph=True)
    with pytest.raises(SavedTensorsError, match="used twice"):
        y.backward()
    off.reset()
    x.grad = None
    with off:
        with off.group("g"):
            y = torch.sin(x * 2).sum()
        y.backward()                                # backward while the forward scope is open
    assert torch.equal(x.grad, (2 * torch.cos(x * 2)).detach())
    assert off.pending_forwards == 0


def test_layouts_preserved(gen):
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t.sum()

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            seen["stride"], seen["value"] = t.stride(), t.clone()
            return torch.ones_like(t) * g

    off = ActivationOffloader(min_tensor_bytes=0, device="cpu", keep_last=0)
    base = torch.arange(4 * 6 * 10, dtype=torch.float32).view(4, 6, 10).requires_grad_()
    cases = {
        "permuted": lambda b: (b * 1).permute(2, 0, 1),
        "slice": lambda b: (b * 1)[:, :, 2:7].transpose(0, 1),
    }
    for name, make in cases.items():
        with off:
            with off.group(name):
                t = make(base)
                expected = t.detach().clone()
                out = Probe.apply(t)
            with off.group("after"):                  # its commit releases the device copy
                out = out * 1
        out.backward()
        assert ("h2d", name) in off.transfer_log
        assert torch.equal(seen["value"], expected), name
        if name == "permuted":
            assert seen["stride"] == t.stride()
        else:
            assert seen["stride"] == dense_strides_like(t)
    assert dense_strides_like(torch.empty(4, 6, 10)[:, :, :5].transpose(0, 1)) == (5, 30, 1)


def test_views_of_one_storage_move_once(gen):
    """Every storage is copied (and counted) once, however many of its views are saved."""
    rows, width = 16, 32
    params = [(torch.randn(*shape, generator=gen) + 1).requires_grad_()
              for shape in ((width, 3 * width), (width, 2 * width), (rows, width))]
    x0 = _input(gen, rows, width)

    def forward(h):
        w, w2, z = params
        q, k, v = (h @ w).chunk(3, dim=-1)       # column slices of one storage, all saved
        p = torch.softmax((q * k) * v, dim=-1)   # softmax saves p, the mm below saves p.t()
        c = h @ w2                               # only a slice of c is saved (by sin)
        return (p.t() @ z).sum() + torch.sin(c[:, :width]).sum()

    def run(off=None):
        x = x0.clone().requires_grad_()
        if off is None:
            forward(x * 1.5).backward()
        else:
            with off:
                with off.group("g"):
                    out = forward(x * 1.5)
                with off.group("after"):         # its commit releases g's device memory
                    out = out * 1
            # regions moved: h (saved by both matmuls), the q/k/v storage (one span), q * k,
            # p with p.t() (one span), the slice of c (packed on its own)
            assert len(off.host_pool._in_use) == 5
            out.backward()
        grads = [t.grad.clone() for t in params + [x]]
        for t in params:
            t.grad = None
        return grads

    off = ActivationOffloader(min_tensor_bytes=256, device="cpu", keep_last=0)
    ref = run()
    _assert_same(run(off), ref)
    assert ("h2d", "g") in off.transfer_log
    region = rows * width * 4
    assert off.summary() == {"g": 7 * region, "after": 0, "total": 7 * region}
    assert off.host_pool.in_use_bytes == 0 and off.pending_forwards == 0


def test_views_rebuilt_on_one_reload(gen):
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            ctx.save_for_backward(*ts)
            return sum((t * (i + 1)).sum() for i, t in enumerate(ts))

        @staticmethod
        def backward(ctx, g):
            saved = ctx.saved_tensors
            seen.extend((t.shape, t.stride(), t.storage_offset(), t.untyped_storage().data_ptr(),
                         t.clone()) for t in saved)
            return tuple(torch.full_like(t, i + 1) * g for i, t in enumerate(saved))

    def views(base):
        fused = base * 1
        q, k, v = fused.chunk(3, dim=-1)         # tile the storage: moved as one byte span
        p = (base * 2)[:, 1:].t()                # one non-dense view: packed on its own
        return [q, k, v, fused.view(-1), p]

    base = (torch.randn(6, 30, generator=gen) + torch.arange(6.0)[:, None]).requires_grad_()
    Probe.apply(*views(base)).backward()
    ref, base.grad = base.grad, None
    seen.clear()
    off = ActivationOffloader(min_tensor_bytes=0, device="cpu", keep_last=0)
    with off:
        with off.group("views"):
            saved = views(base)
            expected = [(t.shape, t.stride(), t.detach().clone()) for t in saved]
            out = Probe.apply(*saved)
        with off.group("after"):
            out = out * 1
    assert off.summary()["views"] == 6 * 30 * 4 + 6 * 29 * 4
    out.backward()
    assert ("h2d", "views") in off.transfer_log
    for (shape, stride, value), got in zip(expected[:4], seen[:4]):
        assert (got[0], got[1]) == (shape, stride) and torch.equal(got[4], value)
    assert [g[2] for g in seen[:4]] == [0, 10, 20, 0]           # offsets kept on the reload
    assert len({g[3] for g in seen[:4]}) == 1                   # one reloaded storage
    assert seen[4][1] == dense_strides_like(saved[4]) and torch.equal(seen[4][4], expected[4][2])
    assert torch.equal(base.grad, ref)


def test_abandoned_forward_is_retired(gen):
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=0)
    x = torch.randn(32, 64, generator=gen).requires_grad_()
    with off:
        with off.group("g"):
            y = torch.sin(x * 2)
    assert off.host_pool.in_use_bytes > 0
    del y                                            # graph dropped, no backward
    with off:
        pass
    assert off.host_pool.in_use_bytes == 0 and off.pending_forwards == 0


def test_num_groups_given_and_summary_table(gen):
    blocks = _blocks(gen, n=3)
    off = ActivationOffloader(min_tensor_bytes=1024, device="cpu", keep_last=2, num_groups=3)
    x0 = _input(gen)
    ref = _step(blocks, x0)
    _assert_same(_step(blocks, x0, off), ref)
    s = off.summary()
    assert s["b1"] == 0 and s["b2"] == 0 and s["b0"] == s["total"] > 0
    table = off.summary_table()
    assert "b0" in table and "total" in table and table.splitlines()[-1].split()[0] == "0"
    rows = format_bytes_table([{"a": 2**20, "total": 2**20}, {"a": 3 * 2**20, "b": 2**19,
                                                               "total": 3.5 * 2**20}])
    assert rows.splitlines()[:3] == ["offloaded MiB per group", "rank     a     b  total",
                                     "----  ----  ----  -----"]
    assert rows.splitlines()[-1].split() == ["1", "3.00", "0.50", "3.50"]


def test_host_pool():
    assert size_class(1) == 4096 and size_class(4097) == 5120 and size_class(8192) == 8192
    for n in (5000, 70_001, 1 << 20, 3 * (1 << 20) + 7):
        c = size_class(n)
        assert n <= c <= n * 1.25 + 4096
    pool = HostPool(pin_memory=False)
    a = pool.take(10_000)
    assert a.dtype == torch.uint8 and a.numel() >= 10_000
    b = pool.take(10_000)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    assert pool.take(9_500) is a and pool.allocations == 2
    with pytest.raises(ValueError, match="buf"):
        pool.give(torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="nbytes"):
        pool.take(0)
    with pytest.raises(TypeError, match="pin_memory"):
        HostPool(pin_memory="yes")
    pool.reclaim()
    assert pool.in_use_bytes == 0
    pool.release()
    assert pool.allocated_bytes == 0
    assert issubclass(CaptureError, GraphstashError)
