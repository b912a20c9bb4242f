"""The benches' new runs on a GPU, small: ``--profile`` finds the grouped GEMMs and the optimizer
in the kernels the profiler records from graph replays, the compiled MoE modes capture with
Inductor, and every ``bench hf`` run of a small OLMoE finishes and trains as HF eager does.
No timing is asserted (the figures come from ``graphstash bench``)."""
from __future__ import annotations

import pytest
import torch

from graphstash.models import MoEConfig
from graphstash.tools import training
from graphstash.tools.bench import hf, moe
from graphstash.tools.cli import build_parser

pytestmark = pytest.mark.gpu

SMALL = MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=2, num_tokens=1024,
                  capacity_factor=1.0, gated=True)


def _cuda():
    return torch.device("cuda", torch.cuda.current_device())


def _batches(gen):
    seed = int(torch.randint(1 << 20, (1,), generator=gen))
    return training.batches(SMALL, 4, seed=seed, device=_cuda(), dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", ["plain graph", "graph + budget"])
def test_profile_finds_grouped_gemms_and_the_optimizer_in_replays(gen, mode):
    figures = moe.run_mode(mode, SMALL, None, _cuda(), _batches(gen), 3, profile=True)
    kernels = figures["kernels"]
    assert kernels is not None and kernels["kernels_per_step"] > 0, kernels
    shares = kernels["shares"]
    assert shares["grouped GEMM"] > 0.01 and shares["optimizer"] > 0.01, shares
    assert sum(shares.values()) == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain compiled eager", "plain compiled graph",
                                  "graph + budget compiled"])
def test_compiled_moe_modes_run_with_inductor(gen, mode):
    figures = moe.run_mode(mode, SMALL, None, _cuda(), _batches(gen), 3)
    assert figures["step_ms"] > 0 and figures["reruns"] == 0
    assert figures["peak_mib"] > 0 and figures["activation_peak_mib"] > 0


@pytest.mark.slow
def test_every_hf_run_of_a_small_olmoe_finishes_and_trains_alike():
    c = hf.HFBenchConfig("olmoe", hidden=256, layers=2, num_experts=8, topk=2, ffn=256,
                         vocab=1024, heads=4, kv_heads=4, head_dim=None, batch=2, seq_len=256,
                         steps=6)
    args = build_parser().parse_args(["bench", "hf"])
    runs = hf.run(args=args, configs={"small olmoe": c})["small olmoe"]
    for name in ("HF grouped_mm eager", "HF grouped_mm + compile",
                 "HF grouped_mm + compile (reduce-overhead)", "graphstash + graph_step",
                 "graphstash + compile", "graphstash + compile + graph_step"):
        res = runs[name]
        assert res["error"] is None, (name, res["error"])
        assert res["max_rel_loss_diff"] < 5e-3, (name, res["losses"])
        assert res["peak_mib"] > 0 and res["tokens_per_s"] > 0
    ours = runs["graphstash + compile + graph_step"]
    assert ours["captures"] == 1 and ours["reruns"] == 0
