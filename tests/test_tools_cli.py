"""The ``graphstash`` command on the CPU: demo and memory run reduced, every bad flag stops the
command before any work with one line naming it, ``bench SUITE --help`` describes the suite,
and what is printed agrees with itself."""
from __future__ import annotations

import argparse
import warnings

import pytest
import torch

from graphstash.models import MoEConfig
from graphstash.tools import cli, demo, memory_command, options, training
from graphstash.tools.bench import SUITES


def _our_warnings(caught) -> list:
    return [str(w.message) for w in caught if "graphstash" in str(w.filename) + str(w.message)]


# ---- the demo --------------------------------------------------------------------------------
def test_demo_runs_on_cpu_and_its_loss_falls(capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = demo.run(device="cpu", steps=3)
    assert _our_warnings(caught) == []
    assert list(results) == ["dropless", "budget", "stash"]
    for mode in ("budget", "stash"):
        torch.testing.assert_close(torch.tensor(results[mode]["losses"]),
                                   torch.tensor(results["dropless"]["losses"]))
    losses = results["dropless"]["losses"]
    assert losses[-1] < 0.95 * losses[0], losses          # the target map is being learnt
    used, spilled, pool = results["stash"]["pages"]
    assert 0 < used <= pool
    captured = capsys.readouterr()
    out = captured.out
    assert "graphstash demo: note: no CUDA GPU in use" in captured.err      # a diagnostic
    assert "no CUDA GPU" not in out and "eager + budget + stash" in out
    assert "pages peak/pool" in out


def test_cli_demo_modes_on_cpu(capsys):
    assert cli.main(["demo", "--device", "cpu", "--steps", "2", "--mode", "stash"]) == 0
    assert "eager + budget + stash" in capsys.readouterr().out
    assert cli.main(["demo", "--device", "cpu", "--steps", "2", "--mode", "paging",
                     "--hidden", "64"]) == 0
    out = capsys.readouterr().out
    assert "rows checked byte for byte" in out and "[512, 64]" in out


def test_demo_says_what_each_shown_step_ran():
    """The line the demo prints for a step names what ran; without CUDA a rerun by capture
    (NOTE [rerun by capture]) is the step run again eagerly, nothing captured."""
    from graphstash.graph import GraphStepStats

    before = GraphStepStats()
    rerun = GraphStepStats(capture_reruns=1)
    assert demo._what_ran(before, rerun, on_gpu=True) == \
        "stash overflow: captured again with a grown stash, replayed"
    assert demo._what_ran(before, rerun, on_gpu=False) == \
        "stash overflow: run again with a grown stash"
    assert demo._what_ran(before, GraphStepStats(eager_reruns=1), on_gpu=True) == \
        "over budget or overflow: rerun eagerly, dropless"
    assert demo._what_ran(before, GraphStepStats(), on_gpu=False) == "eager"


# ---- the memory command ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["stash", pytest.param("budget", marks=pytest.mark.slow),
                                  pytest.param("dropless", marks=pytest.mark.slow)])
def test_cli_memory_runs_tiny_on_the_cpu(capsys, tmp_path, mode):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    plot = tmp_path / "m.png"
    rc = cli.main(["memory", "--device", "cpu", "--mode", mode, "--preset", "mixtral-8x7b",
                   "--layers", "1", "--tokens", "64", "--hidden", "32", "--ffn", "48",
                   "--plot", str(plot)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "float32 on cpu" in out and "no CUDA graph" in out
    assert "1 layers, hidden 32, ffn 48, 8 experts top-2, 64 tokens" in out
    assert "(from" not in out.splitlines()[0]    # every size from a flag or fits the CPU
    assert "peak:" in out and "activation peak:" in out and "parameters" in out
    with open(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    if mode == "stash":
        assert "stash plan" in out and "stash pool" in out


def test_cli_memory_stash_prefetch_on_demand_runs_and_bad_values_are_refused(capsys):
    """``--stash-prefetch`` reaches the stash: ``on_demand`` runs the stash mode, an unknown
    point is refused naming the flag."""
    rc = cli.main(["memory", "--device", "cpu", "--mode", "stash", "--preset", "mixtral-8x7b",
                   "--layers", "2", "--tokens", "64", "--hidden", "32", "--ffn", "48",
                   "--stash-prefetch", "on_demand"])
    assert rc == 0 and "stash plan" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["memory", "--stash-prefetch", "eventually"])
    assert "--stash-prefetch" in capsys.readouterr().err


def _memory_args(*argv):
    return cli.build_parser().parse_args(["memory", *argv])


def test_memory_header_shows_the_sizes_it_runs():
    """``--layers 4 --tokens 1024`` on the CPU: the header says 4 layers and 1024 tokens (the
    flags win), and the widths it reduced say so in place, with what they were."""
    args = _memory_args("--device", "cpu", "--layers", "4", "--tokens", "1024")
    config, reduced = memory_command.sizes(args, on_gpu=False)
    assert (config.layers, config.num_tokens) == (4, 1024)
    assert reduced == {"hidden": MoEConfig().hidden, "ffn": MoEConfig().ffn}
    line = memory_command.header(args, config, reduced, torch.float32, torch.device("cpu"),
                                 on_gpu=False)
    assert ("4 layers, hidden 64 (from 256), ffn 128 (from 512), 8 experts top-2, 1024 tokens"
            in line) and line.endswith("; (from N): reduced for the CPU")
    for field, value in reduced.items():          # a reduced size is shown beside its value
        assert f"{getattr(config, field)} (from {value})" in line


# ---- flags: one line naming the flag, before any work ---------------------------------------
BAD_FLAGS = [
    (["memory", "--plot", "/missing/dir/x.png"], "--plot: expected a file in an existing directory"),
    (["memory", "--plot", "{tmp}/out.txt"], "--plot: expected a file ending in one of"),
    (["memory", "--plot", "{tmp}"], "--plot: expected a file name"),
    (["demo", "--device", "tpu"], "--device: expected one of auto, cpu, cuda, got 'tpu'"),
    (["memory", "--device", "tpu"], "--device: expected one of auto, cpu, cuda, got 'tpu'"),
    (["demo", "--mode", "paging", "--hidden", "-8"], "--hidden: expected a positive multiple of 8, got -8"),
    (["demo", "--hidden", "0"], "--hidden: expected a positive multiple of 8, got 0"),
    (["demo", "--hidden", "7"], "--hidden: expected a positive multiple of 8, got 7"),
    (["memory", "--hidden", "7"], "--hidden: expected a positive multiple of 8, got 7"),
    (["bench", "moe", "--hidden", "7"], "--hidden: expected a positive multiple of 8, got 7"),
    (["demo", "--steps", "1"], "--steps: expected an int >= 2, got 1"),
    (["memory", "--layers", "0"], "--layers: expected a positive int, got 0"),
    (["bench", "moe", "--layers", "0"], "--layers: expected a positive int, got 0"),
    (["memory", "--tokens", "-5"], "--tokens: expected a positive int, got -5"),
    (["bench", "moe", "--tokens", "-5"], "--tokens: expected a positive int, got -5"),
    (["memory", "--capacity-factor", "-1"], "--capacity-factor: expected a finite number > 0"),
    (["bench", "moe", "--capacity-factor", "nan"], "--capacity-factor: expected a finite number > 0"),
    (["memory", "--experts", "4", "--topk", "5"], "--topk: expected at most the experts (4)"),
    (["bench", "moe", "--hidden", "64", "--ffn", "8", "--experts", "4", "--topk", "5"],
     "--topk: expected at most the experts (4)"),
    (["bench", "moe", "--hidden", "64"], "--ffn: a custom shape needs"),
    (["bench", "moe", "--modes", "graph"], "--modes: expected names from"),
    (["bench", "moe", "--steps", "0"], "--steps: expected a positive int, got 0"),
    (["bench", "moe", "--modes", "plain compiled"], "--modes: expected names from"),
    (["bench", "hf", "--layers", "0"], "--layers: expected a positive int, got 0"),
    (["bench", "hf", "--batch", "-2"], "--batch: expected a positive int, got -2"),
    (["bench", "hf", "--seq", "1"], "--seq: expected an int >= 2, got 1"),
    (["bench", "hf", "--steps", "3"], "--steps: expected an int >= 4, got 3"),
    (["bench", "hf", "--runs", "HF compiled"], "--runs: expected names from"),
    (["memory", "--top", "0"], "--top: expected a positive int, got 0"),
    (["memory", "--ep", "1"], "--ep: expected an int >= 2, got 1"),
    (["memory", "--ep", "2"], "--ep: expected to run as one of 2 processes of a torchrun launch"),
    (["memory", "--routing", "skew:x"], "--routing: "),
    (["memory", "--exchange", "live rows"], "--exchange: chooses how expert-parallel ranks"),
    (["bench", "--json", "/missing/dir/r.json"], "--json: expected a file in an existing directory"),
    (["bench", "stash", "--plot", "{tmp}/a_file"], "--plot: expected a directory, got the file"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS)
def test_bad_flag_stops_before_any_work_with_one_line(capsys, tmp_path, monkeypatch, argv,
                                                      message):
    pytest.importorskip("matplotlib", reason="the --plot checks ask matplotlib")
    (tmp_path / "a_file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]

    def no_work(*args, **kwargs):
        raise AssertionError("the command started working before checking its flags")

    monkeypatch.setattr(training, "build", no_work)
    monkeypatch.setattr(demo.PagedStashBuffer, "__init__", no_work)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # bench never runs here
    line = _the_one_error_line(capsys, argv)
    assert line.startswith(f"graphstash {argv[0]}: error: ") and message in line, line


def _the_one_error_line(capsys, argv) -> str:
    """The one line ``graphstash argv`` prints on stderr as it exits with status 2, printing
    nothing on stdout."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, flag", [(["memory", "--mode", "fast"], "--mode"),
                                        (["memory", "--preset", "gpt-5"], "--preset"),
                                        (["memory", "--exchange", "rows"], "--exchange"),
                                        (["bench", "hf", "--preset", "gpt-5"], "--preset"),
                                        (["bench", "moe", "--preset", "olmoe-1b-7b"],
                                         "--preset"),
                                        (["demo", "--size", "huge"], "--size")])
def test_argparse_choices_name_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_capacity_factor_below_one_is_noted_before_the_gpu_check(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "moe", "--capacity-factor", "0.5"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "--capacity-factor" in line]
    assert notes == ["graphstash bench: note: --capacity-factor 0.5 is below 1: rows will be "
                     "over budget (each flagged step is rerun dropless)"]
    assert captured.out == "" and "graphstash bench: error: benchmarks time GPU kernels and " \
        "need a CUDA GPU" in captured.err


def test_validators_name_the_flag_and_accept_good_values():
    assert options.positive_int("--x", None) is None
    assert options.positive_int("--x", 3) == 3
    assert options.hidden_width("--hidden", 64) == 64
    assert options.capacity_factor("--cf", 1.5, command=None) == 1.5
    assert options.device("--device", "cpu") == torch.device("cpu")
    for bad in (True, 2.5, "3"):
        with pytest.raises(options.FlagError, match="--x: expected a positive int"):
            options.positive_int("--x", bad)
    assert issubclass(options.FlagError, ValueError)


# ---- bench -----------------------------------------------------------------------------------
@pytest.mark.parametrize("suite", SUITES + ("all",))
def test_bench_suite_help_describes_the_suite_and_the_gpu(capsys, suite):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["bench", suite, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    out = " ".join(text.split())
    assert f"usage: graphstash bench {suite}" in out
    assert "Needs a CUDA GPU" in out
    if suite != "all":
        from graphstash.tools.bench import suite_module

        assert "".join(suite_module(suite).DESCRIPTION.split()) in "".join(text.split())
    if suite in ("moe", "all"):
        assert "--capacity-factor" in out and "--preset" in out and "--profile" in out
        for mode in ("plain compiled eager", "plain compiled graph", "graph + budget compiled"):
            assert mode in out
    if suite in ("hf", "all"):
        for option in ("--preset", "--layers", "--batch", "--seq", "--steps", "--runs",
                       "olmoe-1b-7b", "graphstash + compile + graph_step",
                       "HF grouped_mm + compile (reduce-overhead)"):
            assert option in out, option
    if suite not in ("moe", "hf", "all"):
        assert "--preset" not in out


@pytest.mark.parametrize("argv", [[], ["info"], ["demo"], ["memory"], ["bench"]]
                         + [["bench", suite] for suite in SUITES + ("all",)])
def test_help_is_short_and_plain(capsys, argv):
    """Every command's and suite's help describes it in a few lines of plain text: no
    reStructuredText markup from the modules' docstrings (they stay for the docs)."""
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args([*argv, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]            # after the usage block
    assert len(description.splitlines()) <= 8, description
    for markup in ("``", ":mod:", ":func:", ":class:", ":data:", "NOTE" + " ["):
        assert markup not in text, (markup, text)


def test_version_is_written_once_and_printed(capsys):
    """``graphstash --version`` prints graphstash.__version__, which pyproject.toml reads (its
    version is dynamic: the one place it is written is graphstash/__init__.py)."""
    import pathlib
    import tomllib

    import graphstash

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"graphstash {graphstash.__version__}"
    root = pathlib.Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == \
        {"attr": "graphstash.__version__"}


def test_the_version_is_read_without_importing_torch(tmp_path):
    """setuptools reads ``graphstash.__version__`` from the source, as ``pip install -e .``
    does in its isolated build environment, where torch is not installed."""
    import pathlib
    import subprocess
    import sys

    import graphstash

    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("import sys; sys.modules['torch'] = None\n"      # import torch fails
            "from setuptools.config.expand import read_attr\n"
            f"print(read_attr('graphstash.__version__', root_dir={str(root)!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == graphstash.__version__


def test_python_dash_m_graphstash_runs_the_command():
    import pathlib
    import subprocess
    import sys

    import graphstash

    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "graphstash", "--version"], cwd=root,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"graphstash {graphstash.__version__}"


# ---- one error format --------------------------------------------------------------------------
ARGPARSE_ERRORS = [
    (["bench", "moe", "--steps", "abc"], "graphstash bench: error: --steps: expected an int, "
                                         "got 'abc'"),
    (["bench", "all", "--steps", "abc"], "graphstash bench: error: --steps: expected an int, "
                                         "got 'abc'"),
    (["bench", "moe", "--capacity-factor", "x"],
     "graphstash bench: error: --capacity-factor: expected a number, got 'x'"),
    (["memory", "--mode", "fast"], "graphstash memory: error: --mode: expected one of dropless, "
                                   "budget, stash, got 'fast'"),
    (["demo", "--steps"], "graphstash demo: error: --steps: expected a value, got none"),
    (["bench", "moe", "--frobnicate"], "graphstash bench: error: --frobnicate: not an option of "
                                       "graphstash bench moe (graphstash bench moe --help lists "
                                       "them)"),
    (["bench", "nothing"], "graphstash bench: error: suite: expected one of kernels, stash, "
                           "graph, moe, offload, hf, all, got 'nothing'"),
    ([], "graphstash: error: command: expected a value, got none"),
    (["bench", "all", "--ep", "2"], "graphstash bench: error: --ep: only the moe suite takes "
                                    "it, run alone"),
    (["bench", "all", "--runs", "HF compiled"], "--runs: expected names from"),
    (["bench", "all", "--steps", "3"], "graphstash bench: error: --steps: expected an int >= 4, "
                                       "got 3 (bench all hands it to the hf suite)"),
    (["bench", "kernels", "--device", "cpu"], "graphstash bench: error: --device: cpu runs the "
                                              "moe and hf suites only; kernels times GPU kernels"),
    (["bench", "moe", "--device", "cpu", "--profile"], "graphstash bench: error: --profile: "
                                                       "the kernel-time shares are read from "
                                                       "CUDA kernels"),
]


@pytest.mark.parametrize("argv, message", ARGPARSE_ERRORS)
def test_every_mistake_is_one_line_naming_the_flag(capsys, monkeypatch, argv, message):
    """Values of the wrong type, unknown options and choices, and flags a command cannot take
    read as the flag checks do: one line on stderr, ``graphstash <command>: error: <flag>:
    ...``, exit status 2, nothing on stdout."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _the_one_error_line(capsys, argv)
    assert message in line and line.startswith(f"graphstash {argv[0]}: error: " if argv
                                               else "graphstash: "), line


def test_bench_all_forwards_each_flag_to_the_suite_that_takes_it():
    from graphstash.tools.bench import forward

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "all", "--preset", "olmoe-1b-7b", "--runs",
                              "graphstash + compile", "--batch", "2", "--layers", "3",
                              "--steps", "6", "--hidden", "64", "--ffn", "96", "--experts", "4",
                              "--topk", "2"])
    hf_args, moe_args = forward.suite_args(args, "hf"), forward.suite_args(args, "moe")
    assert (hf_args.hf_preset, hf_args.hf_runs, hf_args.hf_batch, hf_args.hf_layers,
            hf_args.hf_steps) == ("olmoe-1b-7b", "graphstash + compile", 2, 3, 6)
    assert moe_args.preset is None and (moe_args.hidden, moe_args.layers, moe_args.steps) == \
        (64, 3, 6)
    args = parser.parse_args(["bench", "all", "--preset", "mixtral-8x7b"])
    assert forward.suite_args(args, "moe").preset == "mixtral-8x7b"
    assert forward.suite_args(args, "hf").hf_preset is None
    one = parser.parse_args(["bench", "hf", "--preset", "mixtral"])
    assert forward.suite_args(one, "hf") is one


def test_bench_options_before_or_after_the_suite():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quick", "moe", "--layers", "2"])
    assert (args.suite, args.quick, args.layers) == ("moe", True, 2)
    args = parser.parse_args(["bench", "stash", "--quick"])
    assert (args.suite, args.quick, args.json_path) == ("stash", True, None)
    args = parser.parse_args(["bench"])
    assert args.suite is None and not args.quick          # runs the kernels suite
    args = parser.parse_args(["bench", "--quick", "hf", "--preset", "olmoe-1b-7b", "--layers",
                              "2", "--seq", "512", "--runs", "graphstash + compile"])
    assert (args.suite, args.quick, args.hf_preset, args.hf_layers, args.hf_seq,
            args.hf_runs) == ("hf", True, "olmoe-1b-7b", 2, 512, "graphstash + compile")
    args = parser.parse_args(["bench", "moe", "--profile"])
    assert args.profile


def test_cli_module_is_the_installed_script():
    import tomllib

    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"graphstash": "graphstash.tools.cli:main"}
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)


@pytest.mark.gpu
def test_cli_memory_on_the_gpu(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    rc = cli.main(["memory", "--device", "cuda", "--preset", "qwen3-30b-a3b", "--mode",
                   "stash", "--layers", "2", "--tokens", "2048", "--plot",
                   str(tmp_path / "m.png")])
    out = capsys.readouterr().out
    assert rc == 0 and "CUDA graph capture" in out and "the allocator counts" in out
    assert "stash plan" in out and "lie in CUDA-graph pools" in out
    assert "2 layers" in out and "2048 tokens" in out and "(from" not in out.splitlines()[0]
