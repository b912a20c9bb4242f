"""``benchmarks/ep_scaling.py``: the commands it launches and the table it makes of the benches'
JSON (the one-GPU bench's rows renamed to the expert-parallel rows, ratios to the eager peer,
the exchange's share, weak scaling)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--hidden", "16", "--ffn", "24", "--experts", "8", "--topk", "2",
         "--tokens", "16", "--layers", "1", "--steps", "2"]


def _script():
    spec = importlib.util.spec_from_file_location(
        "ep_scaling", os.path.join(ROOT, "benchmarks", "ep_scaling.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(script, *argv):
    import argparse

    ns = argparse.Namespace(tokens=8192, steps=10, capacity_factor=1.25, layers=8,
                            ep1_layers="mixtral-8x7b=fit", rows=script.EP_ROWS, profile=True)
    for key, value in zip(argv[::2], argv[1::2]):
        setattr(ns, key, value)
    return ns


def test_commands_launch_the_bench_per_gpu_count():
    script = _script()
    args = _args(script)
    four = script.bench_argv("qwen3-30b-a3b", 4, "skew:1.5", args)
    assert four[:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "4"]
    tail = four[6:]
    for flag, value in (("--ep", "4"), ("--preset", "qwen3-30b-a3b"), ("--tokens", "8192"),
                        ("--routing", "skew:1.5"), ("--layers", "8"),
                        ("--capacity-factor", "1.25"), ("--modes", script.EP_ROWS)):
        assert tail[tail.index(flag) + 1] == value, (flag, tail)
    assert "--profile" in tail
    one = script.bench_argv("qwen3-30b-a3b", 1, "balanced", args)
    assert "--ep" not in one and one[one.index("--layers") + 1] == "8"
    assert one[one.index("--modes") + 1] == ",".join(script.ONE_GPU_ROWS)
    fit = script.bench_argv("mixtral-8x7b", 1, "balanced", args)
    assert "--layers" not in fit                         # as many as fit one GPU


def _ep_json(path, ep, peer_ms, live_ms, peer_act, live_act, share, local_ms=None):
    """A bench JSON with the keys ``graphstash bench moe --ep`` writes (two rows; with
    ``local_ms`` the no-exchange row, else that row's error, as under skewed routing)."""
    def row(ms, act, kernels):
        return {"step_ms": ms, "activation_peak_mib": act, "sent_mib": 100.0,
                "over_budget": 1, "reruns": 1, "recaptures": 0,
                "kernels": kernels}
    kernels = [{"shares": {"exchange": share / 2}, "exchange_ms": {"push": 3.0, "barrier": 2.5}},
               {"shares": {"exchange": share}, "exchange_ms": {"push": 4.0, "barrier": 1.0}}]
    entry = {"config": {"layers": 8, "routing": "balanced"},
             "ep": {"world_size": ep},
             "results": {"eager peer": row(peer_ms, peer_act, None),
                         "live rows": row(live_ms, live_act, kernels),
                         "no exchange": row(local_ms, live_act, None) if local_ms else
                         {"error": "not available: under routing skew:1.5"}}}
    path.write_text(json.dumps({"meta": {"gpus": ["GPU"] * ep}, "moe": {"p": entry}}))


def test_table_of_the_benches(tmp_path, capsys):
    from graphstash.tools import cli

    script = _script()
    assert cli.main(["bench", "moe", *SMALL, "--modes", ",".join(script.ONE_GPU_ROWS),
                     "--json", str(tmp_path / "p_ep1_balanced.json")]) == 0
    _ep_json(tmp_path / "p_ep2_balanced.json", 2, 100.0, 50.0, 1000.0, 250.0, 0.3)
    _ep_json(tmp_path / "p_ep4_balanced.json", 4, 110.0, 55.0, 1200.0, 240.0, 0.4, local_ms=44.0)
    capsys.readouterr()
    assert script.main(["table", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ")]
    rows = [r for r in cells if r[0].isdigit()]          # not the header
    by = {(r[0], r[3]): r for r in rows}
    assert {k[1] for k in by if k[0] == "1"} == {"eager peer", "live rows", "live rows + stash"}
    live4 = by[("4", "live rows")]
    # push and barrier: each the largest over the ranks
    assert live4[4:] == ["55.00", "2.00x", "240", "0.20", "100.0", "40.0%", "4.00 / 2.50",
                         "1.250", "1 / 1 / 0"], live4
    assert by[("4", "no exchange")][4:12] == ["44.00", "2.50x", "240", "0.20", "100.0", "–",
                                              "–", "1.000"]
    assert by[("2", "eager peer")][9:11] == ["–", "–"]   # no profile: no share, no split
    assert by[("2", "live rows")][11] == "–"             # no no-exchange row there
    assert ("2", "no exchange") not in by                # its error: no line
    assert "- balanced, EP 4 / 2: eager peer 1.100, live rows 1.100" in out


@pytest.mark.slow
def test_table_reads_the_expert_parallel_bench(tmp_path, capsys):
    """The table of a real ``bench moe --ep 2`` JSON (two gloo processes, every row)."""
    from graphstash.tools import cli

    script = _script()
    assert cli.main(["bench", "moe", "--ep", "2", *SMALL, "--json",
                     str(tmp_path / "p_ep2_balanced.json")]) == 0
    data = json.loads((tmp_path / "p_ep2_balanced.json").read_text())
    results = data["moe"]["custom"]["results"]
    capsys.readouterr()
    assert script.main(["table", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row, r in results.items():
        line = next(line for line in out.splitlines() if f"| {row} |" in line)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[4] == f"{r['step_ms']:.2f}", (row, cells)
        ratio = results["eager peer"]["step_ms"] / r["step_ms"]
        assert cells[5] == f"{ratio:.2f}x", (row, cells)
