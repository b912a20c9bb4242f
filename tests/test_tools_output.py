"""What the ``graphstash`` command prints while it works and what its results carry, checked on
a quick run in a process of its own (``--device cpu``: the moe suite's loop eagerly):

- progress: a bar per configuration and mode with its ETA on stderr when stderr is a terminal
  (a pseudo-terminal here), nothing there when it is not, and each row on stdout as soon as
  it is measured (before the next mode's bar starts);
- provenance: the ``--json`` file's ``meta`` block (versions, GPUs, the command line, the
  commit, the time) and the spread beside every median; ``--format md`` prints the same table
  as Markdown with the source line under it;
- ``graphstash memory``: its progress bar, and ``--snapshot`` refused on the CPU by name.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--device", "cpu", "--hidden", "32", "--ffn", "48", "--experts", "4", "--topk", "2",
        "--layers", "1", "--tokens", "64", "--steps", "2"]
MODES = ["--modes", "plain eager,eager dropless"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]), COLUMNS="160")


def _command(*argv) -> list:
    return [sys.executable, "-m", "graphstash", *argv]


def _on_a_terminal(argv: list, merged: bool) -> tuple[str, str]:
    """Run ``argv`` with stderr on a pseudo-terminal (160 columns; with ``merged`` stdout too,
    so the order of rows and bars shows); returns (what the terminal got, stdout)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    proc = subprocess.Popen(argv, stdout=slave if merged else subprocess.PIPE, stderr=slave,
                            env=_env(), cwd=ROOT)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:               # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = b"" if merged else proc.stdout.read()
    assert proc.wait(timeout=300) == 0
    os.close(master)
    return b"".join(chunks).decode(errors="replace"), out.decode()


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """The quick bench with stdout and stderr on pipes, ``--json``: (stdout, stderr, JSON)."""
    path = tmp_path_factory.mktemp("bench") / "moe.json"
    done = subprocess.run(_command("bench", "moe", *TINY, *MODES, "--json", str(path)),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr, json.loads(path.read_text())


def test_bars_with_their_eta_on_a_terminal_and_rows_as_they_are_measured():
    terminal, _ = _on_a_terminal(_command("bench", "moe", *TINY, *MODES), merged=True)
    assert "bench moe:" in terminal                         # the run's bar, over the modes
    for mode in ("plain eager", "eager dropless"):
        assert f"custom: {mode}:" in terminal               # a bar per configuration and mode
    assert re.search(r"\d+/5 \[\d\d:\d\d<\d\d:\d\d", terminal)    # steps done, elapsed<ETA
    row = re.search(r"plain eager +\d+\.\d\d +\d", terminal)       # its row in the table
    next_bar = terminal.find("custom: eager dropless:")
    assert row and 0 < row.start() < next_bar, "the row waited for the next mode"


def test_no_bars_when_stderr_is_not_a_terminal(quiet_run):
    out, err, _ = quiet_run
    assert "bench moe:" not in err and "it/s" not in err and "step/s" not in err, err
    rows = [line for line in out.splitlines() if line.startswith(("plain eager ",
                                                                 "eager dropless "))]
    assert len(rows) == 2, out


def test_the_json_says_where_it_came_from(quiet_run):
    import graphstash

    _, _, results = quiet_run
    meta = results["meta"]
    assert set(meta) >= {"graphstash", "commit", "python", "torch", "cuda", "cupy", "driver",
                         "gpu_count", "gpus", "command", "time"}
    assert meta["graphstash"] == graphstash.__version__
    assert meta["command"].startswith("graphstash bench moe --device cpu --hidden 32")
    assert meta["gpu_count"] == len(meta["gpus"])
    assert re.fullmatch(r"[0-9a-f]{40}(\+changes)?", meta["commit"] or ""), meta["commit"]
    from graphstash.tools import provenance

    assert meta["sources"] == provenance.source_digest(), meta["sources"]
    assert re.fullmatch(r"[0-9a-f]{12}", meta["sources"] or ""), meta["sources"]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", meta["time"])


def test_the_source_digest_follows_the_sources_and_nothing_else(tmp_path):
    """NOTE [source digest]: one byte of a source, or a source renamed, changes the digest;
    caches and built objects beside them do not, nor the order the roots are given in."""
    from graphstash.tools.provenance import source_digest

    pkg, kernels = tmp_path / "pkg", tmp_path / "kernels"
    (pkg / "sub").mkdir(parents=True)
    kernels.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (kernels / "k.cu").write_text("__global__ void k() {}\n")
    roots = [str(pkg), str(kernels)]
    first = source_digest(roots)
    assert re.fullmatch(r"[0-9a-f]{12}", first) and source_digest(roots[::-1]) == first
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (kernels / "k.so").write_bytes(b"\0")
    assert source_digest(roots) == first
    (pkg / "a.py").write_text("x = 2\n")
    assert source_digest(roots) != first
    (pkg / "a.py").write_text("x = 1\n")
    assert source_digest(roots) == first
    (pkg / "sub" / "b.py").rename(pkg / "b.py")
    assert source_digest(roots) != first
    assert source_digest([str(pkg), str(tmp_path / "missing")]) is None


def _medians(tree, where=""):
    """``(path, figures)`` of every dict in ``tree`` that holds a median step time."""
    if isinstance(tree, dict):
        if "step_ms" in tree:
            yield where, tree
        for key, value in tree.items():
            yield from _medians(value, f"{where}/{key}")


def test_every_median_has_its_spread_beside_it(quiet_run):
    _, _, results = quiet_run
    found = list(_medians(results["moe"]))
    assert len(found) == 2
    for where, figures in found:
        s = figures["step_ms_spread"]
        assert s["n"] == 2 and s["median"] == figures["step_ms"], where
        assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"], (where, s)


def test_markdown_tables_carry_their_source_line():
    done = subprocess.run(_command("bench", "moe", *TINY, *MODES, "--format", "md"),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    head = lines.index("| mode | step ms | min-max ms | /best | peak MiB | act MiB | act/best "
                       "| sent MiB | flags (over budget, overflow, reruns, recaptures) "
                       "| budgets |")
    assert lines[head + 1] == "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"
    assert lines[head + 2].startswith("| plain eager | ")
    assert lines[head + 3].startswith("| eager dropless | ")
    assert lines[head + 4] == "" and lines[head + 5].startswith("source: graphstash ")
    assert "`graphstash bench moe --device cpu" in lines[head + 5]


def test_the_memory_command_shows_its_progress():
    terminal, out = _on_a_terminal(_command("memory", "--device", "cpu", "--mode", "dropless",
                                            "--layers", "1", "--tokens", "64"), merged=False)
    assert "memory: warmup, then the recorded steps" in terminal and "3/3" in terminal
    assert "peak:" in out


def test_memory_snapshot_is_refused_on_the_cpu_by_name(tmp_path):
    done = subprocess.run(_command("memory", "--device", "cpu", "--snapshot",
                                   str(tmp_path / "s.pickle")),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "graphstash memory: error: --snapshot: torch's memory snapshot records the CUDA "
        "caching allocator; the run is on cpu, which has none (--device cuda on a GPU)"]
    assert not (tmp_path / "s.pickle").exists()


def test_a_report_writes_the_snapshot_it_holds(tmp_path):
    """``profile(snapshot=True)`` is refused on the CPU by its argument; a report holding torch's
    snapshot writes it as the pickle memory_viz loads, one without refuses by name."""
    import pickle

    import torch

    import graphstash
    from graphstash.memory import MemoryReport

    with pytest.raises(ValueError, match="snapshot: expected False on cpu"):
        graphstash.memory.profile(lambda x: x * 2, torch.ones(3), snapshot=True)
    snapshot = {"segments": [{"address": 1, "blocks": []}], "device_traces": [[]]}
    report = MemoryReport(device="cuda:0", peak=0, peak_event=None, blocks=[], events=[],
                          snapshot=snapshot)
    path = report.write_snapshot(tmp_path / "s.pickle")
    with open(path, "rb") as f:
        assert pickle.load(f) == snapshot
    with pytest.raises(ValueError, match="snapshot: this report holds none"):
        MemoryReport(device="cpu", peak=0, peak_event=None, blocks=[],
                     events=[]).write_snapshot(tmp_path / "t.pickle")


@pytest.mark.gpu
def test_memory_snapshot_on_the_gpu_loads_as_torch_wrote_it(tmp_path):
    import pickle

    path = tmp_path / "snapshot.pickle"
    done = subprocess.run(_command("memory", "--device", "cuda", "--preset", "qwen3-30b-a3b",
                                   "--layers", "1", "--tokens", "1024", "--snapshot",
                                   str(path)),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"wrote {path}" in done.stdout
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(snapshot["device_traces"])   # memory_viz's input
    frames = [e.get("frames") for trace in snapshot["device_traces"] for e in trace]
    assert any(frames), "the history carries Python stacks"
