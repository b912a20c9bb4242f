"""stash_activations / StashManager on the CPU with the reference backend (no streams).

Gradients with stashing are compared bitwise with the same computation without it; inputs
hold values derived from their row index plus fresh noise; counts are drawn per test.
"""
from __future__ import annotations

import pytest
import torch

import graphstash
from graphstash import (CaptureError, ReleasedError, SavedTensorsError, StaleHandleError,
                        StashOverflowError)
from graphstash.models import ExpertStack, make_inputs
from graphstash.stash import (StashConfig, StashManager, current_manager,
                              stash_activations)

from _schedule import one_f_one_b, run_schedule

B, H, FF, L = 192, 16, 40, 4       # budget rows, hidden, ffn, layers


def _model(gen, layers=L, segments=1):
    return ExpertStack(layers, H, FF, segments=segments, generator=gen)


def _counts(gen, microbatches, layers=L, segments=1, low=B // 4, high=B // 2 + 1):
    return [[torch.randint(low, high, (segments,), generator=gen, dtype=torch.int32)
             for _ in range(layers)] for _ in range(microbatches)]


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _zero(model):
    for p in model.parameters():
        p.grad = None


def _run(model, inputs, counts, order, chunks, manager=None):
    _zero(model)
    if manager is not None:
        manager.begin_step()
    loss = run_schedule(model, inputs, counts, order, chunks, manager)
    if manager is not None:
        manager.end_step()
    return loss, _grads(model)


def _assert_same(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        assert torch.equal(ga, gb), f"gradient {i} differs by {(ga - gb).abs().max()}"


@pytest.mark.parametrize("segments", [1, 3])
def test_bitwise_gradients_lifo(gen, segments):
    model = _model(gen, segments=segments)
    # 2x the first step's demand: later steps draw new counts and must not overflow
    manager = StashManager(StashConfig(min_tensor_bytes=0, device_factor=2.0, policy="always"),
                           device="cpu")
    order = one_f_one_b(1, 1)
    for step in range(3):
        inputs = make_inputs(1, B, H, segments=segments, generator=gen)
        counts = _counts(gen, 1, segments=segments)
        ref = _run(model, inputs, counts, order, 1)
        _assert_same(ref, _run(model, inputs, counts, order, 1, manager))
    status = manager.read_status()
    assert not status["overflow"]
    # it really stashed: both row widths have buffers that held pages (all but the last layer),
    # one set per layer group (pool="per_group", the default), every lent page given back
    widths = sorted({k[-1] for k in manager.buffers})
    assert widths == [H, FF] and len({k[0] for k in manager.buffers}) >= 2
    assert not any(b.pages_taken for b in manager.buffers.values())
    assert all(s["peak_pages"] > 0 and s["pages_in_use"] == 0 for s in status["buffers"].values())


@pytest.mark.parametrize("prefetch", ["after_release", "at_last_unpack", "on_demand"])
def test_bitwise_gradients_interleaved_1f1b_with_prefetch(gen, prefetch):
    chunks, micro = 2, 4
    model = _model(gen)
    # Counts are drawn anew every step: a pool of 2x the first step's demand never overflows
    # (an overflowed step is untrusted and its reloads write nothing).
    manager = StashManager(StashConfig(min_tensor_bytes=0, prefetch=prefetch, device_factor=2.0,
                                         policy="always"),
                           device="cpu")
    order = one_f_one_b(micro, chunks)
    for step in range(3):
        inputs = make_inputs(micro, B, H, generator=gen)
        counts = _counts(gen, micro)
        ref = _run(model, inputs, counts, order, chunks)
        with manager.trace() as trace:
            got = _run(model, inputs, counts, order, chunks, manager)
        assert not manager.read_status()["overflow"]
        _assert_same(ref, got)
        if step == 2:
            trace = trace.events
            stashed = [g for kind, g in trace if kind == "stash"]
            prefetched = [g for kind, g in trace if kind == "prefetch"]
            on_demand = [g for kind, g in trace if kind == "reload"]
            # every layer group of every microbatch (no forward is followed by its own backward)
            assert len(stashed) == micro * L
            assert sorted(prefetched + on_demand) == sorted(stashed)
            if prefetch == "on_demand":          # none ahead
                assert not prefetched, trace
                continue
            # every reload but one is issued ahead by the recorded schedule
            assert len(on_demand) <= 1, trace
            # reloads are not LIFO with respect to stashes
            reloads = [g for kind, g in trace if kind != "stash"]
            assert reloads != list(reversed(stashed))
    schedule = manager.schedule
    assert [e[0] for e in schedule].count("B") == micro * L


class _LoggedSave(torch.autograd.Function):
    """``x * 2``, saving ``x``; its backward unpacks ``x`` then logs ``("bwd", label)``."""

    @staticmethod
    def forward(ctx, x, log, label):
        ctx.save_for_backward(x)
        ctx.log, ctx.label = log, label
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        ctx.log.append(("bwd", ctx.label))
        return grad * 2 + 0 * x, None, None


@pytest.mark.parametrize("prefetch", ["after_release", "at_last_unpack", "on_demand"])
def test_prefetch_point(gen, prefetch):
    """The next group's reload is issued after the backward op holding the group's last saved
    tensor ran (after_release), or as that tensor is unpacked, before the op (at_last_unpack),
    or only when the group's own backward unpacks it (on_demand)."""
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B,
                                       prefetch=prefetch), device="cpu")
    n = torch.tensor([B // 3])
    x = torch.rand(B, 6, generator=gen, requires_grad=True)
    for step in range(2):                  # the first step records the schedule
        with manager.trace() as trace:
            log = trace.events             # the backward's own entries go in between
            manager.begin_step()
            h = x * 1
            for label in range(3):
                with stash_activations(n, manager=manager, name=f"g{label}"):
                    h = _LoggedSave.apply(h, log, label)
            h.sum().backward()
            manager.end_step()
    log = [e for e in log if e[0] != "stash"]
    if prefetch == "after_release":
        assert log == [("bwd", 2), ("prefetch", 1), ("bwd", 1), ("prefetch", 0), ("bwd", 0)]
    elif prefetch == "on_demand":
        assert log == [("bwd", 2), ("reload", 1), ("bwd", 1), ("reload", 0), ("bwd", 0)]
    else:
        assert log == [("prefetch", 1), ("bwd", 2), ("prefetch", 0), ("bwd", 1), ("bwd", 0)]


def test_first_step_measures_demand_then_sizes(gen):
    model = _model(gen)
    config = StashConfig(min_tensor_bytes=0, page_size=16, device_factor=1.5, pool="shared")
    manager = StashManager(config, device="cpu")
    inputs = make_inputs(1, B, H, generator=gen)
    counts = _counts(gen, 1)
    order = one_f_one_b(1, 1)
    ref = _run(model, inputs, counts, order, 1)
    _assert_same(ref, _run(model, inputs, counts, order, 1, manager))
    assert manager.buffers == {}                       # warmup: nothing stashed yet
    status = manager.read_status()
    # demand of the layers that will be stashed (all but the last, NOTE [last group kept])
    n = [int(c) for c in counts[0]]
    pages = sum(-(-k // 16) for k in n[:-1])
    assert status["demand"] == {"float32[16]": pages, "float32[40]": 2 * pages}
    assert sorted(status["unsized"]) == ["float32[16]", "float32[40]"]
    _assert_same(ref, _run(model, inputs, counts, order, 1, manager))   # sized at begin_step
    bufs = manager.buffers
    assert bufs[(torch.float32, 16)].num_device_pages == -(-int(1.5 * pages * 100) // 100)
    assert bufs[(torch.float32, 40)].num_device_pages == 3 * pages
    st = manager.read_status()["buffers"]["float32[40]"]
    assert st["peak_demand_pages"] == 2 * pages and st["pages_in_use"] == 0
    assert manager.size_from_demand() is False          # nothing grew


def test_initial_tokens_stashes_from_the_first_step(gen):
    model = _model(gen)
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=8 * B, pool="shared"),
                           device="cpu")
    inputs, counts, order = make_inputs(1, B, H, generator=gen), _counts(gen, 1), one_f_one_b(1, 1)
    ref = _run(model, inputs, counts, order, 1)
    _assert_same(ref, _run(model, inputs, counts, order, 1, manager))
    assert {k: b.max_tokens for k, b in manager.buffers.items()} == \
        {(torch.float32, H): 8 * B, (torch.float32, FF): 8 * B}
    status = manager.read_status()
    assert not status["overflow"] and status["buffers"]["float32[16]"]["peak_pages"] > 0


def test_reloaded_tensor_holds_live_rows_and_zero_tail(gen):
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=1024), device="cpu")
    seen = {}

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen["x"], seen["y"] = ctx.saved_tensors
            return g, None

    rows = torch.arange(B, dtype=torch.float32).unsqueeze(1)
    x = (rows * 1000 + torch.arange(6)).requires_grad_(False) + torch.rand(B, 6, generator=gen)
    x = x.clone().requires_grad_(True)
    base = x * 1                          # non-leaf, [B, 6]: stashed
    other = torch.randn(B + 1, 3, generator=gen)     # not budget-shaped: kept
    n = int(torch.randint(1, B, (1,), generator=gen))
    manager.begin_step()
    with stash_activations(torch.tensor([n]), manager=manager):
        out = Save.apply(base, other)
    with stash_activations(torch.tensor([n]), manager=manager):   # a later group retires it
        pass
    out.sum().backward()
    manager.end_step()
    assert seen["y"].data_ptr() == other.data_ptr() and torch.equal(seen["y"], other)   # kept
    assert torch.equal(seen["x"][:n], base[:n].detach())
    assert torch.equal(seen["x"][n:], torch.zeros(B - n, 6))


def test_filter_leaves_params_small_marked_and_odd_tensors(gen):
    manager = StashManager(StashConfig(min_tensor_bytes=1024, initial_tokens=1024), device="cpu")
    saved = {}

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            ctx.save_for_backward(*ts)
            return ts[0].sum()

        @staticmethod
        def backward(ctx, g):
            saved["ts"] = ctx.saved_tensors
            return (None,) * len(saved["ts"])

    param = torch.nn.Parameter(torch.randn(B, 8, generator=gen))
    small = torch.randn(B, 1, generator=gen) + 1            # 768 bytes < 1024
    marked = graphstash.mark_not_movable(torch.randn(B, 8, generator=gen) + 2)
    strided = (torch.randn(8, B, generator=gen) + 3).t()      # [B, 8] not contiguous
    big = torch.randn(B, 8, generator=gen) + 4                 # stashed
    other = torch.randn(B - 1, 8, generator=gen) + 5           # not the budget
    ts = (param, small, marked, strided, big, other)
    n = torch.tensor([B // 3])
    with stash_activations(n, manager=manager):
        out = Save.apply(*ts)
    out.backward()
    manager.end_step()
    got = saved["ts"]
    for i in (0, 1, 2, 3, 5):        # left alone: the same memory comes back
        assert got[i].data_ptr() == ts[i].data_ptr(), f"tensor {i} should have been left alone"
    assert got[4].data_ptr() != big.data_ptr() and torch.equal(got[4][: B // 3], big[: B // 3])
    assert list(manager.buffers) == [(0, torch.float32, 8)]     # group 0's own buffer


@pytest.mark.parametrize("pinned", [True, False])
def test_max_tokens_pins_the_budget(gen, pinned):
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=1024), device="cpu")
    big = torch.randn(3 * B, 4, generator=gen, requires_grad=True) * 1    # most bytes
    small = torch.randn(B, 4, generator=gen, requires_grad=True) * 1
    n = torch.tensor([B // 2 + 7])
    with stash_activations(n, manager=manager, max_tokens=B if pinned else None):
        out = (big[:B] * small).sum() + big.square().sum()    # saves big[:B], small, big
    with stash_activations(n, manager=manager):
        pass
    pages = -(-(B // 2 + 7) // 64)
    status = manager.read_status()["buffers"]["#0 float32[4]"]
    # pinned: big[:B] and small ([B, 4]) are stashed; inferred: big ([3B, 4]) alone
    assert status["pages_in_use"] == (2 * pages if pinned else pages)
    out.backward()
    manager.end_step()
    assert manager.read_status()["buffers"]["#0 float32[4]"]["pages_in_use"] == 0


def test_nested_same_manager_uses_inner_counts(gen):
    model_outer = torch.nn.Parameter(torch.randn(H, H, generator=gen) / 4)
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4096), device="cpu")
    x = make_inputs(1, B, H, generator=gen)[0]
    xs = make_inputs(1, 24, H, segments=3, generator=gen)[0]
    n = torch.tensor([B // 3], dtype=torch.int32)
    ns = torch.tensor([5, 0, 24], dtype=torch.int64)

    def f(stash):
        model_outer.grad = None
        ctx = stash_activations(n, manager=manager) if stash else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            a = torch.tanh(x @ model_outer)
            inner = stash_activations(ns, manager=manager) if stash else ctx
            with inner:
                b = torch.tanh(xs @ model_outer)
        mask = (torch.arange(B) < n).float().unsqueeze(1)
        masks = (torch.arange(24).unsqueeze(0) < ns.unsqueeze(1)).float().unsqueeze(2)
        loss = (a * mask).sum() + (b * masks).square().sum()
        loss.backward()
        return loss, model_outer.grad.clone()

    ref = f(False)
    manager.begin_step()
    got = f(True)
    manager.end_step()
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert manager.read_status()["tokens_peak"] == B // 3       # the [S, cap] stash counted 29


def test_overflow_mid_step_sets_flags_and_corrupts_nothing(gen):
    model = _model(gen)
    config = StashConfig(min_tensor_bytes=0, page_size=16, initial_tokens=48, host_tier=False)
    manager = StashManager(config, device="cpu")
    inputs, order = make_inputs(1, B, H, generator=gen), one_f_one_b(1, 1)
    counts = _counts(gen, 1, low=B // 2, high=B)         # needs far more than 3 pages
    sentinel = torch.randn(64, 64, generator=gen)
    keep = sentinel.clone()
    params = [p.detach().clone() for p in model.parameters()]
    _zero(model)
    manager.begin_step()
    run_schedule(model, inputs, counts, order, 1, manager)    # must not raise
    with pytest.raises(StashOverflowError, match="overflowed \\(the pool was too small\\)"):
        manager.end_step()                                    # NOTE [eager overflow]
    status = manager.read_status()
    assert status["overflow"] and status["overflow_reasons"] == ["pool"]
    for s in status["buffers"].values():
        assert s["pages_in_use"] == 0 and s["demand_pages"] == 0   # rings consistent
    assert torch.equal(sentinel, keep)
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, model.parameters()))
    # grow from the measured demand; the next step is exact again
    assert manager.size_from_demand() is True
    manager.clear_status()
    ref = _run(model, inputs, counts, order, 1)
    _assert_same(ref, _run(model, inputs, counts, order, 1, manager))
    assert not manager.read_status()["overflow"]


def test_host_tier_spill_is_exact(gen):
    model = _model(gen)
    config = StashConfig(min_tensor_bytes=0, device_factor=0.4, host_factor=0.8)
    manager = StashManager(config, device="cpu")
    inputs, counts, order = make_inputs(1, B, H, generator=gen), _counts(gen, 1), one_f_one_b(1, 1)
    ref = _run(model, inputs, counts, order, 1)
    _run(model, inputs, counts, order, 1, manager)          # warmup: measures demand
    _assert_same(ref, _run(model, inputs, counts, order, 1, manager))
    status = manager.read_status()
    assert status["host_spill"] and not status["overflow"]
    assert all(b.num_host_pages > 0 for b in manager.buffers.values())


def test_dropless_mode_is_a_no_op(gen):
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=1024), device="cpu")
    x = torch.randn(B, 4, generator=gen, requires_grad=True) * 1
    with graphstash.dropless():
        with stash_activations(4.5, manager=manager):       # not even validated
            y = x.exp()
    y.sum().backward()
    assert manager.buffers == {}


def test_bad_num_tokens():
    manager = StashManager(device="cpu")
    with pytest.raises(TypeError, match=r"num_tokens: expected an int32 or int64 cpu tensor.*"
                                        r"got torch.float32 on cpu"):
        with stash_activations(torch.tensor([3.0]), manager=manager):
            pass
    with pytest.raises(TypeError, match="num_tokens: .* got int"):
        with stash_activations(3, manager=manager):
            pass
    with pytest.raises(ValueError, match=r"num_tokens: .*shape \(2, 1\)"):
        with stash_activations(torch.ones(2, 1, dtype=torch.int32), manager=manager):
            pass
    with pytest.raises(TypeError, match="max_tokens"):
        with stash_activations(torch.ones(1, dtype=torch.int32), manager=manager, max_tokens=2.0):
            pass


def test_manager_resolution_and_nesting_errors():
    a, b = StashManager(device="cpu"), StashManager(device="cpu")
    n = torch.ones(1, dtype=torch.int32)
    assert current_manager() is None
    with pytest.raises(ValueError, match="manager: no StashManager"):
        with stash_activations(n):
            pass
    with a:
        assert current_manager() is a
        with stash_activations(n):
            with pytest.raises(SavedTensorsError, match="do not nest"):
                with stash_activations(n, manager=b):
                    pass
            with stash_activations(n, manager=a):        # same manager nests
                pass
    assert current_manager() is None
    with pytest.raises(TypeError, match="manager: expected a graphstash.StashManager"):
        with stash_activations(n, manager="cpu"):
            pass


def _one_stashed_group(manager, gen):
    x = torch.randn(B, 8, generator=gen, requires_grad=True) * 1
    with stash_activations(torch.tensor([B // 2]), manager=manager):
        y = x.exp()
    with stash_activations(torch.tensor([B // 2]), manager=manager):
        pass
    return y


def test_per_group_pages_exist_from_the_stash_until_the_reload(gen):
    """NOTE [pages per group]: a group's lent pages are taken when its stash is issued and
    given back when its reload was waited for; its rows come back as they were."""
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=1024), device="cpu")
    manager.begin_step()
    x = torch.randn(B, 8, generator=gen, requires_grad=True)
    with stash_activations(torch.tensor([B // 2]), manager=manager):
        y = x.exp()                                      # saves exp(x): [B, 8]
    (key, buf), = manager.buffers.items()                # its stash was issued at the exit
    assert key == (0, torch.float32, 8) and buf.pages_taken and buf.pages_ptr != 0
    with stash_activations(torch.tensor([B // 2]), manager=manager):
        pass                                             # a schedule point: group 0 is away
    assert manager.read_status()["buffers"]["#0 float32[8]"]["pages_in_use"] == -(-(B // 2) // 64)
    (y[: B // 2].sum()).backward()                      # the reload, then the pages go back
    assert not buf.pages_taken and buf.pages_ptr == 0
    assert torch.equal(x.grad[: B // 2], x[: B // 2].exp())
    manager.end_step()
    with pytest.raises(ReleasedError, match="take_pages"):
        buf.stash(torch.zeros(B, 8), torch.tensor([1]))


def test_lent_pages_misuse_names_the_call():
    held = graphstash.PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="holds its pages"):
        held.take_pages()
    lent = graphstash.PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", lend_pages=True)
    assert not lent.pages_taken and lent.device_bytes < held.device_bytes
    lent.take_pages()
    with pytest.raises(ValueError, match="taken already"):
        lent.take_pages()
    lent.give_pages_back()
    lent.give_pages_back()                                # a no-op
    with pytest.raises(TypeError, match="lend_pages"):
        graphstash.PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", lend_pages=1)


def test_bad_pool_names_the_field():
    with pytest.raises(ValueError, match="pool"):
        StashConfig(pool="global")


@pytest.mark.parametrize("pool", ["per_group", "shared"])
def test_reload_after_reset_or_release_is_a_clear_error(gen, pool):
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=1024, pool=pool),
                           device="cpu")
    manager.begin_step()
    y = _one_stashed_group(manager, gen)
    manager.begin_step()                                 # the rings were reset under it
    with pytest.raises(StaleHandleError, match="before the manager's last begin_step"):
        y.sum().backward()
    y = _one_stashed_group(manager, gen)
    manager.release()
    with pytest.raises(ReleasedError, match="was released"):
        y.sum().backward()
    with pytest.raises(ReleasedError, match="reallocate"):
        _one_stashed_group(manager, gen)
    manager.reallocate()
    y = _one_stashed_group(manager, gen)
    y.sum().backward()                                   # works again
    (key, buf), = manager.buffers.items()
    name = "float32[8]" if pool == "shared" else "#0 float32[8]"
    assert key[-2:] == (torch.float32, 8) and buf.max_tokens == 1024
    assert manager.read_status()["buffers"][name]["pages_in_use"] == 0


def test_status_is_shared_and_clear_status():
    status = graphstash.new_status("cpu")
    manager = StashManager(StashConfig(initial_tokens=64), device="cpu", status=status)
    assert manager.status is status
    status[2] = 1                                          # e.g. MoE over budget
    assert manager.read_status()["over_budget"]
    manager.clear_status()
    assert not manager.read_status()["over_budget"]
    with pytest.raises(ValueError, match="status"):
        StashManager(device="cpu", status=torch.zeros(8, dtype=torch.int64))


def test_config_validation():
    with pytest.raises(ValueError, match="page_size"):
        StashManager(StashConfig(page_size=0), device="cpu")
    with pytest.raises(ValueError, match="device_factor"):
        StashManager(StashConfig(device_factor=-1.0), device="cpu")
    with pytest.raises(TypeError, match="host_tier"):
        StashManager(StashConfig(host_tier=1), device="cpu")
    with pytest.raises(ValueError, match="backend"):
        StashManager(StashConfig(backend="triton"), device="cpu")
    with pytest.raises(TypeError, match="config"):
        StashManager({"page_size": 64}, device="cpu")
    with pytest.raises(ValueError, match="copy_blocks: expected an int >= 0, got -1"):
        StashManager(StashConfig(copy_blocks=-1), device="cpu")
    with pytest.raises(ValueError, match="prefetch: expected one of"):
        StashManager(StashConfig(prefetch="eager"), device="cpu")


def test_zero_tail_and_copy_blocks_reach_the_buffers(monkeypatch, gen):
    """stash_activations(zero_tail=False) reloads without zero-filling; copy_blocks caps the
    grid of every stash and reload (0: no cap)."""
    model = _model(gen, layers=3)
    inputs = make_inputs(1, B, H, generator=gen)
    counts = _counts(gen, 1, layers=3)
    with pytest.raises(TypeError, match="zero_tail: expected a bool, got int"):
        with stash_activations(counts[0][0], manager=StashManager(device="cpu"), zero_tail=1):
            pass
    for blocks, expected in ((0, None), (5, 5)):
        manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B,
                                           copy_blocks=blocks), device="cpu")   # never overflows
        calls = []
        from graphstash.paging import PagedStashBuffer
        real_stash, real_reload = PagedStashBuffer.stash, PagedStashBuffer.reload

        def stash(self, x, n, **kw):
            calls.append(("stash", kw))
            return real_stash(self, x, n, **kw)

        def reload(self, h, **kw):
            calls.append(("reload", kw))
            return real_reload(self, h, **kw)

        monkeypatch.setattr(PagedStashBuffer, "stash", stash)
        monkeypatch.setattr(PagedStashBuffer, "reload", reload)
        model.zero_tail = False
        _run(model, inputs, counts, [("F", 0, 0), ("B", 0, 0)], 1, manager)
        model.zero_tail = True
        monkeypatch.undo()
        assert {k for k, _ in calls} == {"stash", "reload"}
        assert all(kw["max_blocks"] == expected for _, kw in calls)
        assert all(kw["zero_tail"] is False for k, kw in calls if k == "reload")


def test_capture_error_is_raised_before_anything_breaks(monkeypatch, gen):
    # Stand-in for a capturing stream: sizing and warmup reads must refuse to run.
    import graphstash.stash.buffers as buffers_mod
    import graphstash.stash.scheduler as scheduler_mod
    manager = StashManager(StashConfig(min_tensor_bytes=0), device="cpu")
    monkeypatch.setattr(scheduler_mod, "is_capturing", lambda: True)     # demand read back
    monkeypatch.setattr(buffers_mod, "is_capturing", lambda: True)       # buffer created
    x = torch.randn(B, 8, generator=gen, requires_grad=True) * 1
    with pytest.raises(CaptureError, match="warmup step"):
        with stash_activations(torch.tensor([3]), manager=manager):
            x.exp()
    manager2 = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=64), device="cpu")
    with pytest.raises(CaptureError, match="created while a CUDA graph is capturing"):
        with stash_activations(torch.tensor([3]), manager=manager2):
            x.exp()


def test_kept_tensors_are_freed_without_the_cycle_collector(gen):
    """NOTE [entry cycle]: after backward no Group (and so no kept tensor) waits for gc."""
    import gc

    from graphstash.stash._group import Group

    model = _model(gen)
    manager = StashManager(StashConfig(min_tensor_bytes=0), device="cpu")
    inputs = make_inputs(1, B, H, generator=gen)
    counts = _counts(gen, 1)
    order = one_f_one_b(1, 1)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):      # warmup (everything kept), then stashed with the last group kept
            _run(model, inputs, counts, order, 1, manager)
        alive = [o for o in gc.get_objects()
                 if type(o) is Group and o.scheduler is manager.scheduler]
    finally:
        if enabled:
            gc.enable()
    assert manager.buffers and manager.schedule
    assert alive == [], f"{len(alive)} groups are only reachable through reference cycles"
