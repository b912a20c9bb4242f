"""``graphstash bench stash``'s runs on the GPU: the figures its configurations report (peak
memory with and without the stash, the prefetch point's effect, the steady state's step time
and copies beside compute) hold what the benchmark claims."""
from __future__ import annotations

import pytest
import torch

from graphstash.models import ExpertStack, make_inputs
from graphstash.stash import StashConfig
from graphstash.tools.bench.stash import config_run, sized_peak

pytestmark = pytest.mark.gpu


def _device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.xfail(strict=True, reason=(
    "acceptance not reachable with device_factor 1.10: measured peak ratio 0.73 on an H200, "
    "0.66 with StashConfig(prefetch='after_release'); the floor is 0.606 (see the docstring); "
    "exact-size eager itself is 0.61"))
def test_memory_8_layers_budget_twice_live(capsys):
    """The acceptance bound of 0.6. With A the bytes one layer saves at budget size: the plain
    step of a stack of equal layers peaks where it holds all eight layers' saved tensors, at
    the end of the forward or the start of the backward (graphstash.memory.profile shows it here):
    8A + T with T the temporaries there. At that point the stash step holds the same T, a
    pool of at least 1.10 x 7 x A/2 (seven layers' live rows; the eighth layer's backward
    follows its forward) and the last layer's tensors at budget size: 4.85A + T, a ratio of
    at least 0.606 whatever T is."""
    layers, budget, hidden, ffn = 8, 8192, 1024, 4096
    _, res = config_run("memory", layers, budget, hidden, ffn, iters=3, graphs=False,
                         device=_device(), profile_overlap=False)
    mib = 1 / 2**20
    ratio = res["peak_stash"] / res["peak_plain"]
    with capsys.disabled():
        print(f"\npeak MiB: plain {res['peak_plain'] * mib:.1f}, stash {res['peak_stash'] * mib:.1f} "
              f"(pool {res['pool_bytes'] * mib:.1f} + step {res['peak_stash_above_pool'] * mib:.1f}), "
              f"exact-size eager {res['peak_exact'] * mib:.1f}; ratio {ratio:.3f}; left over MiB "
              f"plain {res['left_plain'] * mib:.1f} stash {res['left_stash'] * mib:.1f}; step ms "
              f"plain {res['time_plain_ms']:.2f} stash {res['time_stash_ms']:.2f}; copy overlap "
              f"{res['copy_overlap']:.1%} ({res['overlap_method']})")
    saved = layers * budget * (hidden + 2 * ffn) * 2      # bf16 tensors autograd saves
    # every number is a real peak: plain holds at least every saved activation, the others
    # are positive, and the stash number includes a pool that holds the stashed live rows
    assert res["peak_plain"] >= saved, res
    assert res["peak_exact"] > 0 and res["peak_stash_above_pool"] > 0, res
    assert res["pool_bytes"] >= res["stashed_bytes"] > 0, res
    assert res["peak_stash"] == res["peak_stash_above_pool"] + res["pool_bytes"], res
    # a step frees what it allocated (kept tensors do not linger in reference cycles)
    assert abs(res["left_stash"] - res["left_plain"]) < 2**20, res
    assert min(ratio, res["peak_stash_after_release"] / res["peak_plain"]) <= 0.6, res


def test_after_release_prefetch_lowers_the_peak(gen):
    """The reload issued once the previous group's backward released its tensors takes their
    memory; issued at the last unpack it sits beside that backward's temporaries."""
    layers, budget, hidden, ffn = 4, 4096, 512, 2048
    model = ExpertStack(layers, hidden, ffn, dtype=torch.bfloat16, device="cuda", generator=gen)
    x = make_inputs(1, budget, hidden, dtype=torch.bfloat16, device="cuda", generator=gen)[0]
    counts = [torch.tensor([budget // 2], dtype=torch.int32, device="cuda")
              for _ in range(layers)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    peaks = {point: sized_peak(model, x, counts, _device(), StashConfig(prefetch=point))
             for point in ("at_last_unpack", "after_release")}
    group_bytes = budget * (hidden + 2 * ffn) * 2        # one layer's saved tensors
    assert peaks["after_release"] <= peaks["at_last_unpack"] - group_bytes // 4, peaks


def test_steady_state_step_time_and_overlap_compute_heavy(capsys):
    # the benchmark's compute-heavy configuration (graphstash bench stash)
    _, res = config_run("compute-heavy", 8, 8192, 4096, 16384, iters=5, graphs=True,
                         device=_device())
    with capsys.disabled():
        print(f"\nstep ms eager plain {res['time_plain_ms']:.2f} stash {res['time_stash_ms']:.2f}; "
              f"graph plain {res.get('graph_plain_ms', float('nan')):.2f} stash "
              f"{res.get('graph_stash_ms', float('nan')):.2f}; cudaMallocs in timed stash steps "
              f"{res['mallocs_in_timed_stash_steps']}; sync {res['steady_state_sync']}; copy "
              f"time beside compute {res['copy_overlap']:.1%} ({res['overlap_method']})")
    assert res["steady_state_sync"] is None, res["steady_state_sync"]
    assert res["mallocs_in_timed_stash_steps"] == 0, res
    assert "graph_error" not in res, res["graph_error"]
    assert not res["status_after"]["overflow"], res["status_after"]
    # the step-time ratio itself is a benchmark figure (graphstash bench stash), not asserted
    # here: it moved between 1.04 and 1.06 from run to run on one H200
    assert res["graph_stash_ms"] > 0 and res["time_stash_ms"] > 0, res
    # the copies run beside compute: copies serialised on the compute stream would overlap no
    # other kernel (0). How much of them overlaps is a benchmark figure (graphstash bench
    # stash: 79.6 % alone on an H200); beside the other test processes of a parallel suite on
    # the same GPU it fell to 33 % in one run, so only its being there is asserted
    assert res["copies"], "no stash/reload intervals were recorded"
    assert res["overlap_method"] == "kernel trace", res.get("overlap_trace_error")
    assert res["copy_overlap"] > 0.05, (res["copy_overlap"], res["copies"])
