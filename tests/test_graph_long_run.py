"""The long-run probe (benchmarks/probes/long_run.py), reduced to a few dozen CPU steps: the
reference MoE model under graph_step with forced overflows, a float-lr scheduler and checkpoints
saved and loaded mid-run equals its eager control at every step, reruns exactly the forced
overflows, and exits 0. The 2000-step GPU run is the probe itself (README, "Long runs")."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

PROBE = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "long_run.py"


def _probe():
    spec = importlib.util.spec_from_file_location("long_run_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """Tiny grouped GEMMs on a shared 2-core machine: one intra-op thread keeps them from
    waiting on each other (the results do not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_reduced_long_run_on_cpu(capsys, one_thread):
    probe = _probe()
    args = probe.parse_args(["--device", "cpu", "--mode", "stash", "--steps", "30",
                             "--tokens", "32", "--hidden", "16", "--ffn", "32", "--experts", "4",
                             "--layers", "1", "--print-every", "10", "--checkpoint-every", "12",
                             "--overflow-rate", "0.3"])
    result = probe.run(args)
    out = capsys.readouterr().out
    assert all(result["verdict"].values()), (result["verdict"], out)
    assert result["forced"] > 0 and result["stats"]["eager_reruns"] == result["forced"]
    assert result["worst_rel"] == 0.0                  # the CPU runs the same arithmetic
    assert [r["step"] for r in result["rows"]] == [10, 20, 30]
    assert "flat and equal" in out and "reruns" in out


def test_probe_refuses_bad_flags_before_running(capsys):
    probe = _probe()
    for argv, flag in ((["--steps", "0"], "--steps"), (["--overflow-rate", "2"], "--overflow-rate")):
        with pytest.raises(SystemExit):
            probe.parse_args(argv)
        assert flag in capsys.readouterr().err
