"""`graphstash bench --plot`: figures from recorded results.

tests/data/bench_h200.json is the JSON that `graphstash bench all --json` wrote on one
NVIDIA H200 (torch 2.11, CUDA 13, CuPy 14.2); plotting needs no GPU.
"""
from __future__ import annotations

import json
import pathlib

import pytest

DATA = pathlib.Path(__file__).resolve().parent / "data" / "bench_h200.json"


def test_plots_every_suite_of_a_recorded_run(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (in the dev extra)")
    from graphstash.tools.bench import SUITES
    from graphstash.tools.bench.plots import write

    results = json.loads(DATA.read_text())
    # The recorded run predates the hf suite: add a result of its shape (one model, its runs).
    results.setdefault("hf", {"qwen3-moe": {
        run: {"step_ms": 40.0 + 10 * k, "peak_mib": 3000.0 - 500 * k, "error": None}
        for k, run in enumerate(("HF grouped_mm eager", "HF grouped_mm + graph_step",
                                 "graphstash + graph_step"))}})
    assert set(results) == set(SUITES)
    paths = write(results, tmp_path / "figures")
    assert sorted(p.name for p in paths) == sorted(f"{s}.png" for s in SUITES)
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path


def test_kernel_figure_has_one_bar_per_measured_shape(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (in the dev extra)")
    from graphstash.tools.bench import plots

    results = json.loads(DATA.read_text())
    plt = plots.pyplot()
    fig = plots.kernels_figure(results["kernels"], plt)
    device_ax, host_ax = fig.axes
    n_device = sum(r["tier"] == "device" for r in results["kernels"]["results"])
    n_host = sum(r["tier"] == "host" for r in results["kernels"]["results"])
    assert len(device_ax.patches) == n_device and len(host_ax.patches) == n_host
    heights = sorted(p.get_height() for p in device_ax.patches)
    ratios = sorted(r["ratio"] for r in results["kernels"]["results"] if r["tier"] == "device")
    assert heights == pytest.approx(ratios)
    plt.close(fig)
