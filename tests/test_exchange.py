"""The live-row exchange on the CPU: its layout constants, its plan (the pure-torch twin of the
kernels, every rank simulated in one process) and the whole exchange over gloo, 2 and 4 ranks,
against the one-device reference."""
from __future__ import annotations

import re

import pytest
import torch

from graphstash.moe.exchange import layout as X
from graphstash import _layout as L
from graphstash.moe._routing import plan_local
from graphstash.moe.backend import REFERENCE
from graphstash.reference import exchange as ref
from raw_kernels import source_path

from _moe_data import expected_layout, routing

_DEFINE = re.compile(r"^\s*#define\s+GS_([A-Z0-9_]+)\s+(-?\d+)\b", re.MULTILINE)


def test_exchange_header_and_module_agree():
    header = dict(_DEFINE.findall(source_path("gs_exchange.cuh").read_text()))
    header = {k: int(v) for k, v in header.items()}
    module = {k: v for k, v in vars(X).items() if k.isupper() and isinstance(v, int)
              and k not in ("ALIGN", "WEIGHT_BYTES")}
    assert len(header) >= 25
    assert header == module
    assert "OVERFLOW_EXCHANGE" in dict(_DEFINE.findall(source_path("gs_layout.cuh").read_text()))
    assert L.OVERFLOW_EXCHANGE & (L.OVERFLOW_POOL | L.OVERFLOW_COUNT) == 0


def test_region_layout_is_aligned_and_disjoint():
    layout = X.RegionLayout(world_size=4, capacity_rows=1000, row_bytes=96, max_experts=12)
    offsets, sizes = layout.offsets(), layout.sizes()
    assert all(o % X.ALIGN == 0 for o in offsets)
    assert all(a + s <= b for a, s, b in zip(offsets, sizes, offsets[1:]))
    assert offsets[-1] + sizes[-1] <= layout.nbytes
    assert sizes[X.XF_ROWS] == 1000 * 96 and sizes[X.XF_COUNTS] == 4 * 4 * (X.X_HEADER + 12)


# ---- the plan, every rank simulated in one process ------------------------------------------
def _plans(idx_per_rank, E: int, budget: int, pad: int | None):
    """Each rank's layout and maps from the reference, as the kernels would compute them."""
    W = len(idx_per_rank)
    routes = [plan_local(idx, E, idx.numel(), None, kernels=REFERENCE,
                         status=torch.zeros(L.STATUS_SIZE, dtype=torch.int32))
              for idx in idx_per_rank]
    cube = torch.stack([r.tokens_per_expert for r in routes])
    plans = []
    for rank, (idx, route) in enumerate(zip(idx_per_rank, routes)):
        P = idx.numel()
        out = dict(work=torch.empty(X.work_size(E), dtype=torch.int64),
                   tokens_per_expert=torch.empty(E // W, dtype=torch.int32),
                   live_rows=torch.empty(1, dtype=torch.int32),
                   demand_rows=torch.empty(1, dtype=torch.int64),
                   over_budget=torch.empty(1, dtype=torch.bool))
        ref.layout(cube, rank, W, E, budget, pad or 1, **out)
        maps = {name: torch.empty(n, dtype=torch.int32) for name, n in
                [("pair_slot", P), ("slot_peer", P), ("slot_row", P), ("slot_self", P),
                 ("row_src", budget), ("row_peer", budget), ("row_slot", budget)]}
        ref.exchange_map(out["work"], cube, W, rank, E, route.slot_of_pair.reshape(-1), budget,
                         out["live_rows"], budget, **maps)
        plans.append(dict(out, **maps, route=route))
    return plans


@pytest.mark.parametrize("world,E,pad,factor", [(2, 4, None, 2.0), (2, 4, 4, 2.0),
                                                (4, 8, 3, 4.0), (4, 8, None, 0.6),
                                                (2, 6, 4, 0.5), (4, 4, 2, 0.3)])
def test_plan_lays_out_every_receiver_as_one_device_would(gen, world, E, pad, factor):
    """Moving each rank's live slots where the plan says fills every receiver's buffer with the
    one-device permuted layout of all ranks' tokens over its experts (source ranks in order),
    clipped at the budget; combine's maps send every received row back to the slot it came
    from; each pair's slot is kept exactly when its row fits."""
    T, K = 24, 2
    El = E // world
    idx = [routing(T, K, E, gen, skew=3.0 if factor < 1 else None)[0] for _ in range(world)]
    budget = max(1, int(factor * T * K))
    plans = _plans(idx, E, budget, pad)
    full = torch.cat(idx)
    for d in range(world):                      # the receivers
        # one device over all tokens, restricted to d's experts: expert-local ids
        mine = (full // El) == d
        local = torch.where(mine, full - d * El, torch.full_like(full, E + 1))
        rows, tpe = expected_layout(local, El, budget, pad)
        got = [None] * budget
        for s in range(world):                  # the senders
            p = plans[s]
            route = p["route"]
            for q in range(int(route.live_rows)):
                if int(p["slot_peer"][q]) == d:
                    pair = int(route.pair_of_slot[q])
                    got[int(p["slot_row"][q])] = (s * T + pair // K, pair % K)
        assert got == rows, f"receiver {d}"
        assert plans[d]["tokens_per_expert"].tolist() == tpe
        counts = torch.bincount(local.reshape(-1), minlength=E + 2)[:El]
        demand = int(((counts + (pad or 1) - 1) // (pad or 1) * (pad or 1)).sum())
        assert int(plans[d]["demand_rows"]) == demand
        assert int(plans[d]["live_rows"]) == min(demand, budget)
        assert bool(plans[d]["over_budget"]) == (demand > budget)
        for r in range(budget):
            src, peer, slot = (int(plans[d][k][r]) for k in ("row_src", "row_peer", "row_slot"))
            if rows[r] is None:
                assert (src, peer, slot) == (-1, -1, -1), (d, r)
                continue
            assert (src, peer) == (r, rows[r][0] // T)
            sender = plans[peer]
            assert int(sender["slot_peer"][slot]) == d and int(sender["slot_row"][slot]) == r
            assert int(sender["route"].pair_of_slot[slot]) == (rows[r][0] % T) * K + rows[r][1]
    over = any(bool(p["over_budget"]) for p in plans)
    kept = sum(int((p["pair_slot"] >= 0).sum()) for p in plans)
    placed = sum(sum(r is not None for r in expected_layout(
        torch.where((full // El) == d, full - d * El, torch.full_like(full, E + 1)),
        El, budget, pad)[0]) for d in range(world))
    assert kept == placed
    assert over == (kept < world * T * K)
    for p in plans:                             # a pair is kept iff its slot is
        pair_slot = p["pair_slot"].reshape(-1)
        slot_of_pair = p["route"].slot_of_pair.reshape(-1)
        kept_slots = p["slot_self"]
        for i in range(pair_slot.numel()):
            q = int(slot_of_pair[i])
            assert int(pair_slot[i]) == (q if int(kept_slots[q]) == q else -1)


# ---- the whole exchange over gloo -------------------------------------------------------
def _bytes_expected(plan_rows_kept: int, rows_back: int, row_bytes: int, weight_bytes: int):
    return plan_rows_kept * (row_bytes + weight_bytes) + rows_back * row_bytes


def _gloo_ranks(rank: int, world: int, E: int) -> None:
    from graphstash.moe.exchange import build_gloo_transport
    from _exchange_cases import (H, K, compare, expert_weights, fitting_budget,
                                 graph_step_case, moe_layer, moe_model_case, rank_data,
                                 reference, run_rank)

    T = 20
    device = torch.device("cpu")
    budget = fitting_budget(T, world, E, 4)
    transport = build_gloo_transport(capacity_rows=budget, row_bytes=H * 4, max_experts=E)
    # budget that fits, padded experts, router weights scaling the activations; two layers
    mine = run_rank(transport, 3, T, E, device, budget=budget, pad=4, layers=2)
    compare(mine, reference(3, world, T, E, device, layers=2), rank, world, E)
    assert int(mine[5][L.SS_OVER_BUDGET]) == 0
    # weighted combine, no padding
    mine = run_rank(transport, 4, T, E, device, budget=budget, pad=None, weighted=True)
    compare(mine, reference(4, world, T, E, device, weighted=True), rank, world, E)
    # dropless, received in rounds: the region holds one rank's pairs, not a receiver's rows
    small = build_gloo_transport(capacity_rows=T * K, row_bytes=H * 4, max_experts=E)
    mine = run_rank(small, 5, T, E, device, budget=None, pad=3, skew=4.0)
    compare(mine, reference(5, world, T, E, device, skew=4.0), rank, world, E,
            experts_reached=False)
    assert small.counters()["barriers"] > 4 * 2          # more than one round each way

    # bytes: live rows x row bytes (+ weights), both ways; counts and signals beside them
    transport.reset_counters()
    before = transport.counters()["barriers"]
    x, idx, w, _ = rank_data(6, rank, T, E, device)
    w1, w2 = (t[rank * (E // world):(rank + 1) * (E // world)] for t in expert_weights(6, E, device))
    out, handle = moe_layer(x, idx, w, w1, w2, E, budget=budget, pad=4, exchange=transport)
    c = transport.counters()
    plan = handle.plan
    kept = int((plan.pair_slot >= 0).sum())
    back = int((plan.row_src >= 0).sum())
    assert c["row_bytes_remote"] + c["row_bytes_local"] == _bytes_expected(kept, back, H * 4, 4)
    assert c["rows_sent"] == kept + back
    barriers = c["barriers"] - before
    assert barriers == 4                        # counts, data; combine: lead, data
    assert c["meta_bytes"] == 4 * world * (X.X_HEADER + E) + 8 * world * barriers

    # over budget: rank 0's experts get most rows; every rank learns it through the flags
    over = run_rank(transport, 7, T, E, device, budget=T * K // 4, pad=None, skew=6.0)
    flags = (over[5][:3] != 0).to(torch.int32)
    mine_over = int(flags[L.SS_OVER_BUDGET])
    transport.all_reduce_flags_(flags)
    import torch.distributed as dist
    total = torch.tensor([mine_over])
    dist.all_reduce(total)
    assert int(flags[L.SS_OVER_BUDGET]) == int(total) >= 1
    values = torch.tensor([rank + 1, 0, 2 * rank], dtype=torch.int32)
    transport.all_reduce_flags_(values)
    assert values.tolist() == [world * (world + 1) // 2, 0, world * (world - 1)]
    # with the step's peaks in the same exchange: flags summed, peaks their maximum
    values = torch.tensor([rank + 1, 0, 2 * rank], dtype=torch.int32)
    peaks = torch.tensor([rank, 10 * (world - rank), -rank], dtype=torch.int32)
    transport.all_reduce_flags_(values, peaks)
    assert values.tolist() == [world * (world + 1) // 2, 0, world * (world - 1)]
    assert peaks.tolist() == [world - 1, 10 * world, 0]
    # graph_step (eager on the CPU): skewed steps rerun dropless on every rank, one update each
    graph_step_case(transport, 2 * world, T, 10, device)
    # MoEModel over the exchange: budget mode eagerly; stash mode, and budget mode with the
    # rows resent, under graph_step
    moe_model_case(transport, T, E, device)
    transport.check()
    transport.close()


def test_gloo_exchange_equals_one_device_reference():
    from _ranks import run_ranks

    run_ranks(_gloo_ranks, 2, 4)


@pytest.mark.slow
def test_gloo_exchange_four_ranks():
    from _ranks import run_ranks

    run_ranks(_gloo_ranks, 4, 8)


def _hf_ranks(rank: int, world: int) -> None:
    """transformers' Qwen3-MoE (tiny) with ``configure(group=..., num_tokens=...)``: the
    experts' tokens travel through the live-row exchange (gloo here); each rank's logits,
    loss and replicated gradients equal the one-device model's on its batch, its expert slice's
    gradient the slice of the full gradient summed over the ranks."""
    import torch.distributed as dist

    import graphstash.integrations.transformers as gst
    from _hf_models import batch, tiny_model, twin

    gst.register()
    ref = tiny_model("qwen3_moe", 5)
    ours = twin(ref, gst.IMPLEMENTATION)
    ids = batch(torch.Generator().manual_seed(90 + rank))
    names = gst.configure(ours, capacity_factor=float(world), group=dist.group.WORLD,
                          num_tokens=ids.numel())
    modules = dict(ours.named_modules())
    exchanges = {gst.settings_of(modules[n]).exchange for n in names}
    assert len(exchanges) == 1, exchanges
    got = ours(input_ids=ids, labels=ids)
    assert next(iter(exchanges)).transport.kind == "gloo"   # built at the first forward
    got.loss.backward()
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()

    def close(a, b, what):
        scale = float(b.detach().abs().max().clamp(min=1e-30))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale, msg=what)

    close(got.logits, want.logits, "logits")
    close(got.loss, want.loss, "loss")
    local = ref.config.num_experts // world
    experts = {f"{n}.{p}" for n in names for p in ("gate_up_proj", "down_proj")}
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if name in experts:
            full = b.grad.clone()
            dist.all_reduce(full)
            close(a.grad, full[rank * local:(rank + 1) * local], f"rank {rank} {name}")
        else:
            close(a.grad, b.grad, f"rank {rank} {name}")


@pytest.mark.slow
def test_transformers_backend_uses_the_exchange():
    pytest.importorskip("transformers")
    from _ranks import run_ranks

    run_ranks(_hf_ranks, 2)


# ---- misuse: refused before any collective ------------------------------------------------
def _unconnected_transport(world=2, capacity=64, row_bytes=64, experts=8):
    """A gloo transport of rank 0 that never talks to anyone: for checks that must refuse
    bad arguments before the first collective."""
    from graphstash.moe.exchange import GlooTransport

    layout = X.RegionLayout(world, capacity, row_bytes, experts)
    return GlooTransport(kind="gloo", rank=0, world_size=world, layout=layout,
                         region=torch.zeros(layout.nbytes, dtype=torch.uint8),
                         table=torch.zeros(X.XF_FIELDS, world, dtype=torch.int64), timeout_s=1.0)


def test_exchange_misuse_is_refused(gen):
    from graphstash.models import MoEConfig, MoEModel
    from graphstash.moe import dispatch
    from graphstash.moe.exchange import build_ipc_transport, build_local_transports

    from _moe_data import tokens

    t = _unconnected_transport()
    x = tokens(12, 16, gen)                    # 12 x 16 float32: 64-byte rows
    idx, w = routing(12, 2, 8, gen)
    with pytest.raises(TypeError, match="exchange: expected None, a graphstash.moe.RowExchange"):
        dispatch(x, idx, w, 8, budget=32, exchange=object())
    with pytest.raises(ValueError, match="dispatch: give exchange= alone"):
        dispatch(x, idx, w, 8, budget=32, exchange=t, chunk_rows=4)
    with pytest.raises(ValueError, match="dispatch: give exchange= alone"):
        dispatch(x, idx, w, 8, budget=32, exchange=t, group=object())
    with pytest.raises(ValueError, match="chunk_rows: NCCL's chunks need a group"):
        dispatch(x, idx, w, 8, budget=32, chunk_rows=4)
    with pytest.raises(ValueError, match="budget: 100 rows do not fit the exchange's 64"):
        dispatch(x, idx, w, 8, budget=100, exchange=t)
    with pytest.raises(ValueError, match="topk_idx: 72 rows do not fit the exchange's 64"):
        dispatch(tokens(36, 16, gen), *routing(36, 2, 8, gen), 8, budget=32, exchange=t)
    with pytest.raises(ValueError, match="rows of 128 bytes do not fit the exchange's 64-byte"):
        dispatch(tokens(12, 32, gen), idx, w, 8, budget=32, exchange=t)
    with pytest.raises(ValueError, match="num_experts: expected a multiple of the exchange's 2"):
        dispatch(x, idx.clamp(max=6), w, 7, budget=32, exchange=t)
    with pytest.raises(ValueError, match="num_experts: the exchange was built for at most 8"):
        dispatch(x, idx, w, 10, budget=32, exchange=t)
    for flags, why in ((torch.zeros(3, dtype=torch.int64), "int64"),
                       (torch.zeros(17, dtype=torch.int32), "17 elements"),
                       (torch.zeros(2, 2, dtype=torch.int32), "2-D")):
        with pytest.raises(ValueError, match="flags: expected a contiguous int32 tensor"):
            t.all_reduce_flags_(flags)
    with pytest.raises(ValueError, match="exchange: the plain peer sends its rows"):
        MoEModel(MoEConfig(hidden=16, ffn=8, num_experts=8, layers=1), mode="plain", exchange=t)
    t.close()
    with pytest.raises(ValueError, match="exchange: the transport was closed"):
        dispatch(x, idx, w, 8, budget=32, exchange=t)
    with pytest.raises(ValueError, match="capacity_rows: expected an int > 0, got 0"):
        build_local_transports(2, capacity_rows=0, row_bytes=64, max_experts=8)
    with pytest.raises(TypeError, match="timeout_s: expected a number of seconds"):
        build_local_transports(2, capacity_rows=8, row_bytes=64, max_experts=8, timeout_s="1")
    with pytest.raises(ValueError, match="device: the IPC transport needs a CUDA device"):
        build_ipc_transport(capacity_rows=8, row_bytes=64, max_experts=8, device="cpu")
