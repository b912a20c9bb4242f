"""The live-row exchange on one GPU: ranks are processes sharing the GPU through CUDA IPC (and,
in one test, threads of one process with the in-process transports).

Each multi-rank test spawns its ranks once and runs its cases in order inside them; a failing
rank's own traceback is what the test reports (``_ranks.run_ranks``). Every comparison is with
the one-device reference computed on the same GPU by every rank (``_exchange_cases``).
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from graphstash.moe.exchange import layout as X
from graphstash import _layout as L

from _exchange_cases import (H, K, compare, expert_weights, fitting_budget, graph_step_case,
                             moe_layer, moe_model_case, rank_data, reference, run_rank)

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda", 0)        # this rank's GPU (set per rank: _use_gpu_of)
KIND = "ipc"                             # the transport the multi-rank cases build


def _use_gpu_of(rank: int, kind: str) -> None:
    """Ranks share GPU 0 through CUDA IPC, or each takes GPU ``rank`` for symmetric memory."""
    global DEVICE, KIND
    KIND = kind
    DEVICE = torch.device("cuda", rank if kind == "symmetric" else 0)
    torch.cuda.set_device(DEVICE)


def _ipc(world: int, capacity_rows: int, E: int, timeout_s: float = 60.0, row_bytes=H * 4):
    """This rank's transport of kind KIND (CUDA IPC unless the test asked for symmetric
    memory)."""
    from graphstash.moe.exchange import build_ipc_transport, build_symmetric_transport

    build = build_symmetric_transport if KIND == "symmetric" else build_ipc_transport
    torch.cuda.set_device(DEVICE)
    return build(capacity_rows=capacity_rows, row_bytes=row_bytes, max_experts=E,
                 device=DEVICE, timeout_s=timeout_s)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


# ---- the plan the kernels build equals the reference's --------------------------------------
def _plan_matches_reference(transport, E: int, T: int, budget: int, pad: int, skew) -> None:
    from graphstash.moe import dispatch
    from graphstash.reference import exchange as ref

    rank, world = transport.rank, transport.world_size
    x, idx, w, _ = rank_data(11, rank, T, E, DEVICE, skew=skew)
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=DEVICE)
    _, _, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=pad, exchange=transport,
                            status=status)
    plan = handle.plan
    torch.cuda.synchronize()
    transport.check()
    cube = plan.cube.cpu()
    want = dict(work=torch.empty(X.work_size(E), dtype=torch.int64),
                tokens_per_expert=torch.empty(E // world, dtype=torch.int32),
                live_rows=torch.empty(1, dtype=torch.int32),
                demand_rows=torch.empty(1, dtype=torch.int64),
                over_budget=torch.empty(1, dtype=torch.bool))
    ref.layout(cube, rank, world, E, budget, pad, **want)
    P = T * K
    maps = {n: torch.empty(k, dtype=torch.int32) for n, k in
            [("pair_slot", P), ("slot_peer", P), ("slot_row", P), ("slot_self", P),
             ("row_src", budget), ("row_peer", budget), ("row_slot", budget)]}
    ref.exchange_map(want["work"], cube, world, rank, E, plan.slot_of_pair.reshape(-1).cpu(),
                     budget, want["live_rows"], budget, **maps)
    assert torch.equal(cube[rank], torch.bincount(idx.reshape(-1).cpu(), minlength=E).int())
    for name, value in list(want.items()) + list(maps.items()):
        got = getattr(plan, name).cpu().reshape(value.shape)
        assert torch.equal(got, value), f"rank {rank}: {name} differs from the reference"
    assert bool(status[L.SS_OVER_BUDGET]) == bool(want["over_budget"])


# ---- one rank's part of the multi-rank GPU test ---------------------------------------------
def _eager_cases(transport, E: int, T: int, report: dict) -> None:
    rank, world = transport.rank, transport.world_size
    budget = fitting_budget(T, world, E, 4)
    mine = run_rank(transport, 3, T, E, DEVICE, budget=budget, pad=4, layers=2)
    ref = reference(3, world, T, E, DEVICE, layers=2)
    compare(mine, ref, rank, world, E)
    report["max_rel_eager"] = max(_max_rel(a, b) for a, b in zip(
        mine[:3], (ref[0][0][rank], ref[0][1][rank], ref[0][2][rank])))
    mine = run_rank(transport, 4, T, E, DEVICE, budget=budget, pad=None, weighted=True)
    compare(mine, reference(4, world, T, E, DEVICE, weighted=True), rank, world, E)


def _dropless_rounds(world: int, E: int, T: int) -> None:
    small = _ipc(world, T * K, E)                   # holds one rank's pairs: several rounds
    mine = run_rank(small, 5, T, E, DEVICE, budget=None, pad=3, skew=4.0)
    torch.cuda.synchronize()
    compare(mine, reference(5, world, T, E, DEVICE, skew=4.0), small.rank, world, E,
            experts_reached=False)
    small.close()


def _bytes_case(transport, E: int, T: int) -> dict:
    """Bytes written into the regions, counted on the device, equal the live rows x row bytes
    (+ router weights) both ways, plus counts and signals."""
    rank, world = transport.rank, transport.world_size
    budget = fitting_budget(T, world, E, 4)
    x, idx, w, _ = rank_data(6, rank, T, E, DEVICE)
    El = E // world
    w1, w2 = (t[rank * El:(rank + 1) * El] for t in expert_weights(6, E, DEVICE))
    torch.cuda.synchronize()
    transport.reset_counters()
    before = transport.counters()["barriers"]
    _, handle = moe_layer(x, idx, w, w1, w2, E, budget=budget, pad=4, exchange=transport)
    torch.cuda.synchronize()
    c = transport.counters()
    kept = int((handle.plan.pair_slot >= 0).sum())
    back = int((handle.plan.row_src >= 0).sum())
    assert c["row_bytes_remote"] + c["row_bytes_local"] == kept * (H * 4 + 4) + back * H * 4, c
    assert c["rows_sent"] == kept + back, c
    barriers = c["barriers"] - before
    assert barriers == 4, c
    assert c["meta_bytes"] == 4 * world * (X.X_HEADER + E) + 8 * world * barriers, c
    return c


def _graph_replays(transport, E: int, T: int, replays: int, captured=None) -> dict:
    """fwd + bwd through the exchange captured in one CUDA graph, replayed with new tokens and
    routing (skewed in every third replay: one expert gets the first slot of every token);
    outputs and every gradient equal the one-device reference at every replay."""
    rank, world = transport.rank, transport.world_size
    El = E // world
    budget = fitting_budget(T, world, E, 4)
    x0, idx0, w0, p0 = rank_data(20, rank, T, E, DEVICE)
    sx, sw = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    sidx, sproj = idx0.clone(), p0.clone()
    w1f, w2f = expert_weights(20, E, DEVICE)
    w1 = w1f[rank * El:(rank + 1) * El].clone().requires_grad_()
    w2 = w2f[rank * El:(rank + 1) * El].clone().requires_grad_()
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=DEVICE)

    def step():
        for p in (sx, sw, w1, w2):
            p.grad = None
        out, _ = moe_layer(sx, sidx, sw, w1, w2, E, budget=budget, pad=4, exchange=transport,
                           status=status)
        h = sx + out                          # as _exchange_cases.reference computes it
        (h.float() * sproj.float()).sum().backward()
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()
    grads = (sx.grad, sw.grad, w1.grad, w2.grad)
    if captured is not None:
        captured()             # in-process ranks: every rank has captured before any replays
    worst = 0.0
    for i in range(replays):
        seed = 100 + i
        skew = 8.0 if i % 3 == 2 else None
        x, idx, w, proj = rank_data(seed, rank, T, E, DEVICE, skew=skew)
        f1, f2 = expert_weights(seed, E, DEVICE)
        with torch.no_grad():
            sx.copy_(x), sw.copy_(w), sidx.copy_(idx), sproj.copy_(proj)
            w1.copy_(f1[rank * El:(rank + 1) * El]), w2.copy_(f2[rank * El:(rank + 1) * El])
        status.zero_()
        graph.replay()
        torch.cuda.current_stream().synchronize()
        transport.check()
        assert int(status[L.SS_OVER_BUDGET]) == 0 and int(status[L.SS_OVERFLOW]) == 0
        ref = reference(seed, world, T, E, DEVICE, skew=skew)
        # the captured experts run the Triton grouped GEMM, the eager reference torch's
        compare((out.detach(),) + tuple(g.clone() for g in grads), ref, rank, world, E,
                atol=1e-5, experts_reached=skew is None)
        worst = max(worst, _max_rel(out.detach(), ref[0][0][rank]))
    return {"graph_replays": replays, "max_rel_replay_out": worst}


def _flags_and_peaks(transport, rank: int, world: int) -> None:
    """The kernel's flags are summed and the step's peaks (NOTE [step peaks]) maximised over
    the ranks in one exchange."""
    flags = torch.tensor([rank + 1, 0, 2 * rank], dtype=torch.int32, device=DEVICE)
    peaks = torch.tensor([rank, 10 * (world - rank), -rank] + [7] * 250, dtype=torch.int32,
                         device=DEVICE)
    transport.all_reduce_flags_(flags, peaks)
    assert flags.tolist() == [world * (world + 1) // 2, 0, world * (world - 1)]
    assert peaks.tolist() == [world - 1, 10 * world, 0] + [7] * 250
    flags = torch.tensor([rank], dtype=torch.int32, device=DEVICE)
    transport.all_reduce_flags_(flags)                  # without peaks, as before
    assert flags.tolist() == [world * (world - 1) // 2]


def _ranks_gpu(rank: int, world: int, E: int, T: int, full: bool, kind: str = "ipc") -> dict:
    _use_gpu_of(rank, kind)
    report = {}
    budget = fitting_budget(T, world, E, 4)
    transport = _ipc(world, budget, E)
    transport.self_test()
    _flags_and_peaks(transport, rank, world)
    _plan_matches_reference(transport, E, T, budget, 4, None)
    _plan_matches_reference(transport, E, T, T * K // 2, 3, 6.0)        # over budget
    _eager_cases(transport, E, T, report)
    transport.push_blocks = 1             # one block strides over every row: the same results
    _eager_cases(transport, E, T, {})
    transport.push_blocks = 0
    _dropless_rounds(world, E, T)
    report["bytes"] = _bytes_case(transport, E, T)
    t0 = time.perf_counter()
    report.update(_graph_replays(transport, E, T, 50 if full else 10))
    report["replay_s"] = round(time.perf_counter() - t0, 2)
    report.update(graph_step_case(transport, E, T, 50 if full else 15, DEVICE))
    if full:
        report["stash"] = graph_step_case(transport, E, T, 20, DEVICE, stash=True)
        report["moe_model"] = moe_model_case(transport, T, E, DEVICE)
    transport.check()
    transport.close()
    return report


def test_two_ranks_on_one_gpu_equal_the_one_device_reference():
    from _ranks import run_ranks

    print(run_ranks(_ranks_gpu, 2, 8, 32, True))


def test_four_ranks_on_one_gpu_equal_the_one_device_reference():
    from _ranks import run_ranks

    print(run_ranks(_ranks_gpu, 4, 8, 24, False))


@pytest.mark.multigpu
def test_symmetric_memory_every_gpu_equals_the_one_device_reference():
    """The same cases with one rank per GPU of the machine (2, 4 or 8: ``_world.WORLD_SIZE``)
    and the table from torch symmetric memory (CUDA backend, NVLink multicast off): the real
    transport of a node. The self test runs first."""
    from _ranks import run_ranks
    from _world import WORLD_SIZE, require_gpus

    require_gpus(WORLD_SIZE)
    env = dict(TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NCCL_NVLS_ENABLE="0",
               NVSHMEM_DISABLE_NVLS="1")
    print(run_ranks(_ranks_gpu, WORLD_SIZE, 8, 32, True, "symmetric", env=env))


# ---- a dead rank is reported, not waited on ---------------------------------------------
def _dead_rank(rank: int, world: int, mode: str, flag_dir: str) -> str:
    from graphstash.errors import ExchangeError

    E, T = 4, 16
    budget = fitting_budget(T, world, E, None)
    transport = _ipc(world, budget, E, timeout_s=5.0)
    x, idx, w, _ = rank_data(1, rank, T, E, DEVICE)
    El = E // world
    w1, w2 = (t[rank * El:(rank + 1) * El] for t in expert_weights(1, E, DEVICE))
    moe_layer(x, idx, w, w1, w2, E, budget=budget, pad=None, exchange=transport)
    torch.cuda.synchronize()
    transport.check()                                   # one good exchange first
    done = os.path.join(flag_dir, "survivor_done")
    if rank == 1:
        if mode == "kill":
            from graphstash.moe import dispatch
            dispatch(x, idx, w, E, budget=budget, exchange=transport)   # then die mid-layer
            torch.cuda.synchronize()
            os._exit(0)
        try:
            raise RuntimeError("rank 1 failed before its exchange")
        except RuntimeError:
            pass
        while not os.path.exists(done):                 # stay alive until rank 0 has reported
            time.sleep(0.05)
        return "raised"
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=DEVICE)
    t0 = time.perf_counter()
    out, _ = moe_layer(x, idx, w, w1, w2, E, budget=budget, pad=None, exchange=transport,
                       status=status)
    torch.cuda.synchronize()
    waited = time.perf_counter() - t0
    with pytest.raises(ExchangeError, match="rank 1 did not signal within 5 s"):
        transport.check()
    assert int(status[L.SS_OVERFLOW]) & L.OVERFLOW_EXCHANGE
    flags = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    transport.all_reduce_flags_(flags)
    assert flags.tolist() == [1, 1, 1]                  # a failed exchange is never trusted
    open(done, "w").close()
    return f"survivor raised ExchangeError after {waited:.1f} s"


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_dead_rank_makes_the_others_fail_clearly(mode, tmp_path):
    from _ranks import run_ranks

    results = run_ranks(_dead_rank, 2, mode, str(tmp_path), missing_ok={1} if mode == "kill" else ())
    print(results)


# ---- W ranks in one process, one thread and stream each ---------------------------------
def _captured_step(transport, E: int, T: int, budget: int, dtype, seeds):
    """Static inputs, local experts and a CUDA graph of one fwd + bwd through ``transport``
    (captured on a side stream, without a device-wide sync); returns ``(graph, load,
    results)``: ``load(i)`` writes the inputs of ``seeds[i]``, ``results(i)`` copies output and
    gradients into the i-th result tensors. Everything the replays use is allocated here,
    before any rank's exchange runs (NOTE [in-process ranks] in
    graphstash/moe/exchange/local.py: no allocation while a peer's barrier spins)."""
    rank, world = transport.rank, transport.world_size
    El = E // world
    x0, idx0, w0, p0 = rank_data(40, rank, T, E, DEVICE, dtype)
    sx, sw = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    sidx, sproj = idx0.clone(), p0.clone()
    w1f, w2f = expert_weights(40, E, DEVICE, dtype)
    w1 = w1f[rank * El:(rank + 1) * El].clone().requires_grad_()
    w2 = w2f[rank * El:(rank + 1) * El].clone().requires_grad_()
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        out, _ = moe_layer(sx, sidx, sw, w1, w2, E, budget=budget, pad=4, exchange=transport,
                           status=status)
        h = sx + out                          # as _exchange_cases.reference computes it
        (h.float() * sproj.float()).sum().backward()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)

    inputs = [rank_data(seed, rank, T, E, DEVICE, dtype) for seed in seeds]
    outputs = [tuple(torch.empty_like(t) for t in (h, sx.grad, sw.grad, w1.grad, w2.grad))
               for _ in seeds]

    def load(i):
        x, idx, w, proj = inputs[i]
        with torch.no_grad():
            sx.copy_(x), sw.copy_(w), sidx.copy_(idx), sproj.copy_(proj)

    def results(i):
        for dst, src in zip(outputs[i], (h, sx.grad, sw.grad, w1.grad, w2.grad)):
            dst.copy_(src.detach())
        return outputs[i]

    return graph, load, results


def test_in_process_ranks_equal_the_reference():
    """The in-process transports run the same kernels for 2 ranks, one host thread and one
    CUDA stream each: a captured fwd + bwd (bf16, HF-layout gated experts), replayed with new
    routing, equals the one-device reference. The threads only capture and replay (NOTE
    [in-process ranks] in graphstash/moe/exchange/local.py: an eager backward must not read
    back to the host); the experts are warmed up eagerly first, on one rank's shapes."""
    import graphstash
    from graphstash.moe.exchange import build_local_transports

    world, E, T, dtype, replays = 2, 8, 32, torch.bfloat16, 4
    budget = fitting_budget(T, world, E, 4)
    graphstash.warmup()
    transports = build_local_transports(world, capacity_rows=budget, row_bytes=H * 2,
                                        max_experts=E, device=DEVICE, timeout_s=60.0)
    reference(40, world, T, E, DEVICE, dtype=dtype)       # eager warmup of the experts, 1 device
    errors, got = [None] * world, [[] for _ in range(world)]
    capture_lock, captured = threading.Lock(), threading.Barrier(world)

    def run(rank):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                transports[rank].self_test()
                with capture_lock:                 # one capture at a time
                    graph, load, results = _captured_step(
                        transports[rank], E, T, budget, dtype, [300 + i for i in range(replays)])
                torch.cuda.current_stream().synchronize()
                captured.wait()
                for i in range(replays):
                    load(i)
                    graph.replay()
                    torch.cuda.current_stream().synchronize()
                    got[rank].append(results(i))
                transports[rank].check()
        except BaseException as exc:        # reported below with the rank
            errors[rank] = exc
            captured.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"rank {rank} failed: {exc!r}") from exc
    for i in range(replays):
        ref = reference(300 + i, world, T, E, DEVICE, dtype=dtype, seed_weights=40)
        for rank in range(world):
            compare(got[rank][i], ref, rank, world, E, rtol=2e-2, atol=2e-2)
