"""``graphstash bench moe --ep 2`` on one GPU, small: ranks as processes sharing the GPU over
CUDA IPC (threads are not offered on a GPU: NOTE [expert-parallel bench launch]). The
transport rows run, capture, replay and count their bytes on the device; the peers say why
they cannot run there. Timed figures are the bench's business, not asserted here."""
from __future__ import annotations

import pytest

from graphstash.tools import cli
from graphstash.tools.bench import moe_ep
from graphstash.tools.bench.ep_rows import TRANSPORT_ROWS

pytestmark = pytest.mark.gpu

SMALL = ("--hidden", "256", "--ffn", "512", "--experts", "8", "--topk", "2", "--tokens", "1024",
         "--layers", "2", "--steps", "3", "--capacity-factor", "1.25")


def _run(monkeypatch, *argv) -> dict:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = cli.build_parser().parse_args(["bench", "moe", "--ep", "2", *SMALL, *argv])
    return moe_ep.run(quick=False, args=args)["custom"]


def _check_transport_rows(entry: dict, kind: str) -> None:
    results = entry["results"]
    for row in ("eager peer", "nccl chunks"):
        assert results[row]["error"].startswith("not available: "), results[row]
    for row in TRANSPORT_ROWS:
        r = results[row]
        assert "error" not in r, (row, r)
        resent = ", resent" if row == "live rows + resend" else ""
        assert r["exchange"] == f"live rows over {kind}{resent}", r
        assert r["step_ms"] > 0 and r["sent_mib"] > 0 and r["meta_kib"] > 0, (row, r)
        assert r["calls"] == 2 + 1 + 3
        assert r["bytes_counted"] == "device counters, timed steps"
    live, worst = results["live rows"], results["worst-case buffers"]
    # the same rows move through both (the same routing, up to bf16 rounding of the router)
    assert abs(live["sent_mib"] / worst["sent_mib"] - 1) < 0.02, (live, worst)
    # a budget of 1.25x the average rows keeps less than one of every row any rank could send
    assert live["activation_peak_mib"] < worst["activation_peak_mib"], (live, worst)
    assert results["live rows + stash"]["groups"] > 0
    local = results["no exchange"]              # nothing sent (NOTE [no-exchange row])
    assert local["exchange"] == "one device" and local["sent_mib"] == 0, local
    assert local["step_ms"] > 0 and local["calls"] == 2 + 1 + 3, local


def test_processes_sharing_the_gpu_run_the_transport_rows(monkeypatch, capsys):
    entry = _run(monkeypatch, "--transport", "ipc")
    assert entry["ep"]["kind"] == "processes"
    _check_transport_rows(entry, "ipc")
    print(capsys.readouterr().out)


def test_a_step_told_not_to_release_the_warmup_cache_captures_without_it(monkeypatch):
    import torch

    import graphstash
    from graphstash.graph import capture_memory

    def refused(device):
        raise AssertionError("the capture synchronized the device and released the cache")

    monkeypatch.setattr(capture_memory, "release_warmup_cache", refused)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-3, fused=True, capturable=True)

    @graphstash.graph_step(optimizer=opt, release_warmup_cache=False)
    def step(x):
        loss = (x @ w).square().mean()
        loss.backward()
        return loss.detach()

    for _ in range(4):
        step(torch.randn(8, 64, device="cuda"))
    assert step.stats.captures == 1 and step.stats.replays == 2


def test_profile_gives_each_rank_the_exchange_kernels_share(monkeypatch):
    """``--ep 2 --profile`` on one GPU: each rank's profile of the transport rows finds the
    live-row exchange's kernels (``gs_xchg_*``) beside the grouped GEMMs and the optimizer."""
    entry = _run(monkeypatch, "--transport", "ipc", "--profile", "--modes", "live rows")
    kernels = entry["results"]["live rows"]["kernels"]
    assert len(kernels) == 2, kernels                       # one per rank, in rank order
    for k in kernels:
        shares = k["shares"]
        assert shares["exchange"] > 0 and shares["grouped GEMM"] > 0, shares
        assert shares["optimizer"] > 0 and sum(shares.values()) == pytest.approx(1.0)
