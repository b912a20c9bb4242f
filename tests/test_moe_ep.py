"""Expert-parallel dispatch/combine over W processes, compared with the one-device reference.

Every rank builds the data of every rank from one seed, runs the expert-parallel path on its
own tokens (each rank holds ``E / W`` of the experts), and checks its outputs and gradients
against the one-device dispatch/combine run with all experts: token outputs and router-weight
gradients per rank, expert-weight gradients summed over every rank's tokens.
The CPU variants use gloo and the reference backend, 2 ranks (and 4, slow); the GPU variant
uses NCCL and the CuPy kernels, one rank per GPU of the machine (``_world.WORLD_SIZE``: 2, 4
or 8), and also captures the step in a CUDA graph and replays it with changing routing.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphstash import _layout as L
from _capture import capture_with_output
from graphstash.moe import NcclChunks, budget_rows, combine, dispatch, grouped_mm

from _faults import exchange_fault
from _grad_checks import assert_far_from_zero, assert_grads_close, projected_loss, projection
from _moe_data import routing, tokens
from _ranks import end_process
from _world import CPU_WORLD, WORLD_SIZE, require_gpus

T, H, E, K = 48, 16, 8, 2                   # E divides over 2, 4 and 8 ranks
TIMEOUT = datetime.timedelta(seconds=120)   # a rank that never arrives fails the others


def _data(seed: int, rank: int, device, dtype, skew=None):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    x = tokens(T, H, gen, dtype, offset=1000 * rank).to(device) / T
    idx, w = routing(T, K, E, gen, dtype, skew=skew)
    grad = (torch.rand(T, H, generator=gen, dtype=torch.float64) - 0.5).to(device, dtype)
    return x, idx.to(device), w.to(device), grad


def _weights(seed: int, device, dtype):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(E, H, H, generator=gen, dtype=torch.float64) - 0.5) / 4).to(device, dtype)


def _step(x, idx, w, w1, *, group, budget, pad, status, chunk_rows=None, scaled=False):
    """One MoE layer: dispatch, linear experts (grouped GEMM), combine; ``scaled``: the rows
    are scaled by ``handle.permuted_weights()`` and combined unweighted (the weights travel
    to the experts' rank and their gradients back)."""
    exchange = None if group is None else NcclChunks(group, chunk_rows)
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=pad,
                                        exchange=exchange, status=status)
    y = grouped_mm(permuted, w1, counts)
    if scaled:
        return combine(y * handle.permuted_weights().unsqueeze(1), handle, weighted=False)
    return combine(y, handle)


def _reference(seed, world, device, dtype, skew=None):
    """One-device results for every rank: outputs, x/w grads per rank, summed expert grad."""
    w1 = _weights(seed, device, dtype).requires_grad_()
    outs, gxs, gws = [], [], []
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    for r in range(world):
        x, idx, w, grad = _data(seed, r, device, dtype, skew)
        x.requires_grad_(), w.requires_grad_()
        out = _step(x, idx, w, w1, group=None, budget=None, pad=None, status=status)
        gx, gw = torch.autograd.grad(out, (x, w), grad, retain_graph=True)
        (out * grad).sum().backward()
        outs.append(out.detach()), gxs.append(gx), gws.append(gw)
    return outs, gxs, gws, w1.grad


def _check_rank(rank, world, seed, device, dtype, out, x, w, w1_local, tol, skew=None):
    outs, gxs, gws, gw1 = _reference(seed, world, device, dtype, skew)
    E_l = E // world
    assert_far_from_zero({"x": gxs[rank], "w": gws[rank],
                          "w1": gw1[rank * E_l:(rank + 1) * E_l]})
    torch.testing.assert_close(out.detach(), outs[rank], **tol)
    torch.testing.assert_close(x.grad, gxs[rank], **tol)
    torch.testing.assert_close(w.grad, gws[rank], **tol)
    torch.testing.assert_close(w1_local.grad, gw1[rank * E_l:(rank + 1) * E_l], **tol)


def _eager_case(rank, world, device, dtype, group, budget, pad, tol, seed, scaled=False):
    x, idx, w, grad = _data(seed, rank, device, dtype)
    x.requires_grad_(), w.requires_grad_()
    E_l = E // world
    w1 = _weights(seed, device, dtype)[rank * E_l:(rank + 1) * E_l].clone().requires_grad_()
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    out = _step(x, idx, w, w1, group=group, budget=budget, pad=pad, status=status,
                scaled=scaled)
    (out * grad).sum().backward()
    assert int(status[L.SS_OVER_BUDGET]) == 0
    _check_rank(rank, world, seed, device, dtype, out, x, w, w1, tol)


def _over_budget_case(rank, world, device, dtype, group):
    x, idx, w, _ = _data(7, rank, device, dtype, skew=4.0)   # the lowest experts (rank 0's)
    w1 = _weights(7, device, dtype)[:E // world].clone()
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    _step(x, idx, w, w1, group=group, budget=16, pad=None, status=status)
    flags = status[L.SS_OVER_BUDGET:L.SS_OVER_BUDGET + 1].clone()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    assert int(flags) == 1
    assert rank != 0 or int(status[L.SS_OVER_BUDGET]) == 1


# The peer's float32 sums run in another order over W ranks than on one device (its grouped
# GEMMs see every rank's rows): on four H200 one element in a few hundred was 3e-5 off, of a
# largest value near 1, past an elementwise 1e-5. Relative to the tensor's largest value, as
# the bench's peer test compares; a wrong expert, weight or sign is off by O(1).
PEER_REL = 1e-4


def _plain_case(rank, world, device, dtype, group):
    """The peer (graphstash.models.plain, the bench's eager peer): all_to_all_single with split
    sizes read back, each rank holding ``E / W`` of the gated experts, equals the one-device
    peer with all of them: the output and the gradients of the tokens, the router weights and
    the rank's experts (the reference's far from zero)."""
    from graphstash.models.plain import plain_moe

    gen = torch.Generator().manual_seed(41)
    F = 12
    w1 = ((torch.rand(E, 2 * F, H, generator=gen, dtype=torch.float64) - 0.5) / 4).to(device, dtype)
    w2 = ((torch.rand(E, H, F, generator=gen, dtype=torch.float64) - 0.5) / 4).to(device, dtype)
    E_l = E // world
    mine_experts = slice(rank * E_l, (rank + 1) * E_l)
    local = [w[mine_experts].clone().requires_grad_() for w in (w1, w2)]
    full = [w.clone().requires_grad_() for w in (w1, w2)]
    x, idx, w, grad = _data(43, rank, device, dtype)
    x.requires_grad_(), w.requires_grad_()
    out = plain_moe(x, idx, w, *local, E, gated=True, group=group)
    (out * grad).sum().backward()
    for r in range(world):                       # the one-device reference sees every rank
        xr, idxr, wr, gr = _data(43, r, device, dtype)
        xr.requires_grad_(), wr.requires_grad_()
        ref = plain_moe(xr, idxr, wr, *full, E, gated=True)
        (ref * gr).sum().backward()
        if r == rank:
            assert_grads_close({"out": out.detach(), "x": x.grad, "topk_weight": w.grad},
                               {"out": ref.detach(), "x": xr.grad, "topk_weight": wr.grad},
                               rel=PEER_REL)
    assert_grads_close({"w1": local[0].grad, "w2": local[1].grad},
                       {"w1": full[0].grad[mine_experts], "w2": full[1].grad[mine_experts]},
                       rel=PEER_REL)


def _exchange_buffers_case(rank, device, dtype, group):
    """The send and receive buffers of the all-to-all are temporaries of their layer: none is
    alive when the next layer exchanges, none is kept for backward (a budget-mode model of
    three gated layers; its budget and chunks hold every row, capacity and chunk factor W:
    these tokens all pick nearly the same experts, and nothing here is about dropped rows).

    NOTE [deterministic exchange accounting]: the collective itself runs on copies of the
    buffers, so the process group's own references (released by its threads at a time that
    depends on the other rank) never reach the buffers counted here; the cyclic garbage
    collector is off, so a buffer dies exactly when its last reference goes (one held by a
    reference cycle counts as alive, whenever the collector would run); every tensor autograd
    saves is checked against the live buffers when it is saved. Nothing depends on timing."""
    import gc
    import weakref

    from graphstash.models import MoEConfig, MoEModel

    world = float(dist.get_world_size(group))
    config = MoEConfig(hidden=H, ffn=12, num_experts=E, topk=K, layers=3, num_tokens=T,
                       capacity_factor=world, chunk_factor=world, gated=True)
    model = MoEModel(config, mode="budget", group=group, seed=5, device=device, dtype=dtype,
                     exchange=None)                   # the NCCL chunk path
    gen = torch.Generator().manual_seed(50 + rank)
    x = tokens(T, H, gen, dtype).to(device) / T
    proj = projection((T, H), gen, device)
    buffers, alive_at_call, kept = [], [], []
    real = dist.all_to_all_single

    def alive():
        return [b for b in (r() for r in buffers) if b is not None]

    def accounting(output, input, *args, **kwargs):
        alive_at_call.append(len(alive()))
        received, sent = torch.empty_like(output), input.clone()
        work = real(received, sent, *args, **kwargs)
        if work is not None:
            work.wait()
        output.copy_(received)
        buffers.extend((weakref.ref(input), weakref.ref(output)))
        return work

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and any(b.untyped_storage().data_ptr() == ptr for b in alive()):
            kept.append(tuple(t.shape))
        return t

    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    dist.all_to_all_single = accounting
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            after_forward = len(alive())
            projected_loss(out, proj).backward()
        del out
        after_backward = len(alive())
    finally:
        dist.all_to_all_single = real
        if gc_was_enabled:
            gc.enable()
    # dispatch and combine of each layer, forward and backward, plus the router weights
    assert len(buffers) >= 2 * 2 * 2 * config.layers
    assert alive_at_call == [0] * len(alive_at_call), alive_at_call
    assert after_forward == 0 and after_backward == 0
    assert kept == [], kept


def _wrong_exchange_case(rank, world, device, dtype, group, budget, tol):
    """The expert-parallel check fails when the exchange's backward is wrong: the rows the
    all-to-all brings back in backward scaled by 1.25 (a test-only fault, ``_faults.py``)."""
    with exchange_fault() as fault:
        with pytest.raises(AssertionError):
            _eager_case(rank, world, device, torch.float32, group, budget, 4, tol, seed=11)
    assert fault.hits > 0, "the exchange fault never fired"


def _bad_input_case(world, device, dtype, group):
    x, idx, w, _ = _data(1, 0, device, dtype)
    with pytest.raises(ValueError,
                       match=f"num_experts: expected a multiple of the exchange's {world}"):
        dispatch(x, idx.clamp(max=2), w, 3, budget=64, exchange=NcclChunks(group))
    # the deprecated spelling converts, naming the new call
    with pytest.warns(DeprecationWarning, match=r"exchange=graphstash.moe.NcclChunks\(group"):
        with pytest.raises(ValueError, match="num_experts: expected a multiple of the exchange"):
            dispatch(x, idx.clamp(max=2), w, 3, budget=64, group=group)


def _worker(rank, world, backend, results_dir):
    """Run every case on ``rank`` of ``world``; its own error (traceback) goes to
    ``rank{rank}.err`` in ``results_dir`` (NOTE [the failing rank's own error])."""
    try:
        _run_cases(rank, world, backend, results_dir)
    except BaseException:
        with open(os.path.join(results_dir, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.monotonic_ns()}\n{traceback.format_exc()}")
        # Not torn down: destroying an NCCL group while the peers wait in a collective can
        # wait for them forever. The process ends now; mp.spawn then ends the others.
        os._exit(1)
    end_process()            # NOTE [ending a rank's process] in tests/_ranks.py


def _run_cases(rank, world, backend, results_dir):
    # NOTE [a stuck rank's stack]: a rank still running 20 s before the collective timeout
    # prints where it is, every thread, to stderr (``pytest -s`` shows it): a collective
    # captured in a CUDA graph has no watchdog, so a replay that waits forever would otherwise
    # leave nothing to read. A rank that fails ends its process without tearing the group down
    # (``_worker``), and mp.spawn ends the others: a peer waiting in a captured collective for
    # the failed rank would otherwise wait forever.
    faulthandler.dump_traceback_later(TIMEOUT.total_seconds() - 20, exit=False)
    os.environ.update(NCCL_NVLS_ENABLE="0")
    on_gpu = backend == "nccl"
    if on_gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if not on_gpu:
        torch.set_num_threads(1)   # W ranks share the cores: no thread oversubscription
    store = f"file://{os.path.join(results_dir, 'store')}"   # no port to race for
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world,
                            timeout=TIMEOUT, device_id=device if on_gpu else None)
    group = dist.group.WORLD
    tol = dict(rtol=1e-5, atol=1e-5)
    f32 = torch.float32
    budget = budget_rows(T * world, K, E, capacity_factor=1.0, pad_multiple=4,
                         world_size=1)                  # fits any routing
    _eager_case(rank, world, device, f32, group, budget, 4, tol, seed=11)
    _eager_case(rank, world, device, f32, group, None, None, tol, seed=12)  # dropless
    _eager_case(rank, world, device, f32, group, budget, 4, tol, seed=13, scaled=True)
    _over_budget_case(rank, world, device, f32, group)
    _plain_case(rank, world, device, f32, group)
    _exchange_buffers_case(rank, device, f32, group)
    _wrong_exchange_case(rank, world, device, f32, group, budget, tol)
    _bad_input_case(world, device, f32, group)
    if on_gpu:
        _graph_case(rank, world, device, group, tol)
        _graph_case(rank, world, device, group, tol, scaled=True)
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def _graph_case(rank, world, device, group, tol, scaled=False):
    """Capture dispatch -> experts -> combine -> backward; replay with changing routing."""
    dtype = torch.float32
    E_l = E // world
    seed0 = 21
    budget = budget_rows(T * world, K, E, capacity_factor=1.0, pad_multiple=4)
    x0, idx0, w0, g0 = _data(seed0, rank, device, dtype)
    static_x = x0.clone().requires_grad_()
    static_w = w0.clone().requires_grad_()
    static_idx, static_g = idx0.clone(), g0.clone()
    w1 = _weights(seed0, device, dtype)[rank * E_l:(rank + 1) * E_l].clone().requires_grad_()
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)

    def step():
        for p in (static_x, static_w, w1):
            p.grad = None
        out = _step(static_x, static_idx, static_w, w1, group=group, budget=budget, pad=4,
                    status=status, scaled=scaled)
        (out * static_g).sum().backward()
        return out

    graph, static_out = capture_with_output(step)
    for seed in (31, 32, 33):
        x, idx, w, g = _data(seed, rank, device, dtype)
        with torch.no_grad():
            static_x.copy_(x), static_w.copy_(w), static_idx.copy_(idx), static_g.copy_(g)
        w1_full = _weights(seed, device, dtype)
        with torch.no_grad():
            w1.copy_(w1_full[rank * E_l:(rank + 1) * E_l])
        status.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert int(status[L.SS_OVER_BUDGET]) == 0
        _check_rank(rank, world, seed, device, dtype, static_out, static_x, static_w, w1, tol)


# NOTE [the failing rank's own error]: when one rank fails, the others see only that it went
# away ("Connection closed by peer") in their next collective, and mp.spawn reports whichever
# process it noticed first. Every rank writes its own traceback, stamped with a monotonic
# clock, and the test reports the first one that is not a lost connection, then the others.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Socket closed", "NCCL communicator was aborted")


def _rank_errors(directory, world) -> str:
    errors = []
    for rank in range(world):
        path = os.path.join(directory, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                stamp, text = f.read().split("\n", 1)
            errors.append((any(s in text for s in _LOST_PEER), int(stamp), rank, text))
    errors.sort()
    return "\n".join(f"rank {rank}{' (first)' if i == 0 else ''}:\n{text}"
                     for i, (_, _, rank, text) in enumerate(errors))


def _spawn(backend, world):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_worker, args=(world, backend, tmp), nprocs=world, join=True)
        except mp.ProcessRaisedException as exc:
            raise AssertionError(_rank_errors(tmp, world) or str(exc)) from None
        except mp.ProcessExitedException as exc:
            raise AssertionError(_rank_errors(tmp, world) or str(exc)) from None


@pytest.mark.parametrize("world", [CPU_WORLD, pytest.param(4, marks=pytest.mark.slow)])
def test_expert_parallel_gloo_matches_reference(world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    _spawn("gloo", world)


@pytest.mark.multigpu
def test_expert_parallel_nccl_matches_reference_and_replays():
    if not dist.is_nccl_available():
        pytest.skip("needs torch.distributed with NCCL")
    require_gpus(WORLD_SIZE)
    _spawn("nccl", WORLD_SIZE)
