"""stash_activations on the GPU: CuPy kernels, pack/unpack streams, CUDA graph capture.

Acceptance checks of the stash issue: bitwise-identical loss and gradients with and without
stashing (eager and captured, 1F1B-like interleaved microbatches, random device counts),
measured memory, copies beside compute, overflow in the middle of a step, bad input.
"""
from __future__ import annotations

import pytest
import torch

import graphstash
from graphstash import CaptureError
from _capture import capture_with_output
from graphstash.models import ExpertStack, make_inputs
from graphstash.stash import StashConfig, StashManager, stash_activations

from _schedule import one_f_one_b, run_schedule

pytestmark = pytest.mark.gpu

L, B, H, FF = 8, 1024, 256, 512
MICRO, CHUNKS = 4, 2


def _setup(gen, dtype=torch.bfloat16):
    model = ExpertStack(L, H, FF, dtype=dtype, device="cuda", generator=gen)
    inputs = make_inputs(MICRO, B, H, dtype=dtype, device="cuda", generator=gen)
    counts = [[torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(L)]
              for _ in range(MICRO)]
    return model, inputs, counts


def _draw(counts, gen, low=B // 4, high=B // 2):
    for per_mb in counts:
        for c in per_mb:
            c.copy_(torch.randint(low, high + 1, (1,), generator=gen, dtype=torch.int32))


def _fill(inputs, gen):
    for x in inputs:
        fresh = make_inputs(1, B, H, dtype=x.dtype, generator=gen)[0]
        x.copy_(fresh)


def _step(model, inputs, counts, manager=None):
    order = one_f_one_b(MICRO, CHUNKS)
    if manager is not None:
        manager.begin_step()
    loss = run_schedule(model, inputs, counts, order, CHUNKS, manager)
    if manager is not None:
        manager.end_step()
    return loss


def _eager(model, inputs, counts, manager=None):
    for p in model.parameters():
        p.grad = None
    loss = _step(model, inputs, counts, manager)
    torch.cuda.synchronize()
    return loss.clone(), [p.grad.clone() for p in model.parameters()]


def _same(a, b, what):
    assert torch.equal(a[0], b[0]), f"{what}: loss {a[0]} != {b[0]}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert torch.equal(x, y), f"{what}: gradient {i} differs by {(x.float() - y.float()).abs().max()}"


def test_eager_bitwise_interleaved(gen):
    model, inputs, counts = _setup(gen)
    manager = StashManager(StashConfig(policy="always"), device="cuda")   # every group stashed
    _draw(counts, gen, B // 2, B // 2)
    _eager(model, inputs, counts, manager)                    # warmup: measures demand
    for step in range(3):
        _fill(inputs, gen)
        _draw(counts, gen)
        ref = _eager(model, inputs, counts)
        with manager.trace() as trace:
            got = _eager(model, inputs, counts, manager)
        _same(ref, got, f"eager step {step}")
        assert sum(k == "stash" for k, _ in trace.events) == MICRO * L
        assert sum(k == "prefetch" for k, _ in trace.events) >= MICRO * L - 1
    status = manager.read_status()
    assert not status["overflow"] and status["buffers"]
    assert all(b.backend == "cupy" for b in manager.buffers.values())


def test_graph_capture_replay_bitwise(gen):
    model, inputs, counts = _setup(gen)
    manager = StashManager(StashConfig(device_factor=1.25), device="cuda")
    _draw(counts, gen, B // 2, B // 2)                        # warm up at the largest counts
    graphstash.warmup()

    def stashed():
        for p in model.parameters():
            p.grad = None
        return _step(model, inputs, counts, manager)

    def plain():
        for p in model.parameters():
            p.grad = None
        return _step(model, inputs, counts)

    g_plain, loss_plain = capture_with_output(plain)
    grads_plain = [p.grad for p in model.parameters()]
    g_stash, loss_stash = capture_with_output(stashed)
    grads_stash = [p.grad for p in model.parameters()]
    for replay in range(3):
        _fill(inputs, gen)
        _draw(counts, gen)
        ref = _eager(model, inputs, counts)
        manager.clear_status()
        g_stash.replay()
        got = (loss_stash.clone(), [g.clone() for g in grads_stash])
        g_plain.replay()
        plain_out = (loss_plain.clone(), [g.clone() for g in grads_plain])
        torch.cuda.synchronize()
        _same(plain_out, got, f"replay {replay}: graphed with vs without stash")
        _same(ref, got, f"replay {replay}: graphed stash vs eager without stash")
        status = manager.read_status()
        assert not status["overflow"], status
        assert all(s["pages_in_use"] == 0 for s in status["buffers"].values())


@pytest.mark.parametrize("pool", ["shared", "per_group"])
def test_graph_overflow_mid_step_is_flagged_and_harmless(gen, pool):
    model, inputs, counts = _setup(gen)
    # shared: 12 x B rows for every group at once; per group: B / 2 rows for each group's
    # tensor of each width (NOTE [pages per group]); both hold the warmup's counts (<= B / 8)
    rows = 12 * B if pool == "shared" else B // 2
    manager = StashManager(StashConfig(initial_tokens=rows, host_tier=False, pool=pool),
                           device="cuda")
    _draw(counts, gen, B // 8, B // 8)                         # small warmup demand
    graphstash.warmup()
    sentinel = torch.randn(1 << 20, device="cuda")
    keep = sentinel.clone()
    params = [p.detach().clone() for p in model.parameters()]

    def stashed():
        for p in model.parameters():
            p.grad = None
        return _step(model, inputs, counts, manager)

    graph, loss = capture_with_output(stashed)
    grads = [p.grad for p in model.parameters()]
    manager.clear_status()
    _draw(counts, gen, B // 2, B)                             # beyond the rows of the pages
    graph.replay()
    torch.cuda.synchronize()
    status = manager.read_status()
    assert status["overflow"] and "pool" in status["overflow_reasons"]
    for s in status["buffers"].values():
        assert s["pages_in_use"] == 0 and s["demand_pages"] == 0
    assert torch.equal(sentinel, keep)
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, model.parameters()))
    # small counts again: the same graph is exact again after clearing the flags
    _draw(counts, gen, B // 16, B // 8)
    ref = _eager(model, inputs, counts)
    manager.clear_status()
    graph.replay()
    torch.cuda.synchronize()
    assert not manager.read_status()["overflow"]
    _same(ref, (loss.clone(), [g.clone() for g in grads]), "after overflow")


def test_num_tokens_must_be_a_device_tensor():
    manager = StashManager(device="cuda")
    with pytest.raises(TypeError, match=r"num_tokens: expected an int32 or int64 CUDA tensor of "
                                        r"shape \(1,\) or \(S,\), got torch.int32 on cpu"):
        with stash_activations(torch.ones(1, dtype=torch.int32), manager=manager):
            pass


def test_capture_without_warmup_raises_capture_error(gen):
    manager = StashManager(device="cuda")
    x = torch.randn(B, H, device="cuda", requires_grad=True)
    n = torch.full((1,), B // 2, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError):
        with torch.cuda.graph(graph):
            with stash_activations(n, manager=manager):
                (x * 2).exp()


def test_in_place_write_to_stashed_tensor_raises(gen):
    """The in-place check (NOTE [in-place check]) holds on the GPU path too: the stash runs
    on the pack stream, the check compares versions at unpack."""
    from graphstash import SavedTensorModifiedError, StashOverflowError

    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B), device="cuda")
    rows = torch.arange(B, dtype=torch.float32).unsqueeze(1) * 100 + torch.arange(H)
    x = (rows + torch.rand(B, H, generator=gen)).cuda().requires_grad_(True)
    n = torch.tensor([B // 3], dtype=torch.int32, device="cuda")
    manager.begin_step()
    with stash_activations(n, manager=manager, name="exp"):
        z = (x * 1).exp()
    with stash_activations(n, manager=manager, name="next"):
        pass
    z.add_(1)
    with pytest.raises(SavedTensorModifiedError, match="modified in place"):
        z.sum().backward()
    manager.end_step()                        # no overflow: nothing to report
    # an eager step that overflows is reported at end_step (NOTE [eager overflow])
    small = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=64, host_tier=False),
                         device="cuda")
    small.begin_step()
    with stash_activations(torch.tensor([B], dtype=torch.int32, device="cuda"), manager=small):
        z = (x * 1).exp()
    with stash_activations(torch.tensor([B], dtype=torch.int32, device="cuda"), manager=small):
        pass
    z.sum().backward()
    with pytest.raises(StashOverflowError):
        small.end_step()
