"""``graphstash.memory`` and ``graphstash memory`` on the CPU (storage tracking), plus the
CUDA path (allocator history), which the ``gpu`` tests cover."""
from __future__ import annotations

import pytest
import torch

import graphstash
from graphstash import _layout as L
from graphstash.memory import OWNERS, profile, static_footprint
from graphstash.models import MoEConfig, MoEModel


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _hand_static(model, opt) -> tuple[int, int, int]:
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return (_bytes(params), _bytes(p.grad for p in params if p.grad is not None), _bytes(state))


def _check_adds_up(report) -> None:
    totals = report.owner_totals
    assert set(totals) == set(OWNERS)
    assert sum(totals.values()) == report.peak
    assert sum(n for _, _, n, _ in report.rows) == report.peak
    xs, series = report.timeline()
    at_peak = report.peak_event + 1
    assert sum(series[o][at_peak] for o in OWNERS) == report.peak
    assert max(sum(series[o][i] for o in OWNERS) for i in range(len(xs))) == report.peak


# ---- exact byte counts --------------------------------------------------------------------
def test_peak_of_known_allocations_is_exact(gen):
    """Row i of x holds values derived from i; the step's storages have sizes known by hand."""
    n, k, m = (int(v) for v in torch.randint(17, 97, (3,), generator=gen))
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1) + torch.rand(n, k, generator=gen)
    w = torch.randn(k, m, generator=gen)

    def step(x, w):
        a = x @ w                 # n*m floats
        b = a.relu()              # n*m
        del a
        c = b * 2                 # n*m, beside b
        return c.sum()            # 4 bytes, beside b and c

    report = profile(step, x, w)
    inputs = _bytes([x, w])
    assert report.peak == inputs + 2 * n * m * 4 + 4
    _check_adds_up(report)
    totals = report.owner_totals
    assert totals["inputs"] == inputs
    assert totals["temporaries"] == 2 * n * m * 4 + 4
    details = {d for o, d, _, _ in report.rows if o == "temporaries"}
    assert details == {"aten.relu (forward)", "aten.mul (forward)", "aten.sum (forward)"}
    assert report.static_bytes == 0 and report.activation_peak == report.peak
    assert report.allocator_peak is None


def test_saved_activations_by_layer_and_temporaries_by_op(gen):
    n, a, b, c = 64, 24, 40, 8
    torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    model = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(n, a, generator=gen)

    def step(x):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    report = profile(step, x, model=model, optimizer=opt, warmup=1)
    _check_adds_up(report)
    by_detail = {}
    for blk in report.blocks:
        by_detail.setdefault((blk.owner, blk.detail), []).append(blk.nbytes)
    # ReLU keeps its output (and the second Linear its input: the same tensor); the second
    # Linear's output is kept by pow. The first Linear's output is a forward temporary.
    assert by_detail[("saved activations", "1")] == [n * b * 4]
    assert by_detail[("saved activations", "2")] == [n * c * 4]
    assert n * b * 4 in by_detail[("temporaries", "aten.addmm (forward)")]
    assert any(o == "temporaries" and d.endswith("(backward)") for o, d in by_detail)
    assert report._where_peak() == "step 1: backward"


# ---- owners of the reference MoE model ------------------------------------------------------
def _moe(mode: str, gen, layers: int = 2):
    config = MoEConfig(hidden=32, ffn=64, num_experts=4, topk=2, layers=layers, num_tokens=96,
                       capacity_factor=1.5, pad_multiple=8)
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32)
    manager = None
    if mode == "stash":
        # Every group stashed whatever it saves: the test is about who owns what.
        stash = graphstash.StashConfig(host_tier=False, min_tensor_bytes=0, policy="always")
        manager = graphstash.StashManager(stash, device="cpu", status=status)
    seed = int(torch.randint(0, 2 ** 31, (1,), generator=gen))
    model = MoEModel(config, mode=mode, stash_manager=manager, status=status, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(config.num_tokens, config.hidden, generator=gen)
    return model, opt, manager, x


def _moe_step(model, opt, manager, set_to_none: bool):
    def step(x):
        opt.zero_grad(set_to_none=set_to_none)
        if manager is None:
            model(x).pow(2).mean().backward()
        else:
            with manager:
                manager.begin_step()
                model(x).pow(2).mean().backward()
                manager.end_step()
        opt.step()
    return step


@pytest.mark.parametrize("mode", [pytest.param("dropless", marks=pytest.mark.slow),
                                  "budget", "stash"])
def test_moe_owner_totals_match_the_model(gen, mode):
    model, opt, manager, x = _moe(mode, gen)
    step = _moe_step(model, opt, manager, set_to_none=False)
    # Two warmup steps: the first measures the stash demand, the second sizes the pool.
    report = profile(step, x, model=model, optimizer=opt, stash_manager=manager, warmup=2)
    _check_adds_up(report)
    params, grads, state = _hand_static(model, opt)
    totals = report.owner_totals
    assert totals["parameters"] == params
    assert totals["gradients"] == grads == params         # kept across the step: zeroed
    assert totals["optimizer state"] == state
    assert totals["inputs"] == _bytes([x])
    assert report.static_bytes == params + grads + state == static_footprint(model, opt)
    assert report.activation_peak == report.peak - report.static_bytes > 0
    saved = {d for o, d, _, _ in report.rows if o == "saved activations"}
    if mode == "stash":
        pool = sum(b.device_bytes for b in manager.buffers.values())
        assert pool > 0 and pool <= totals["stash pool"] <= pool + 1024
        assert "reloaded from the stash pool" in {blk.detail for blk in report.blocks}
    else:
        assert totals["stash pool"] == 0
        assert "blocks.0" in saved
    assert totals["CUDA-graph pool"] == totals["other"] == 0


def test_gradients_dropped_by_the_step_are_not_kept_alive(gen):
    """zero_grad(set_to_none=True) frees last step's gradients: at a peak in the backward
    only the gradients made so far are alive (the recorder must hold no reference)."""
    model, opt, manager, x = _moe("budget", gen)
    step = _moe_step(model, opt, manager, set_to_none=True)
    report = profile(step, x, model=model, optimizer=opt, warmup=1)
    _check_adds_up(report)
    params, grads, state = _hand_static(model, opt)
    assert report._where_peak() == "step 1: backward"
    assert report.owner_totals["gradients"] < grads
    assert report.static_bytes == params + grads + state
    freed = [b for b in report.blocks if b.owner == "gradients" and b.start < 0]
    assert freed and all(b.end is not None for b in freed)


def test_several_steps_and_optimizer_phase(gen):
    model, opt, manager, x = _moe("budget", gen, layers=1)
    step = _moe_step(model, opt, manager, set_to_none=True)
    two = profile(step, x, model=model, optimizer=opt, warmup=1, steps=2)
    _check_adds_up(two)
    # The same step twice: each step's highest point is the same.
    _, series = two.timeline()
    totals = [sum(series[o][i] for o in OWNERS) for i in range(len(series[OWNERS[0]]))]
    second = next(event for event, label in two.marks if label == "step 2: forward")
    assert max(totals[:second + 1]) == max(totals[second + 1:]) == two.peak
    labels = [label for _, label in two.marks]
    assert "step 2: forward" in labels and "step 2: backward" in labels
    assert "step 2: optimizer" in labels
    assert any(b.detail.endswith("(optimizer)") for b in two.blocks)


# ---- bad arguments --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(steps=0), ValueError, "steps"),
    (dict(steps=1.5), TypeError, "steps"),
    (dict(warmup=-1), ValueError, "warmup"),
    (dict(model="model"), TypeError, "model"),
    (dict(optimizer=object()), TypeError, "optimizer"),
    (dict(stash_manager=3), TypeError, "stash_manager"),
    (dict(capture=True), ValueError, "capture"),
    (dict(capture="yes"), TypeError, "capture"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(max_entries=0), ValueError, "max_entries"),
])
def test_profile_names_bad_arguments(kwargs, exc, name):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(exc, match=name):
        profile(lambda: None, **kwargs)


def test_profile_and_static_footprint_name_bad_callables_and_models():
    with pytest.raises(TypeError, match="step_fn"):
        profile("step")
    with pytest.raises(TypeError, match="model"):
        static_footprint(object())
    with pytest.raises(TypeError, match="optimizer"):
        static_footprint(torch.nn.Linear(2, 2), optimizer="adam")
    with pytest.raises(ValueError, match="device"):
        static_footprint(torch.nn.Linear(2, 2), device="no such device")


# ---- the allocator trace replay and its pairing with storages (pure Python) -----------------
def test_trace_replay_counts_blocks_from_alloc_to_free_requested(gen):
    from graphstash.memory._allocator import _replay

    base = 1 << 40
    sizes = [int(v) * 512 for v in torch.randint(1, 64, (4,), generator=gen)]
    before = [(base, sizes[0])]                            # allocated before the recording
    trace = [
        {"action": "alloc", "addr": base + 4096 * 1, "size": sizes[1], "time_us": 10},
        {"action": "segment_alloc", "addr": base + (1 << 30), "size": 1 << 21, "time_us": 11},
        {"action": "alloc", "addr": base + 4096 * 2, "size": sizes[2], "time_us": 12},
        {"action": "free_requested", "addr": base, "size": sizes[0], "time_us": 13},
        {"action": "free_completed", "addr": base, "size": sizes[0], "time_us": 14},
        {"action": "free_requested", "addr": base + 4096 * 1, "size": sizes[1], "time_us": 15},
        {"action": "alloc", "addr": base + 4096 * 1, "size": sizes[3], "time_us": 16},
        # the same address again without a recorded free: the older block ends here
        {"action": "alloc", "addr": base + 4096 * 1, "size": sizes[1], "time_us": 17},
    ]
    blocks, events, times = _replay(before, trace)
    assert [(b.addr - base, b.nbytes, b.start, b.end) for b in blocks] == [
        (0, sizes[0], -1, 2), (4096, sizes[1], 0, 3), (8192, sizes[2], 1, None),
        (4096, sizes[3], 4, 5), (4096, sizes[1], 6, None)]
    assert events == [(1, 1), (2, 1), (0, -1), (1, -1), (3, 1), (3, -1), (4, 1)]
    assert times == [10, 12, 13, 15, 16, 17, 17]


def test_storages_pair_with_the_block_closest_in_time(gen):
    from graphstash.memory._allocator import TraceBlock, match_records
    from graphstash.memory._storage import StorageRecord

    offset = int(torch.randint(-10 ** 6, 10 ** 6, (1,), generator=gen))   # clock difference
    blocks = [TraceBlock(0xA000, 512, 0, 1, t_alloc_us=100 + offset, t_free_us=105 + offset),
              TraceBlock(0xA000, 512, 2, 3, t_alloc_us=108 + offset, t_free_us=150 + offset),
              TraceBlock(0xA000, 1024, 4, None, t_alloc_us=160 + offset),
              TraceBlock(0xB000, 256, 5, None, t_alloc_us=161 + offset),
              TraceBlock(0xC000, 256, -1, None)]
    dev = torch.device("cuda", 0)
    records = [StorageRecord((dev, 0xA000), 512, 0, 1, t_alloc_us=109, t_free_us=151),
               StorageRecord((dev, 0xA000), 1024, 2, None, t_alloc_us=161),
               StorageRecord((dev, 0xB000), 256, 3, None, t_alloc_us=162),
               StorageRecord((dev, 0xC000), 256, -1)]          # existed before: not paired
    matched, close, found_offset = match_records(blocks, records)
    assert matched == {1: records[0], 2: records[1], 3: records[2]}
    assert close == 1.0 and found_offset == offset - 1     # the one storage alone at its address


def test_allocator_blocks_take_the_owners_of_their_storages(gen):
    """The CUDA path's owner assignment, fed with an allocator trace built from a CPU
    recording: every storage's block gets the owner the CPU path gives the storage; a block
    no tensor came from is an op's scratch; older blocks in a graph pool belong to it."""
    from graphstash.memory import _cpu_block, _cuda_blocks
    from graphstash.memory._allocator import AllocatorRecording, TraceBlock, match_records
    from graphstash.memory._report import backward_starts
    from graphstash.memory._static import owner_map
    from graphstash.memory._storage import StorageRecorder

    model, opt, manager, x = _moe("budget", gen, layers=1)
    step = _moe_step(model, opt, manager, set_to_none=True)
    step(x)
    cpu = torch.device("cpu")
    recorder = StorageRecorder(cpu, root=model)
    recorder.start()
    recorder.begin_step()
    step(x)
    recorder.stop()
    offset = int(torch.randint(1, 10 ** 6, (1,), generator=gen))    # the allocator's clock
    blocks = [TraceBlock(1 << 50, 4096, -1, None, in_graph_pool=True)]
    events, times, of_record = [], [], {}
    for index, delta in recorder.events:
        rec = recorder.records[index]
        if delta > 0:
            of_record[index] = len(blocks)
            blocks.append(TraceBlock(rec.key[1], rec.nbytes, len(events),
                                     t_alloc_us=rec.t_alloc_us + offset))
            if len(of_record) == 3:       # an op's scratch block, right after its output
                blocks.append(TraceBlock((1 << 50) + 4096, 512, len(events) + 1, len(events) + 2,
                                         t_alloc_us=rec.t_alloc_us + offset,
                                         t_free_us=rec.t_alloc_us + offset,
                                         frames=[{"filename": "/src/kernels.py", "line": 7,
                                                  "name": "launch"}]))
                events += [(len(blocks) - 1, 1), (len(blocks) - 1, -1)]
                times += [blocks[-1].t_alloc_us] * 2
        else:
            block = blocks[of_record[index]]
            block.end, block.t_free_us = len(events), rec.t_free_us + offset
        events.append((of_record[index], delta))
        times.append(blocks[of_record[index]].t_alloc_us)
    recording = AllocatorRecording(blocks, events, 0, False, times)
    end_owners = owner_map(model, opt, None, (x,))
    starts = backward_starts(recorder.marks)
    matched, close, found_offset = match_records(blocks, recorder.records)
    assert close == 1.0 and found_offset == offset
    got = _cuda_blocks(recording, matched, {}, end_owners, starts, cpu)
    assert (got[0].owner, got[0].detail) == ("CUDA-graph pool", "allocated before the step")
    scratch = [b for b in got if b.detail.startswith("inside an op")]
    assert [b.detail for b in scratch] == ["inside an op: kernels.py:7 launch"]
    for index, block_index in of_record.items():
        want = _cpu_block(recorder.records[index], {}, end_owners, starts)
        assert (got[block_index].owner, got[block_index].detail) == (want.owner, want.detail)
    owners = {b.owner for b in got}
    assert {"gradients", "saved activations", "temporaries"} <= owners


# ---- CUDA -----------------------------------------------------------------------------------
def _cuda_moe(mode: str, layers: int = 2):
    dev = torch.device("cuda", torch.cuda.current_device())
    config = MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=layers,
                       num_tokens=1024, capacity_factor=2.0, pad_multiple=16)
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=dev)
    manager = None
    if mode == "stash":
        manager = graphstash.StashManager(graphstash.StashConfig(host_tier=False,
                                                                 policy="always"),
                                          device=dev, status=status)
    model = MoEModel(config, mode=mode, stash_manager=manager, status=status,
                     seed=0).to(dev, torch.bfloat16)
    graphed = mode != "dropless"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graphed)
    x = torch.randn(config.num_tokens, config.hidden, device=dev).to(torch.bfloat16)
    return dev, model, opt, manager, x


def _block_bound(requested: int) -> int:
    """The largest block the caching allocator hands out for ``requested`` bytes: rounded up
    to 512 bytes, plus an unsplit remainder below 1 MiB for large blocks."""
    rounded = -(-requested // 512) * 512
    return rounded + ((1 << 20) if requested > (1 << 20) else 0)


def _check_cuda(report, model, opt) -> None:
    import dataclasses

    from graphstash.memory._report import peak_of

    _check_adds_up(report)
    # The replay counts requested bytes, the allocator whole blocks (NOTE [trace accounting]):
    # its peak lies between ours and that of the same replay with every block at its largest.
    largest = [dataclasses.replace(b, nbytes=_block_bound(b.nbytes)) for b in report.blocks]
    bound, _ = peak_of(largest, report.events)
    assert report.peak <= report.allocator_peak <= bound, (report.peak, report.allocator_peak,
                                                           bound)
    params, _, state = _hand_static(model, opt)
    assert report.owner_totals["parameters"] == params
    assert report.owner_totals["optimizer state"] == state
    assert report.static_bytes == static_footprint(model, opt, device=report.device)


@pytest.mark.gpu
def test_cuda_eager_totals_add_up_to_the_peak():
    dev, model, opt, manager, x = _cuda_moe("dropless")
    report = profile(_moe_step(model, opt, manager, set_to_none=False), x, model=model,
                     optimizer=opt, warmup=2)
    _check_cuda(report, model, opt)
    assert report.owner_totals["gradients"] == _hand_static(model, opt)[1]
    # Storages matched to their allocator blocks: layers and ops, not only frames.
    details = {d for o, d, _, _ in report.rows}
    assert any(d.startswith("blocks.") for d in details)
    assert any(d.startswith("aten.") for d in details)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["budget", "stash"])
def test_cuda_capture_totals_add_up_to_the_peak(mode):
    graphstash.warmup()
    from graphstash.moe import prepare_experts

    dev, model, opt, manager, x = _cuda_moe(mode)
    prepare_experts(dev, torch.bfloat16)
    report = profile(_moe_step(model, opt, manager, set_to_none=True), x, model=model,
                     optimizer=opt, stash_manager=manager, warmup=3, steps=2, capture=True)
    _check_cuda(report, model, opt)
    assert report.graph_pool_bytes_at_peak > 0
    if mode == "stash":
        pool = sum(b.device_bytes for b in manager.buffers.values())
        assert pool <= report.owner_totals["stash pool"] <= pool + (1 << 20)
        manager.release()
