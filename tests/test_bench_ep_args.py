"""``graphstash bench moe --ep N``: the flags, the launch they choose, the configurations and
rows, the layers that fit, the table, and the threads' coordination (all on the CPU; the bench
itself runs on GPUs: tests/test_bench_ep_gpu.py, docs/exchange.md)."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from graphstash.models import PRESETS
from graphstash.tools import cli, options
from graphstash.tools.bench import ep_ranks, ep_rows, moe, moe_ep
from graphstash.tools.bench.moe_ep import Launch


def _args(*argv):
    return cli.build_parser().parse_args(["bench", "moe", *argv])


@pytest.mark.parametrize("argv, world, gpu, launch", [
    (("--ep", "2"), None, False, Launch("processes", 2, "gloo")),
    (("--ep", "2", "--transport", "gloo"), None, False, Launch("processes", 2, "gloo")),
    (("--ep", "2", "--device", "cpu"), None, True, Launch("processes", 2, "gloo")),
    (("--ep", "2"), None, True, Launch("processes", 2, "ipc")),
    (("--ep", "4", "--transport", "local"), None, False, Launch("threads", 4, "local")),
    (("--ep", "2", "--transport", "ipc"), None, True, Launch("processes", 2, "ipc")),
    (("--ep", "2"), "2", True, Launch("torchrun", 2, "auto")),
    (("--transport", "symmetric"), "2", True, Launch("torchrun", 2, "symmetric")),
    (("--transport", "nccl"), "4", True, Launch("torchrun", 4, "nccl")),
    (("--ep", "2", "--transport", "ipc"), "1", True, Launch("processes", 2, "ipc")),
])
def test_the_flags_and_the_launcher_choose_how_ranks_run(monkeypatch, argv, world, gpu, launch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    args = _args(*argv)
    assert moe_ep.requested(args)
    assert moe_ep.launch_from_args(args) == launch
    assert not moe_ep.requested(_args("--preset", "mixtral-8x7b"))


BAD = [
    (("--ep", "1"), None, "--ep: expected an int >= 2, got 1"),
    (("--ep", "0"), None, "--ep: expected an int >= 2, got 0"),
    (("--ep", "3"), None, "--ep: expected ranks that split the experts evenly"),
    (("--ep", "2", "--transport", "symmetric"), None,
     "--transport: 'symmetric' needs one process per GPU: launch with torchrun"),
    (("--ep", "2", "--transport", "nccl"), None, "--transport: 'nccl' needs one process per GPU"),
    (("--transport", "ipc"), None, "--ep: expected the number of expert-parallel ranks"),
    (("--ep", "4"), "2", "--ep: expected the launcher's WORLD_SIZE=2 (one rank per process), "
                         "got 4"),
    (("--transport", "local"), "2", "--transport: 'local' runs the ranks itself (threads of one "
                                    "process"),
    (("--ep", "2", "--transport", "local"), None,
     "--transport: 'local' (ranks as threads of one process) is not offered on a GPU"),
    (("--ep", "2"), "two", "--ep: the launcher's WORLD_SIZE must be an int, got 'two'"),
    (("--ep", "2", "--device", "cpu"), "2",
     "--device: under torchrun (WORLD_SIZE=2) every process is a rank on its own CUDA GPU, and "
     "--device cpu asks for none; on the CPU run it without torchrun"),
    (("--ep", "2", "--modes", "graph + budget"), None,
     "--modes: expected names from eager peer, nccl chunks, worst-case buffers, live rows, "
     "live rows + stash, live rows + resend, gathered tokens, gathered tokens + resend, "
     "no exchange with --ep, got 'graph + budget'"),
    (("--ep", "4", "--hidden", "64", "--ffn", "32", "--experts", "6", "--topk", "2"), None,
     "--experts: expected a multiple of the 4 ranks, got 6"),
    (("--ep", "2", "--layers", "0"), None, "--layers: expected a positive int, got 0"),
    (("--ep", "2", "--capacity-factor", "inf"), None, "--capacity-factor: expected a finite"),
    (("--ep", "2", "--overlap-sms", "-1"), None,
     "--overlap-sms: expected 0 (no overlap) or more multiprocessors, got -1"),
]


@pytest.mark.parametrize("argv, world, message", BAD)
def test_bad_flags_stop_before_any_work_naming_the_flag(capsys, monkeypatch, argv, world,
                                                        message):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)

    def no_work(*args, **kwargs):
        raise AssertionError("the bench started working before checking its flags")

    monkeypatch.setattr(moe_ep, "run", no_work)
    monkeypatch.setattr(moe_ep, "build_row", no_work)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # checked before the GPU
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "moe", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphstash bench: error: "), lines
    assert message in lines[0], lines


def test_an_unknown_transport_is_refused_by_its_flag(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "moe", "--ep", "2", "--transport", "tcp"])
    assert info.value.code == 2
    assert "--transport" in capsys.readouterr().err


def test_configurations_take_the_expert_parallel_defaults(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    got = moe_ep.configs_from_args(_args("--ep", "2"), quick=False)
    assert set(got) == set(PRESETS)               # the presets only, not the one-GPU configs
    for name, c in got.items():
        assert (c.capacity_factor, c.chunk_factor, c.num_tokens) == (2.0, 2.0, 8192), name
        assert (c.hidden, c.num_experts, c.gated) == (PRESETS[name].hidden,
                                                      PRESETS[name].num_experts, True)
    one = moe_ep.configs_from_args(_args("--ep", "2", "--preset", "mixtral-8x7b", "--layers", "3",
                                         "--capacity-factor", "1.25"), quick=False)
    assert list(one) == ["mixtral-8x7b"]
    assert (one["mixtral-8x7b"].layers, one["mixtral-8x7b"].capacity_factor,
            one["mixtral-8x7b"].chunk_factor) == (3, 1.25, 1.25)
    quick = moe_ep.configs_from_args(_args("--ep", "2", "--tokens", "512"), quick=True)
    assert set(quick) == set(moe.QUICK)
    assert all(c.num_tokens == 512 and c.capacity_factor == 2.0 for c in quick.values())
    custom = moe_ep.configs_from_args(_args("--ep", "4", "--hidden", "64", "--ffn", "32",
                                            "--experts", "8", "--topk", "2"), quick=False)
    assert list(custom) == ["custom"] and custom["custom"].num_experts == 8
    assert all(c.overlap_sms is None for c in got.values())       # the exchange's default
    overlap = moe_ep.configs_from_args(_args("--ep", "2", "--overlap-sms", "0"), quick=False)
    assert all(c.overlap_sms == 0 for c in overlap.values())


def test_the_moe_suite_hands_over_to_the_expert_parallel_bench(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = _args("--ep", "2", "--modes", "live rows, eager peer")
    assert moe.modes_from_args(args) == ("live rows", "eager peer")
    assert moe.modes_from_args(_args("--ep", "2")) == ep_rows.ROWS
    assert moe.configs_from_args(args, False) == moe_ep.configs_from_args(args, False)
    calls = []
    monkeypatch.setattr(moe_ep, "run", lambda quick, a, **kw: calls.append((quick, a)) or {"x": 1})
    assert moe.run(quick=True, args=args) == {"x": 1}
    assert calls == [(True, args)]
    assert moe.modes_from_args(_args()) == moe.MODES      # without --ep: the one-GPU modes


def test_rows_say_why_they_cannot_run_where_they_cannot():
    for launch in ("threads", "processes"):
        for row in ("eager peer", "nccl chunks"):
            why = ep_rows.unavailable(row, launch, "local")
            assert why.startswith("not available: "), (row, launch)
        for row in ep_rows.TRANSPORT_ROWS:
            assert ep_rows.unavailable(row, launch, "local") is None
    assert "Duplicate GPU" in ep_rows.unavailable("eager peer", "processes", "ipc")
    assert "no process group" in ep_rows.unavailable("nccl chunks", "threads", "local")
    for row in ep_rows.ROWS:
        assert ep_rows.unavailable(row, "torchrun", "auto") is None
        assert (ep_rows.unavailable(row, "torchrun", "nccl") is None) == \
            (row not in ep_rows.TRANSPORT_ROWS)
    for launch in ep_rows.LAUNCHES:         # nothing leaves its rank: it runs anywhere
        assert ep_rows.unavailable("no exchange", launch, "local") is None
    with pytest.raises(ValueError, match="row: expected one of"):
        ep_rows.unavailable("live", "threads", "local")


def test_the_no_exchange_row_is_one_rank_of_the_live_rows_less_the_exchange():
    """A rank's own experts on its own tokens, the same budget (NOTE [no-exchange row]); under
    any routing but balanced it says why it does not run, as it does where top-k exceeds a
    rank's experts."""
    from graphstash.models import MoEConfig, MoEModel

    c = MoEConfig(hidden=16, ffn=8, num_experts=8, topk=2, num_tokens=32, layers=2,
                  capacity_factor=1.25)
    assert ep_rows.unavailable("no exchange", "torchrun", "auto", c, 2) is None
    local = ep_rows.row_config("no exchange", c, 2)
    assert local == dataclasses.replace(c, num_experts=4)
    run = ep_rows.build_row("no exchange", c, torch.device("cpu"), torch.float32, world_size=2)
    assert run.graph is not None and run.model.exchange_kind == "one device"
    assert run.model.config == local
    # its experts are a rank's half of the whole model's: the same widths, half as many
    whole = [tuple(p.shape) for p in MoEModel(c).expert_parameters()]
    shapes = [tuple(p.shape) for p in run.model.expert_parameters()]
    assert shapes == [(s[0] // 2, *s[1:]) for s in whole] and shapes[0][0] == 4, shapes
    for routing in ("skew:1.5", "zipf:1.2", "drift"):
        skewed = dataclasses.replace(c, routing=routing)
        why = ep_rows.unavailable("no exchange", "torchrun", "auto", skewed, 2)
        assert why.startswith("not available: under routing ") and "balanced" in why, why
        with pytest.raises(ValueError, match="config: under routing"):
            ep_rows.row_config("no exchange", skewed, 2)
    why = ep_rows.unavailable("no exchange", "torchrun", "auto", c, 8)
    assert why == "not available: top-2 of a rank's 1 experts (8 over 8 ranks)", why
    with pytest.raises(ValueError, match="world_size: 8 experts do not divide over 3 ranks"):
        ep_rows.row_config("no exchange", c, 3)
    with pytest.raises(ValueError, match="world_size: expected an int >= 1"):
        ep_rows.unavailable("no exchange", "torchrun", "auto", c)


def test_the_worst_case_row_holds_every_row_any_rank_could_send():
    c = moe_ep.configs_from_args(_args("--ep", "2", "--preset", "qwen3-30b-a3b",
                                       "--capacity-factor", "1.25"), quick=False)["qwen3-30b-a3b"]
    T, K = c.num_tokens, c.topk
    worst = ep_rows.transport_sizes("worst-case buffers", c, 4, torch.bfloat16)
    live = ep_rows.transport_sizes("live rows", c, 4, torch.bfloat16)
    assert worst == {"capacity_rows": 4 * T * K, "row_bytes": 2 * c.hidden,
                     "max_experts": c.num_experts}
    assert live["capacity_rows"] == int(1.25 * T * K) and live["row_bytes"] == 2 * c.hidden
    assert ep_rows.row_config("worst-case buffers", c, 4).capacity_factor == 4.0
    assert c.exchange_kind == "auto"          # NOTE [auto exchange]: the gathered tokens here
    live_rows = dataclasses.replace(c, exchange_kind="live rows")
    assert ep_rows.row_config("live rows", c, 4) == live_rows
    with pytest.raises(ValueError, match="row: expected one of"):
        ep_rows.transport_sizes("eager peer", c, 4, torch.bfloat16)


def test_layers_fit_the_most_demanding_row():
    q = PRESETS["qwen3-30b-a3b"].__class__(**{**PRESETS["qwen3-30b-a3b"].__dict__,
                                             "capacity_factor": 2.0})
    m = PRESETS["mixtral-8x7b"].__class__(**{**PRESETS["mixtral-8x7b"].__dict__,
                                            "capacity_factor": 2.0})
    h200 = 140 * 2**30
    assert moe_ep.fit_layers(q, 2, 1, 10**15) == moe_ep.LAYERS_CAP        # never above 16
    assert moe_ep.fit_layers(m, 2, 1, 2**20) == 1                         # at least one
    two_gpus = moe_ep.fit_layers(m, 2, 1, h200)
    assert 5 <= two_gpus <= 8                   # 6 Mixtral layers fitted the NCCL-chunk run
    shared = moe_ep.fit_layers(m, 2, 2, h200)   # two ranks on one GPU
    assert shared <= two_gpus // 2 + 1 and shared >= 1
    without_worst = moe_ep.fit_layers(m, 4, 1, h200, rows=("live rows", "eager peer"))
    assert without_worst > moe_ep.fit_layers(m, 4, 1, h200)


def test_a_stash_row_says_how_many_groups_each_rank_stashed():
    """Each rank makes its own stash plan from its own step: where they differ the row gives
    the range over the ranks (the figures are the largest over them), else the one count."""
    r = {"step_ms": 1.0, "peak_mib": None, "activation_peak_mib": None, "sent_mib": 1.0,
         "meta_kib": 1.0, "over_budget": 0, "overflow": 1, "reruns": 1, "calls": 5,
         "groups": 4, "stashed_groups": 3, "stashed_groups_min": 0}
    assert moe_ep.table_row("live rows + stash", r)[-2].endswith("; stashed 0-3/4 groups")
    r["stashed_groups_min"] = 3
    assert moe_ep.table_row("live rows + stash", r)[-2].endswith("; stashed 3/4 groups")


def test_the_table_gives_ratios_and_says_what_did_not_run(capsys):
    def row(ms, sent):
        return {"step_ms": ms, "peak_mib": 100.0, "activation_peak_mib": 40.0,
                "sent_mib": sent, "local_mib": 1.0, "meta_kib": 2.0, "over_budget": 1,
                "overflow": 0, "reruns": 1, "recaptures": 1, "budgets": "1.25-1.9",
                "calls": 23, "stashed_groups": 0, "groups": 0,
                "bytes_counted": "x", "exchange": "x"}

    results = {"eager peer": row(20.0, 10.0), "nccl chunks": {"error": "not available: x"},
               "worst-case buffers": row(16.0, 10.5), "live rows": row(10.0, 10.5)}
    moe_ep.add_ratios(results)
    assert results["live rows"]["vs_eager_peer"] == 0.5
    assert results["live rows"]["vs_worst_case"] == 10.0 / 16.0
    assert results["live rows"]["sent_vs_eager_peer"] == 1.05
    assert "vs_eager_peer" not in results["nccl chunks"]
    entry = {"config": PRESETS["mixtral-8x7b"].__dict__ | {"layers": 6},
             "ep": {"world_size": 2, "kind": "processes", "launch": "2 processes", "gpu": "G"},
             "results": results}
    moe_ep.print_table("mixtral-8x7b", entry)
    out = capsys.readouterr().out
    assert "nccl chunks         not available: x" in out
    assert "1, 0, 1, 1 of 23 calls" in out and "1.25-1.9" in out
    assert "time slice" in out                       # processes sharing a GPU: said so
    lines = [line for line in out.splitlines() if line.startswith("live rows")]
    assert lines and "0.500" in lines[0] and "0.625" in lines[0] and "1.050" in lines[0]


def test_threads_combine_figures_and_report_the_failing_rank():
    cpu = torch.device("cpu")

    def figures(ranks):
        got = (ranks.largest([ranks.rank, -ranks.rank]), ranks.smallest([ranks.rank + 1]),
               ranks.device_total(ranks.rank + 1))
        ranks.sync()
        return got

    out = ep_ranks.run_threads(3, cpu, figures)
    assert out == [([2.0, 0.0], [1.0], 6.0)] * 3

    def one_fails(ranks):
        ranks.sync()
        if ranks.rank == 1:
            raise KeyError("rank one's own error")
        ranks.sync()                  # the others wait here: the failure breaks the barrier

    with pytest.raises(ep_ranks.RankError, match="rank 1 of 3 .* KeyError: \"rank one's own"):
        ep_ranks.run_threads(3, cpu, one_fails)
    assert not [t for t in threading.enumerate() if t.name.startswith("ep-rank-")]


def test_graph_step_takes_release_warmup_cache_as_a_bool():
    from graphstash import graph_step

    assert graph_step(lambda: None, release_warmup_cache=False).options.release_warmup_cache \
        is False
    with pytest.raises(TypeError, match="release_warmup_cache: expected a bool, got str"):
        graph_step(lambda: None, release_warmup_cache="no")


# ---- ranks as spawned processes: a failed rank stops the others --------------------------------
def _spawn(function: str, timeout_s: float, deadline_s: float = 240) -> tuple[dict, float]:
    """``spawn_processes(2, None, <function of tests/_spawned_ranks.py>)`` in a fresh process
    (a hard deadline of its own, ``deadline_s``); what it returned or the RankError's text,
    and its seconds."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    import time

    tests = pathlib.Path(__file__).resolve().parent
    code = ("import json, _spawned_ranks\n"
            "from graphstash.tools.bench import ep_ranks\n"
            "try:\n"
            f"    out = {{'ok': ep_ranks.spawn_processes(2, None, _spawned_ranks.{function}, "
            f"collective_timeout_s={timeout_s})}}\n"
            "except ep_ranks.RankError as exc:\n"
            "    out = {'error': str(exc)}\n"
            "print(json.dumps(out))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=deadline_s)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), seconds


def test_a_failed_spawned_rank_stops_the_others_and_shows_its_own_error():
    """Rank 1 fails while rank 0 waits for it in a collective whose timeout is 1800 s: torch's
    process starter ends rank 0 at once and the error is rank 1's own traceback. The bound
    on the time is far from both what starting two ranks takes (seconds, 138 s once on a
    machine whose 64 cores ran 40 test workers) and the collective's timeout, whose wait
    the fresh process's deadline (900 s) would stop."""
    out, seconds = _spawn("one_rank_fails", timeout_s=1800.0, deadline_s=900)
    assert "error" in out, out
    assert out["error"].startswith("rank 1 of 2 failed (the other ranks were stopped)")
    assert "KeyError" in out["error"] and "rank one's own error" in out["error"]
    assert seconds < 600, seconds                  # not the collective's 1800 s


def test_spawned_ranks_return_their_values_in_rank_order():
    out, _ = _spawn("every_rank_answers", timeout_s=120.0)
    assert out == {"ok": [{"rank": 0, "largest": 1.0, "gathered": [0, 10]},
                          {"rank": 1, "largest": 1.0, "gathered": [0, 10]}]}, out


def test_torchrun_without_a_gpu_is_refused_by_the_device_flag(monkeypatch):
    """Under torchrun every process is a rank on its own GPU; where torch sees none the flag
    that chose the device is named (torch's own error came from deep in the launch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(options.FlagError, match="--device: under torchrun .* torch sees none"):
        moe_ep.launch_from_args(_args("--ep", "2"))
