"""The expert-parallel bench's rows on the CPU: two gloo ranks (and four, slow) build the rows
``graphstash bench moe --ep N`` builds (:mod:`graphstash.tools.bench.ep_rows`; the gloo
transport, eager; ``graph_step`` runs every call eagerly here) at a tiny size, run the same
three steps on each, and check that

- every row's first step (eager peer, nccl chunks, worst-case buffers, live rows, live rows +
  stash, and the live rows built by ``MoEModel(config, group=g)`` itself) gives the one-device
  reference's loss and every gradient (the experts' of this rank, the replicated ones summed
  over the ranks), the reference gradients far from zero;
- the live-row rows (``live rows``, ``live rows + stash``) give the worst-case row's losses and
  gradients, and the eager peer's within float32 rounding;
- the bytes the bench reports for a step (:func:`~graphstash.tools.bench.ep_rows.
  transport_bytes` of the transport's device counters; the peer's split sizes through
  :func:`~graphstash.tools.bench.moe.count_exchange`) equal the live rows times the row bytes
  (and the router weights beside them), plus the counts, flags and signals, counted from the
  routing each layer's router chose on every rank.

The data: each rank's batches from :func:`graphstash.tools.training.batches` (seed ``4321 +
rank``), the model from seed 0 on every row, as the bench does.

``graphstash bench moe --ep 4 --device cpu`` itself, as a user runs it, is the last test here:
every row finishes and reports its columns, under balanced and skewed routing.
"""
from __future__ import annotations

import math

import pytest
import torch

from graphstash.moe.exchange import layout as X
from graphstash.status import MAX_STEP_PEAKS

from _grad_checks import assert_grads_close

T, H, E, K, LAYERS, CALLS = 12, 16, 8, 2, 2, 3   # E divides over 2, 4 and 8 ranks


def _stash_config():
    """Every group stashed, pages of 4 rows, room for twice the first step's live rows: a
    rank's dozen rows swing by a third between these batches, and a step over what the stash
    holds reruns (NOTE [rows the stash keeps]; tests/test_rows_kept.py), which these tests,
    counting each call's bytes, do not want."""
    from graphstash.stash import StashConfig

    return StashConfig(policy="always", min_tensor_bytes=0, page_size=4, device_factor=2.0)
ROW_BYTES, WEIGHT_BYTES = H * 4, 4              # float32 rows and router weights


def _config(**over):
    from graphstash.models import MoEConfig

    fields = dict(hidden=H, ffn=24, num_experts=E, topk=K, layers=LAYERS, num_tokens=T,
                  capacity_factor=1.5, gated=True)
    fields.update(over)
    return MoEConfig(**fields)


def _routing_of(model):
    """Hooks that record each block's routing, ``[T, K]`` expert ids per layer per call, as
    ``MoEBlock.route`` chooses it (softmax of the router's logits, top-k)."""
    seen = []

    def hook(module, inputs, logits):
        seen.append(torch.topk(torch.softmax(logits.detach().float(), -1), K).indices)

    handles = [b.router.register_forward_hook(hook) for b in model.blocks]
    return seen, handles


def _run_row(row, rank, world, batches, own=False, config=None):
    """Build ``row`` as the bench does, run :data:`CALLS` steps; per call the loss, every
    gradient, the routing of each layer, and the bytes the bench would report. ``own``: the
    live rows as the bench builds them under torchrun, README's ``MoEModel(config, group=g)``
    building its own transport (no bytes counted). ``config``: default :func:`_config`."""
    import torch.distributed as dist

    from graphstash.moe.exchange import build_gloo_transport
    from graphstash.tools.bench.ep_rows import (TRANSPORT_ROWS, build_row, transport_bytes,
                                                transport_sizes)
    from graphstash.tools.bench.moe import count_exchange
    from graphstash.tools.training import quiet_cpu_graph_step

    config = _config() if config is None else config
    group = dist.group.WORLD
    transport = None
    if row in TRANSPORT_ROWS and not own:
        transport = build_gloo_transport(**transport_sizes(row, config, world, torch.float32))
    stash = _stash_config()
    run = build_row(row, config, torch.device("cpu"), torch.float32, world_size=world,
                    group=group, transport=transport, stash=stash)
    if transport is not None:        # receive room: every row any rank could send, or the budget
        worst = row == "worst-case buffers"
        assert run.model.config.capacity_factor == (world if worst else config.capacity_factor)
        assert transport.capacity_rows == (world * T * K if worst else 36), transport
    seen, handles = _routing_of(run.model)
    calls = []
    for x, y in batches:
        before = transport.counters() if transport is not None else None
        with quiet_cpu_graph_step(False), count_exchange(
                group if transport is None else None) as sent:
            loss = run.step(x, y)
        if transport is not None:
            moved = transport_bytes(before, transport.counters(), 1)
            moved["barriers"] = transport.counters()["barriers"] - before["barriers"]
        else:
            moved = {"sent": sent[0]}
        calls.append({"loss": loss.clone(),
                      "grads": {n: p.grad.clone() for n, p in run.model.named_parameters()},
                      "routing": seen[-LAYERS:], "bytes": moved})
        if len(calls) == 1:
            calls[0]["experts"] = {n for n, p in run.model.named_parameters()
                                   if any(p is q for q in run.model.expert_parameters())}
        assert len(seen) == LAYERS * len(calls), "a rerun ran the forward again"
    for h in handles:
        h.remove()
    if run.graph is not None:
        stats = run.graph.stats
        assert (stats.over_budget, stats.eager_reruns, stats.overflows) == (0, 0, 0), stats
    if own:
        assert run.model.exchange_kind == "live rows over gloo", run.model.exchange_kind
    if row == "live rows + stash":
        assert sum(r["stashed"] for r in run.stash_manager.plan()) > 0, "nothing was stashed"
    if transport is not None:
        transport.check()
        transport.close()
    return calls


def _live_counts(routing, rank, world):
    """Per layer ``(mine, away, received)``: this rank's pairs kept at home, its pairs sent
    to other ranks, and the pairs of other ranks it receives (all live: the budget holds)."""
    import torch.distributed as dist

    local = E // world
    out = []
    for idx in routing:
        every = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(every, idx)
        owner = [t // local for t in every]
        mine = int((owner[rank] == rank).sum())
        received = sum(int((owner[s] == rank).sum()) for s in range(world) if s != rank)
        out.append((mine, idx.numel() - mine, received))
    return out


def _reference_first_call(rank: int, world: int) -> tuple:
    """The one-device model (every expert, dropless, the rows' seed 0) on every rank's first
    batch: rank ``rank``'s loss, ``sum_r mean((out_r - y_r)^2)``'s gradients by name (the
    gradient every rank's loss gives, as the ranks' together), and the expert names."""
    from graphstash.models import MoEModel
    from graphstash.tools.training import batches as make_batches

    firsts = [make_batches(_config(), 1, seed=4321 + r, device="cpu", dtype=torch.float32)[0]
              for r in range(world)]
    ref = MoEModel(_config(), mode="dropless", seed=0)
    out = ref(torch.cat([x for x, _ in firsts])).float()
    losses = [(o - y).pow(2).mean() for o, (_, y) in zip(out.chunk(world), firsts)]
    sum(losses).backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    return losses[rank].detach(), grads


def _check_against_reference(row: str, first: dict, reference: tuple, rank: int,
                             world: int) -> None:
    """``row``'s first call against :func:`_reference_first_call`: the loss, this rank's expert
    slices, the replicated gradients summed over the ranks (a collective: every rank checks
    the rows in the same order)."""
    import torch.distributed as dist

    loss, full = reference
    torch.testing.assert_close(first["loss"], loss, rtol=1e-5, atol=0,
                               msg=lambda m: f"rank {rank} {row}: loss: {m}")
    local = E // world
    got, want = {}, {}
    for name, g in first["grads"].items():
        if name in first["experts"]:
            got[name], want[name] = g, full[name][rank * local:(rank + 1) * local]
        else:
            summed = g.clone()
            dist.all_reduce(summed)
            got[name], want[name] = summed, full[name]
    try:
        assert_grads_close(got, want, rel=1e-5)
    except AssertionError as exc:
        raise AssertionError(f"rank {rank} {row}: {exc}") from None


def _bench_rows_ranks(rank: int, world: int) -> None:
    from graphstash.tools.training import batches as make_batches

    torch.set_num_threads(1)
    batches = make_batches(_config(), CALLS, seed=4321 + rank, device="cpu",
                           dtype=torch.float32)
    got = {row: _run_row(row, rank, world, batches)
           for row in ("worst-case buffers", "live rows", "live rows + stash",
                       "live rows + resend", "gathered tokens", "gathered tokens + resend",
                       "eager peer")}
    got["live rows, built by the model"] = _run_row("live rows", rank, world, batches, own=True)
    # NCCL's chunks of every row a rank could send to another: no step over budget to rerun
    got["nccl chunks"] = _run_row("nccl chunks", rank, world, batches,
                                  config=_config(chunk_factor=float(world)))
    reference = _reference_first_call(rank, world)
    for row, calls in got.items():
        _check_against_reference(row, calls[0], reference, rank, world)
    worst = got["worst-case buffers"]
    for call in worst:                      # the reference gradients reach every parameter
        for name, g in call["grads"].items():
            assert float(g.abs().max()) > 1e-4, f"rank {rank}: gradient of {name} is ~0"
    for row in ("live rows", "live rows + stash", "live rows + resend",
                "live rows, built by the model"):
        for i, (a, b) in enumerate(zip(got[row], worst)):
            assert torch.equal(a["loss"], b["loss"]), (row, i, a["loss"], b["loss"])
            for name, g in a["grads"].items():
                assert torch.equal(g, b["grads"][name]), f"rank {rank} {row} call {i}: {name}"
            assert all(torch.equal(p, q) for p, q in zip(a["routing"], b["routing"]))
    # The peer sums in another order: float32 rounding, measured up to 2.4e-5 x max |grad| on
    # one element (an H200 host's CPU), where a wrong sign or scale is off by the whole grad.
    for i, (a, b) in enumerate(zip(got["eager peer"], worst)):
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=0)
        try:
            assert_grads_close(a["grads"], b["grads"], rel=1e-4)
        except AssertionError as exc:
            raise AssertionError(f"rank {rank} call {i}: {exc}") from None

    # bytes per step: what the bench reports against the live rows of every layer
    meta_per_layer = 4 * world * (X.X_HEADER + E) + 8 * (8 * world)   # counts; 8 barriers
    # the step's flags (summed) and its peaks (every slot, their maximum: NOTE [step peaks])
    meta_flags = 4 * world * (3 + MAX_STEP_PEAKS) + 8 * world
    every_call = [_live_counts(call["routing"], rank, world) for call in worst]
    for i, counts in enumerate(every_call):
        home = sum(m for m, _, _ in counts)
        away = sum(a for _, a, _ in counts)
        received = sum(r for _, _, r in counts)
        want = {"sent": (away + received) * (2 * ROW_BYTES + WEIGHT_BYTES),
                "local": home * (4 * ROW_BYTES + 2 * WEIGHT_BYTES),
                "meta": LAYERS * meta_per_layer + meta_flags,
                "rows": 2 * (home + away) + 2 * (home + received),
                "barriers": 8 * LAYERS + 1}
        for row in ("worst-case buffers", "live rows", "live rows + stash"):
            moved = got[row][i]["bytes"]
            assert {k: moved[k] for k in want} == want, (rank, row, i, moved, want)
        # the resend pushes each layer's rows again, without their weights, in a round of
        # its own (two barriers) (NOTE [resent rows]); a rank's own rows it copies from the
        # tokens, never pushes (NOTE [resent own rows])
        again = {"sent": want["sent"] + away * ROW_BYTES,
                 "local": want["local"],
                 "meta": want["meta"] + LAYERS * 8 * (2 * world),
                 "rows": want["rows"] + away,
                 "barriers": want["barriers"] + 2 * LAYERS}
        moved = got["live rows + resend"][i]["bytes"]
        assert {k: moved[k] for k in again} == again, (rank, i, moved, again)
        peer = got["eager peer"][i]["bytes"]["sent"]
        assert peer == (away + received) * 2 * ROW_BYTES \
            + LAYERS * (world - 1) * (E // world) * 8, (rank, i, peer)
        # gathered tokens (NOTE [gathered tokens]): per layer, every rank's [T, H] tokens
        # gathered, the partial outputs summed back, both again in backward, and the routing
        # and router weights gathered (their gradients summed back); the resend gathers the
        # tokens once more
        gathered = LAYERS * (world - 1) * (4 * T * ROW_BYTES + 3 * T * K * 4)
        assert got["gathered tokens"][i]["bytes"]["sent"] == gathered, (rank, i)
        assert got["gathered tokens + resend"][i]["bytes"]["sent"] == \
            gathered + LAYERS * (world - 1) * T * ROW_BYTES, (rank, i)
    # the check can fail: rows cross ranks and stay home in these batches
    assert all(sum(r for _, _, r in c) and sum(m for m, _, _ in c) for c in every_call)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_bench_rows_equal_the_reference_and_count_the_live_bytes(world):
    from _ranks import run_ranks

    run_ranks(_bench_rows_ranks, world)


def _bench_loop_ranks(rank: int, world: int):
    """The bench's whole measuring loop (``moe_ep.run_rank``) on two gloo ranks: every row
    measured, its figures combined over the ranks, JSON-able (NOTE [bench rows on the CPU] in
    graphstash/tools/bench/moe_ep.py)."""
    import json

    import torch.distributed as dist

    from graphstash.tools.bench import moe_ep
    from graphstash.tools.bench.ep_ranks import ProcessRanks
    from graphstash.tools.bench.ep_rows import ROWS
    from graphstash.tools.training import quiet_cpu_graph_step

    torch.set_num_threads(1)
    ranks = ProcessRanks(dist.group.WORLD, torch.device("cpu"), launch="torchrun",
                         transport="gloo")
    config = _config(num_experts=4)   # the sent-bytes ratio below holds for these batches
    plan = moe_ep.Plan(moe_ep.Launch("torchrun", world, "gloo"), {"tiny": config}, ROWS,
                       steps=2, fit=(),
                       stash=_stash_config())
    with quiet_cpu_graph_step(False):
        out = moe_ep.run_rank(ranks, plan)
    json.dumps(out)
    results = out["tiny"]["results"]
    assert list(results) == list(ROWS)
    for row, r in results.items():
        assert "error" not in r, (row, r)
        assert (r["over_budget"], r["overflow"], r["reruns"], r["calls"]) == (0, 0, 0, 5), r
        assert r["step_ms"] > 0 and (r["sent_mib"] > 0) == (row != "no exchange"), (row, r)
        assert r["vs_eager_peer"] is not None and r["vs_worst_case"] is not None
        assert r["vs_no_exchange"] == pytest.approx(
            r["step_ms"] / results["no exchange"]["step_ms"]), (row, r)
    # a rank's own experts, nothing sent (NOTE [no-exchange row])
    local = results["no exchange"]
    assert local["exchange"] == "one device" and local["bytes_counted"] == "nothing leaves the rank"
    assert (local["sent_mib"], local["local_mib"], local["meta_kib"]) == (0, 0, 0), local
    live, worst, stash = (results[r] for r in ("live rows", "worst-case buffers",
                                               "live rows + stash"))
    for key in ("sent_mib", "local_mib", "meta_kib"):
        assert live[key] == worst[key] == stash[key] > 0, key
    assert stash["stashed_groups"] > 0
    assert live["exchange"] == "live rows over gloo"
    assert results["nccl chunks"]["exchange"] == "nccl chunks"
    # the live rows move the peer's rows and their router weights beside them (the bench's
    # bf16: 2-byte elements); the peer also sends its counts
    rb, wb = 2 * H, 2
    ratio = live["sent_mib"] / results["eager peer"]["sent_mib"]
    assert 1.0 < ratio < (2 * rb + wb) / (2 * rb), ratio
    # NCCL's fixed chunks send every chunk row, live or not
    assert results["nccl chunks"]["sent_mib"] > results["eager peer"]["sent_mib"]
    return {row: round(r["sent_mib"] * 2**20) for row, r in results.items()}


def test_bench_loop_measures_every_row_on_two_gloo_ranks():
    from _ranks import run_ranks

    run_ranks(_bench_loop_ranks, 2)


def _no_exchange_ranks(rank: int, world: int):
    """The ``no exchange`` row as the bench builds it, three steps on each of two gloo ranks:
    no collective at all (NOTE [no-exchange row]). Where ranks share one GPU the world's
    group is gloo's, and a captured step cannot hold a gloo collective."""
    import torch.distributed as dist

    from graphstash.tools.bench.ep_rows import build_row
    from graphstash.tools.training import batches as make_batches
    from graphstash.tools.training import quiet_cpu_graph_step

    torch.set_num_threads(1)
    run = build_row("no exchange", _config(), torch.device("cpu"), torch.float32,
                    world_size=world, group=dist.group.WORLD)
    called = []
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single",
             "broadcast", "barrier", "reduce_scatter_tensor")
    saved = {n: getattr(dist, n) for n in names}

    def recorder(name):
        def call(*args, **kwargs):
            called.append(name)
            return saved[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, recorder(n))
    try:
        with quiet_cpu_graph_step(False):
            losses = [float(run.step(x, y)) for x, y in
                      make_batches(_config(), CALLS, seed=4321 + rank, device="cpu",
                                   dtype=torch.float32)]
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    assert run.graph is not None and run.graph.stats.steps == CALLS, run.graph.stats
    assert called == [], f"rank {rank}: the no-exchange row ran {called}"
    assert all(math.isfinite(v) for v in losses), losses


def test_the_no_exchange_row_runs_no_collective():
    from _ranks import run_ranks

    run_ranks(_no_exchange_ranks, 2)


def _profile_ranks(rank: int, world: int):
    """``--ep 2 --profile`` on two gloo ranks: every rank profiles each row's calls after the
    timed ones (here a stand-in for torch.profiler that sees the calls and names kernels: CUDA
    kernels are not there to record on the CPU), the shares reach rank 0 in rank order, and
    its table gives one line per row and rank with the exchange's share."""
    import contextlib
    import io

    import torch.distributed as dist

    from graphstash.tools.bench import kernel_share, moe_ep
    from graphstash.tools.bench.ep_ranks import ProcessRanks
    from graphstash.tools.training import quiet_cpu_graph_step

    calls = []

    def fake_profile(fn, steps):
        for _ in range(steps):
            fn()
            calls.append(1)
        exchange = 100.0 * (rank + 1)
        return kernel_share.shares([("gs_xchg_push_v16", exchange),
                                    ("ncclDevKernel_SendRecv", exchange),
                                    ("GemmUniversal<GroupProblemShape<>>", 600.0),
                                    ("FusedAdamMathFunctor", 200.0)], steps)

    torch.set_num_threads(1)
    original, moe_ep.profile_steps = moe_ep.profile_steps, fake_profile
    try:
        ranks = ProcessRanks(dist.group.WORLD, torch.device("cpu"), launch="torchrun",
                             transport="gloo")
        rows = ("eager peer", "live rows")
        plan = moe_ep.Plan(moe_ep.Launch("torchrun", world, "gloo"), {"tiny": _config()}, rows,
                           steps=1, fit=(), profile=True,
                           stash=_stash_config())
        printed = io.StringIO()
        with quiet_cpu_graph_step(False), contextlib.redirect_stdout(printed):
            out = moe_ep.run_rank(ranks, plan)
    finally:
        moe_ep.profile_steps = original
    assert len(calls) == len(rows) * moe_ep.PROFILE_STEPS      # the rows' calls, profiled
    for row in rows:
        kernels = out["tiny"]["results"][row]["kernels"]
        assert [k["shares"]["exchange"] for k in kernels] == [
            pytest.approx(200 / 1000), pytest.approx(400 / 1200)], (row, kernels)
        assert out["tiny"]["results"][row]["calls"] == 4 + moe_ep.PROFILE_STEPS
    text = printed.getvalue()
    if rank == 0:
        assert "kernel time per step on each rank" in text
        lines = [line.split() for line in text.splitlines() if line.startswith("live rows ")]
        # the main table's row, then one line per rank: rank, kernel ms, kernels, the shares
        assert [line[2:4] for line in lines[1:]] == [["0", "0.33"], ["1", "0.40"]], lines
        assert lines[1][5:10] == ["20.0%", "60.0%", "0.0%", "20.0%", "0.0%"], lines
        # each kind of exchange kernel, the largest over the ranks: rank 1's 200 us in 3 calls
        exchange = [line for line in text.splitlines() if ": exchange kernels," in line]
        assert [line.split(":")[0] for line in exchange] == list(rows), exchange
        assert all(line.endswith("): push 0.07, nccl 0.07") for line in exchange), exchange
    else:
        assert text == ""                                      # rank 0 prints


def test_expert_parallel_profile_gives_each_rank_its_shares():
    from _ranks import run_ranks

    run_ranks(_profile_ranks, 2)


# ---- `graphstash bench moe --ep 4 --device cpu`, as a user runs it ------------------------------
EP4 = ("bench", "moe", "--ep", "4", "--device", "cpu", "--hidden", "16", "--ffn", "24",
       "--experts", "8", "--topk", "2", "--tokens", "16", "--layers", "2", "--steps", "1")


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["balanced", "skew:1.5"])
def test_bench_moe_ep_four_gloo_ranks_reports_every_row(tmp_path, routing):
    """``graphstash bench moe --ep 4 --device cpu`` (four processes over gloo, every row
    eagerly) in a fresh process, balanced and skewed: every row finishes and reports each of
    its columns, in the table and in ``--json``; the worst-case row is never over budget, and
    every step over budget reruns once, the overflows none (nothing here fills a pool)."""
    import json
    import os
    import subprocess
    import sys

    import graphstash
    from graphstash.tools.bench.ep_rows import ROWS, TRANSPORT_ROWS
    from graphstash.tools.training import WARMUP

    path = tmp_path / "ep4.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    # the package this test imported, however it was found (installed, or a PYTHONPATH that
    # names the checkout relatively, which the fresh process in tmp_path would not resolve)
    root = os.path.dirname(os.path.dirname(os.path.abspath(graphstash.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "graphstash", *EP4, "--routing", routing,
                           "--json", str(path)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    entry = json.loads(path.read_text())["moe"]["custom"]
    assert entry["ep"]["world_size"] == 4 and entry["ep"]["transport"] == "gloo", entry["ep"]
    assert entry["config"]["routing"] == routing and entry["config"]["num_experts"] == 8
    results = entry["results"]
    assert list(results) == list(ROWS)
    local = results.pop("no exchange")
    if routing == "balanced":                # balanced routing only (NOTE [no-exchange row])
        assert local["exchange"] == "one device" and local["sent_mib"] == 0, local
        assert local["reruns"] == local["over_budget"] and local["overflow"] == 0, local
        for r in results.values():
            assert r["vs_no_exchange"] == pytest.approx(r["step_ms"] / local["step_ms"]), r
    else:
        assert local == {"error": f"not available: under routing {routing} the rows a rank "
                         "receives depend on every rank's routing (NOTE [no-exchange row]); "
                         "balanced routing only"}, local
        assert all(r["vs_no_exchange"] is None for r in results.values()), results
    kinds = {"eager peer": "all_to_all (plain peer)", "nccl chunks": "nccl chunks",
             "live rows + resend": "live rows over gloo, resent",
             "gathered tokens": "gathered tokens", "gathered tokens + resend": "gathered tokens"}
    for row, r in results.items():
        assert "error" not in r, (row, r)
        assert r["exchange"] == kinds.get(row, "live rows over gloo"), (row, r)
        assert r["calls"] == WARMUP + 1 + 1, (row, r)
        spread = r["step_ms_spread"]
        assert 0 < spread["min"] <= r["step_ms"] <= spread["max"], (row, r)
        assert r["peak_mib"] is None and r["activation_peak_mib"] is None   # no CPU figures
        assert r["sent_mib"] > 0 and r["local_mib"] >= 0, (row, r)
        assert (r["meta_kib"] > 0) == (row in TRANSPORT_ROWS), (row, r)
        for ratio in ("vs_eager_peer", "vs_worst_case", "sent_vs_eager_peer"):
            assert r[ratio] is not None and r[ratio] > 0, (row, ratio, r)
        flags = [r[k] for k in ("over_budget", "overflow", "reruns", "recaptures")]
        assert all(isinstance(f, int) and f >= 0 for f in flags), (row, r)
        assert r["reruns"] == r["over_budget"] and r["overflow"] == 0, (row, r)
        # a step over a dispatch budget reruns dropless (NOTE [rerun by capture] in
        # graphstash/graph/_step.py: only a stash overflow reruns with the stash grown)
        assert r["dropless_reruns"] == r["reruns"], (row, r)
        assert (r["budgets"] is None) == (row == "eager peer"), (row, r)
    assert results["worst-case buffers"]["over_budget"] == 0
    # the table: its title, then one line per row with its step time and flags
    out = done.stdout
    assert (f"routing {routing}, overlap SMs default, EP=4 as 4 processes on the CPU over "
            "gloo") in out, out
    line = [x for x in out.splitlines() if x.startswith("no exchange  ")]
    assert len(line) == 1 and ("not available" in line[0]) == (routing != "balanced"), out
    for row, r in results.items():
        line = [x for x in out.splitlines() if x.startswith(row + "  ")]
        assert len(line) == 1, (row, out)
        assert f"{r['over_budget']}, 0, {r['reruns']}, {r['recaptures']} of 4 calls" in line[0]
        assert float(line[0][len(row):].split()[0]) == pytest.approx(r["step_ms"], abs=0.01)
